"""A tensor's bytes as a buffer, without copies, and written out in bounded slices.

Every file format dmuon writes (``torch_file``, ``safetensors_file``) and the data files of a
save take a tensor's bytes from its own memory; a write of one slice at a time keeps what a
stream buffers bounded and lets a caller checksum each slice as it passes.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["SLICE", "tensor_memory", "write_in_slices"]

SLICE = 8 << 20  # bytes handed to the stream per write: bounded, and big enough for fast I/O


def tensor_memory(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy."""
    if tensor.numel() == 0:
        return memoryview(b"")
    flat = tensor.detach().reshape(-1).view(torch.uint8)
    return memoryview(flat.numpy())  # type: ignore[arg-type]


def write_in_slices(out: Any, data) -> int:
    """``data`` to ``out`` in :data:`SLICE`-sized writes; the number of bytes written."""
    view = memoryview(data).cast("B")
    for start in range(0, view.nbytes, SLICE):
        out.write(view[start : start + SLICE])
    return view.nbytes
