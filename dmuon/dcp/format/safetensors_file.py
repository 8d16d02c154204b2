"""The safetensors file format, read and written by dmuon, and HuggingFace's layout of them.

A safetensors file is an 8-byte little-endian header length, a JSON header (each tensor's
dtype, shape and ``data_offsets`` into the data), then the tensors' bytes, row-major, end to
end. A row range of a tensor is therefore one byte range: a reader fetches only the rows it
holds (:func:`read_rows`). A writer that knows every key, shape and dtype up front (an export
does, from the checkpoint metadata) lays out the header before the first byte of data and then
streams the tensors one at a time (:func:`write_safetensors`).

A model in HuggingFace's layout is ``model.safetensors``, or ``model-0000i-of-0000N.safetensors``
shards listed by ``model.safetensors.index.json`` (``format.layout`` names the files).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from ..storage.base import Store, checked_name
from .layout import HF_INDEX_FILE, HF_SINGLE_FILE
from .tensor_bytes import tensor_memory, write_in_slices

__all__ = [
    "DTYPE_OF",
    "SAFETENSORS_DTYPES",
    "TensorLocation",
    "hf_model_files",
    "read_header",
    "read_rows",
    "write_safetensors",
]

SAFETENSORS_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}
DTYPE_OF = {name: dtype for dtype, name in SAFETENSORS_DTYPES.items()}
_MAX_HEADER = 100 * 2**20

TensorLayout = tuple[str, torch.dtype, tuple[int, ...]]
"""(key, dtype, shape) of one tensor a file is to hold."""


@dataclass
class TensorLocation:
    file: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # absolute byte offset in the file
    end: int


def _nbytes(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    return math.prod(shape) * dtype.itemsize


def read_header(store: Store, name: str) -> dict[str, TensorLocation]:
    """Where each tensor of the file ``name`` lies; checked against its dtype and shape."""
    with store.open_read(checked_name(name)) as stream:
        size = int.from_bytes(stream.read(8), "little")
        if not 0 < size <= _MAX_HEADER:
            raise ValueError(f"{store.url}/{name}: not a safetensors file (header size {size})")
        header = json.loads(stream.read(size))
    base = 8 + size
    out = {}
    for key, info in header.items():
        if key == "__metadata__":
            continue
        dtype = DTYPE_OF.get(info["dtype"])
        if dtype is None:
            raise ValueError(f"{store.url}/{name}: {key} has unsupported dtype {info['dtype']}")
        begin, end = info["data_offsets"]
        shape = tuple(info["shape"])
        if end - begin != _nbytes(dtype, shape):
            raise ValueError(f"{store.url}/{name}: {key} has {end - begin} bytes for shape {shape}")
        out[key] = TensorLocation(name, dtype, shape, base + begin, base + end)
    return out


def hf_model_files(store: Store) -> list[str]:
    """The safetensors files of a model in HuggingFace's layout in ``store``: the shards its
    index lists, or its one file."""
    files = store.list()
    if HF_INDEX_FILE in files:
        weight_map = json.loads(store.read(HF_INDEX_FILE))["weight_map"]
        return sorted(set(weight_map.values()))
    if HF_SINGLE_FILE in files:
        return [HF_SINGLE_FILE]
    raise FileNotFoundError(f"{store.url}: no {HF_SINGLE_FILE} or {HF_INDEX_FILE}")


def read_rows(store: Store, loc: TensorLocation, rows: tuple[int, int] | None) -> torch.Tensor:
    """Rows ``[start, stop)`` of the tensor at ``loc`` (all of it for ``None``): one ranged read."""
    shape = loc.shape
    row_bytes = (loc.end - loc.start) // shape[0] if shape and shape[0] else 0
    start, stop = rows if rows is not None else (0, shape[0] if shape else 1)
    out_shape = (stop - start, *shape[1:]) if shape else ()
    out = torch.empty(out_shape, dtype=loc.dtype)
    nbytes = out.numel() * out.element_size()
    if nbytes:
        offset = loc.start + start * row_bytes if shape else loc.start
        with store.open_read(checked_name(loc.file)) as stream:
            stream.seek(offset)
            got = stream.readinto(tensor_memory(out))  # type: ignore[attr-defined]
        if got != nbytes:
            raise ValueError(f"{store.url}/{loc.file}: short read ({got} of {nbytes} bytes)")
    return out


def write_safetensors(
    store: Store,
    name: str,
    layout: Sequence[TensorLayout],
    tensors: Iterable[torch.Tensor],
    metadata: dict | None = None,
) -> None:
    """The file ``name`` holding ``tensors``, which arrive one at a time in ``layout``'s order,
    each with the dtype and shape ``layout`` gives it."""
    header: dict = {"__metadata__": {"format": "pt", **(metadata or {})}}
    offset = 0
    for key, dtype, shape in layout:
        if dtype not in SAFETENSORS_DTYPES:
            raise ValueError(f"{key}: dtype {dtype} has no safetensors equivalent")
        nbytes = _nbytes(dtype, shape)
        header[key] = {
            "dtype": SAFETENSORS_DTYPES[dtype],
            "shape": list(shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # data starts 8-byte aligned
    with store.open_write(name) as out:
        out.write(len(raw).to_bytes(8, "little"))
        out.write(raw)
        for _entry, tensor in zip(layout, tensors):
            write_in_slices(out, tensor_memory(tensor.contiguous()))
            # Let go before the next tensor is read: allocating it while this one lives
            # fragments the heap, and RSS then climbs by a tensor per tensor.
            del tensor
