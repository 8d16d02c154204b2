"""Reading ``.metadata`` without letting a checkpoint run code.

``.metadata`` is a pickle, and unpickling runs whatever it names. Only the classes DCP's
``Metadata`` is made of, torch dtypes and a few standard containers are allowed; anything else
is refused with :class:`UnsafeCheckpointError` before it is imported.
"""

from __future__ import annotations

import io
import pickle

import torch
from torch.distributed.checkpoint.metadata import Metadata

from .errors import CheckpointCorruptError, UnsafeCheckpointError
from .gc_pause import paused_gc

__all__ = ["load_metadata_bytes"]

_ALLOWED_GLOBALS = {
    ("torch.distributed.checkpoint.metadata", name)
    for name in (
        "Metadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"),
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) in _ALLOWED_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise UnsafeCheckpointError(
            f".metadata refers to {module}.{name}, which a checkpoint has no reason to contain; "
            "refusing to unpickle it (it could run code)"
        )


def load_metadata_bytes(data: bytes, where: str) -> Metadata:
    try:
        with paused_gc():
            metadata = _MetadataUnpickler(io.BytesIO(data)).load()
    except UnsafeCheckpointError:
        raise
    except Exception as exc:
        raise CheckpointCorruptError(f"{where}: .metadata cannot be decoded ({exc})") from exc
    if not isinstance(metadata, Metadata):
        raise CheckpointCorruptError(f"{where}: .metadata holds a {type(metadata).__name__}, not DCP Metadata")
    return metadata
