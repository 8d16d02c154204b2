"""Tensors in the ``torch.save`` file format, written and read without ``torch.save``/``torch.load``.

What a ``torch.save`` payload of tensors holds, record by record: the pickle (``data.pkl``,
tensors as references to storage records, built from shape-only stand-ins), the storage
records themselves, and the small records around them; the zip container that holds the
records is ``torch_zip``'s. ``torch.load(weights_only=True)`` reads what is written here.

Why not ``torch.save``: it computes a zip CRC-32 of every record, which ``torch.load`` never
checks and which costs as much CPU as writing the bytes (dmuon checksums every item in its
manifest instead); turning it off is a process-wide switch
(``torch.serialization.set_crc32_options``) that would race with the user's own saves. Here the
CRC fields are left 0, as ``torch.save`` does with that switch off, and each storage's bytes go
from the tensor's memory to the output stream with no intermediate copy, in slices, so the
caller can checksum each slice as it passes.

Reading (:func:`tensor_from_payload`) takes a view over the stored bytes of a one-storage
payload, which saves ``torch.load``'s unpickling and a copy.
"""

from __future__ import annotations

import collections
import io
import math
import pickle
import sys
import warnings
from collections.abc import Callable
from typing import Any

import torch

from ... import compat
from .tensor_bytes import tensor_memory, write_in_slices
from .torch_zip import STORAGE_ALIGNMENT, Placement, TorchFileWriter, single_record_offset

__all__ = [
    "TensorFrames",
    "pickled_tensors",
    "tensor_frame",
    "tensor_from_payload",
    "write_postamble",
    "write_preamble",
    "write_tensor_payload",
]


# ---------------------------------------------------------------------------------------------
# the pickle: tensors as references to storages written as separate records
# ---------------------------------------------------------------------------------------------
class _StorageRef:
    def __init__(self, key: str, dtype: torch.dtype, numel: int) -> None:
        self.key, self.dtype, self.numel = key, dtype, numel


class _TensorRef:
    """Pickles exactly as a contiguous CPU tensor of ``shape`` over storage ``storage``."""

    def __init__(self, storage: _StorageRef, shape: tuple[int, ...]) -> None:
        self.storage, self.shape = storage, shape

    def __reduce_ex__(self, protocol):
        stride = []
        step = 1
        for size in reversed(self.shape):
            stride.append(step)
            step *= max(size, 1)
        return (
            compat.rebuild_tensor,
            (self.storage, 0, torch.Size(self.shape), tuple(reversed(stride)), False, collections.OrderedDict()),
        )


class _RefPickler(pickle.Pickler):
    def persistent_id(self, obj):
        if isinstance(obj, _StorageRef):
            storage_type = getattr(torch, compat.storage_type_names()[obj.dtype])
            return ("storage", storage_type, obj.key, "cpu", obj.numel)
        return None


def pickled_tensors(tensors: dict[str, tuple[str, torch.dtype, tuple[int, ...]]]) -> bytes:
    """``data.pkl`` for ``{name: (storage key, dtype, shape)}``; names sharing a key share it."""
    storages: dict[str, _StorageRef] = {}
    refs = {}
    for name, (key, dtype, shape) in tensors.items():
        if key not in storages:
            storages[key] = _StorageRef(key, dtype, math.prod(shape))
        refs[name] = _TensorRef(storages[key], shape)
    buffer = io.BytesIO()
    _RefPickler(buffer, protocol=2).dump(refs)
    return buffer.getvalue()


def _pickled_tensor(dtype: torch.dtype, shape: tuple[int, ...]) -> bytes:
    buffer = io.BytesIO()
    _RefPickler(buffer, protocol=2).dump(_TensorRef(_StorageRef("0", dtype, math.prod(shape)), shape))
    return buffer.getvalue()


# ---------------------------------------------------------------------------------------------
# the records around the storages
# ---------------------------------------------------------------------------------------------
def write_preamble(writer: TorchFileWriter, pickled: bytes) -> None:
    """The records ``torch.save`` writes before the storages: the pickle, then its format."""
    writer.write_record("data.pkl", pickled)
    writer.write_record(".format_version", b"1")
    writer.write_record(".storage_alignment", str(STORAGE_ALIGNMENT).encode())
    writer.write_record("byteorder", sys.byteorder.encode())


def write_postamble(writer: TorchFileWriter) -> None:
    """The record after the storages, then the zip's central directory."""
    writer.write_record("version", b"3\n")
    writer.close()


def tensor_frame(tensor: torch.Tensor, place: Placement | None = None) -> tuple[bytes, bytes]:
    """The bytes ``torch.save`` puts before and after a contiguous CPU tensor's data.

    They depend on the dtype, the shape and ``place`` only (offsets in the zip are relative to
    the payload's start), so a writer of many tensors builds them once per dtype, shape and
    placement (:class:`TensorFrames`).
    """
    return _frame_after(_preamble(tensor), tensor, place)


_Preamble = tuple[bytes, list[bytes]]  # the records before a tensor's own, and their central entries


def _preamble(tensor: torch.Tensor) -> _Preamble:
    out = io.BytesIO()
    writer = TorchFileWriter(out)
    write_preamble(writer, _pickled_tensor(tensor.dtype, tuple(tensor.shape)))
    return out.getvalue(), writer.central


def _frame_after(preamble: _Preamble, tensor: torch.Tensor, place: Placement | None) -> tuple[bytes, bytes]:
    records, central = preamble
    out = io.BytesIO()
    head_len = -1

    def skip_data(view: memoryview) -> None:
        nonlocal head_len
        head_len = out.tell()

    writer = TorchFileWriter(out, pos=len(records), central=central)  # as if it had just written them
    writer.write_record("data/0", tensor_memory(tensor), align=True, place=place, write_data=skip_data)
    write_postamble(writer)
    rest = out.getvalue()
    return records + rest[:head_len], rest[head_len:]


class TensorFrames:
    """The framing (:func:`tensor_frame`) of the tensors of one file: built once per dtype,
    shape and placement, and the records before each tensor's own (its pickle above all) once
    per dtype and shape. A writer keeps one per data file and drops it with the file."""

    def __init__(self) -> None:
        self._preambles: dict[tuple, _Preamble] = {}
        self._frames: dict[tuple, tuple[bytes, bytes]] = {}

    def frame(self, tensor: torch.Tensor, place: Placement | None = None) -> tuple[bytes, bytes]:
        shape_key = (tensor.dtype, tuple(tensor.shape))
        frame = self._frames.get((shape_key, place))
        if frame is None:
            preamble = self._preambles.get(shape_key)
            if preamble is None:
                preamble = self._preambles[shape_key] = _preamble(tensor)
            frame = self._frames[(shape_key, place)] = _frame_after(preamble, tensor, place)
        return frame


def write_tensor_payload(
    out: Any,
    tensor: torch.Tensor,
    *,
    write_data: Callable[[memoryview], None] | None = None,
    frames: TensorFrames | None = None,
    place: Placement | None = None,
) -> None:
    """What ``torch.save(tensor, out)`` writes for a contiguous CPU tensor, minus zip CRCs.

    ``write_data(view)``, if given, writes the tensor's bytes instead of ``out.write`` (a
    checksumming stream checksums them block by block). ``frames``: the framing already built
    for the tensors of this file. ``place``: where the tensor's bytes start, relative to the
    payload's start, instead of the next 64-byte boundary.
    """
    frame = frames.frame(tensor, place) if frames is not None else tensor_frame(tensor, place)
    head, tail = frame
    out.write(head)
    view = tensor_memory(tensor)
    if write_data is not None:
        write_data(view)
    else:
        write_in_slices(out, view)
    out.write(tail)


# ---------------------------------------------------------------------------------------------
# reading
# ---------------------------------------------------------------------------------------------
def tensor_from_payload(data: bytes, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """The tensor a ``torch.save`` payload of a contiguous ``shape``/``dtype`` tensor holds:
    a read-only view over ``data`` where it can be, else ``torch.load(weights_only=True)``."""
    numel = math.prod(shape)
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    start = single_record_offset(data, nbytes)
    if start is None:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # read-only bytes: the view is only ever copied from
        flat = torch.frombuffer(data, dtype=dtype, count=numel, offset=start)
    return flat.view(shape)
