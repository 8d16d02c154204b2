"""HuggingFace safetensors interop: load pretrained weights into a dmuon model.

Each rank reads only the bytes it holds: owners their whole dedicated matrices, FSDP2 ranks
their row range (safetensors stores tensors row-major, so a row range is one byte range).
Works on local paths and fsspec URLs; the file's header is read once per file.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass

import torch
from torch import nn

from ..state_dict import StateDictError, check_fits, write_full_state
from .format.layout import HF_INDEX_FILE, HF_SINGLE_FILE, METADATA
from .storage.base import checked_name, open_store

__all__ = [
    "DTYPE_OF",
    "SAFETENSORS_DTYPES",
    "TensorLocation",
    "is_safetensors_checkpoint",
    "load_safetensors",
    "read_header",
    "safetensors_index",
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


@dataclass
class TensorLocation:
    file: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # absolute byte offset in the file
    end: int


def _split(checkpoint_id: str | os.PathLike) -> tuple[str, str | None]:
    """(directory, file name) for a ``.safetensors`` file; (directory, None) for a directory."""
    text = os.fspath(checkpoint_id).rstrip("/")
    if text.endswith(".safetensors"):
        head, _, name = text.rpartition("/")
        return head or ".", name
    return text, None


def is_safetensors_checkpoint(checkpoint_id: str | os.PathLike, storage_options: dict | None = None) -> bool:
    directory, name = _split(checkpoint_id)
    if name is not None:
        return True
    files = open_store(directory, storage_options).list()
    return METADATA not in files and (HF_SINGLE_FILE in files or HF_INDEX_FILE in files)


def read_header(store, name: str) -> dict[str, TensorLocation]:
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
        if end - begin != math.prod(shape) * torch.empty((), dtype=dtype).element_size():
            raise ValueError(f"{store.url}/{name}: {key} has {end - begin} bytes for shape {shape}")
        out[key] = TensorLocation(name, dtype, shape, base + begin, base + end)
    return out


def safetensors_index(checkpoint_id: str | os.PathLike, storage_options: dict | None = None):
    """(store, {key: TensorLocation}) for a file, a directory with one file, or a sharded one."""
    directory, name = _split(checkpoint_id)
    store = open_store(directory, storage_options)
    if name is None:
        files = store.list()
        if HF_INDEX_FILE in files:
            weight_map = json.loads(store.read(HF_INDEX_FILE))["weight_map"]
            names = sorted(set(weight_map.values()))
        elif HF_SINGLE_FILE in files:
            names = [HF_SINGLE_FILE]
        else:
            raise FileNotFoundError(f"{directory}: no {HF_SINGLE_FILE} or {HF_INDEX_FILE}")
    else:
        names = [name]
    locations: dict[str, TensorLocation] = {}
    for file in names:
        locations.update(read_header(store, file))
    return store, locations


def _read_rows(store, loc: TensorLocation, rows: tuple[int, int] | None) -> torch.Tensor:
    shape = loc.shape
    row_bytes = (loc.end - loc.start) // shape[0] if shape and shape[0] else 0
    start, stop = rows if rows is not None else (0, shape[0] if shape else 1)
    out_shape = (stop - start, *shape[1:]) if shape else ()
    out = torch.empty(out_shape, dtype=loc.dtype)
    nbytes = out.numel() * out.element_size()
    if nbytes:
        offset = loc.start + start * row_bytes if shape else loc.start
        with store.open_read(loc.file) as stream:
            stream.seek(offset)
            view = memoryview(out.reshape(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]
            got = stream.readinto(view)
        if got != nbytes:
            raise ValueError(f"{store.url}/{loc.file}: short read ({got} of {nbytes} bytes)")
    return out


def load_safetensors(
    model: nn.Module, checkpoint_id: str | os.PathLike, *, storage_options: dict | None = None, strict: bool = True
) -> None:
    """Collective in spirit (every rank calls it) but communication-free: each reads its part.

    Keys, shapes: checked for every key before anything is written. Dtypes may differ (bf16
    weights into fp32 masters are cast).
    """
    store, locations = safetensors_index(checkpoint_id, storage_options)
    try:
        check_fits(
            model,
            {k: loc.shape for k, loc in locations.items()},
            strict=strict,
            what=f"load of {os.fspath(checkpoint_id)}",
        )
    except StateDictError as exc:
        from .errors import CheckpointMismatchError

        raise CheckpointMismatchError(str(exc)) from None
    write_full_state(model, locations.keys(), lambda key, rows: _read_rows(store, locations[key], rows))
