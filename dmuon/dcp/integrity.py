"""Integrity and safety of what a checkpoint says about itself.

The checksum manifest (the size of every data file, the CRC32 of every item, which tile their
file end to end, and of ``.metadata``; checksummed byte for byte itself) and the allow-listed
unpickling of ``.metadata``.
"""
from __future__ import annotations

import io
import json
import pickle
import zlib

import torch
from torch.distributed.checkpoint.metadata import Metadata

from .errors import CheckpointCorruptError, UnsafeCheckpointError

MANIFEST_PREFIX = ".dmuon-manifest-"
MANIFEST_FORMAT = "dmuon-manifest/1"


# ---------------------------------------------------------------------------------------------
def _crc(data) -> int:
    return zlib.crc32(data) & 0xFFFFFFFF


def manifest_name(save_id: str) -> str:
    return f"{MANIFEST_PREFIX}{save_id}.json"


def encode_manifest(save_id: str, files: dict[str, dict], metadata_bytes: bytes) -> bytes:
    """One line of JSON, then a line with the CRC32 of exactly those bytes.

    Any change to any byte of the file (whitespace included) fails :func:`decode_manifest`.
    """
    body = {
        "format": MANIFEST_FORMAT,
        "save_id": save_id,
        "metadata": {"size": len(metadata_bytes), "crc32": _crc(metadata_bytes)},
        "files": files,
    }
    line = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    return line + f"\ncrc32={_crc(line):08x}\n".encode()


def decode_manifest(name: str, data: bytes) -> dict:
    line = data.split(b"\n", 1)[0]
    body = None
    if data == line + f"\ncrc32={_crc(line):08x}\n".encode():
        try:
            body = json.loads(line)
        except (ValueError, UnicodeDecodeError):
            body = None
    if not isinstance(body, dict) or body.get("format") != MANIFEST_FORMAT:
        raise CheckpointCorruptError(f"checksum manifest {name} is corrupted (checksum or format mismatch)")
    return body


# ---------------------------------------------------------------------------------------------
# allow-listed unpickling of .metadata
# ---------------------------------------------------------------------------------------------
# ---------------------------------------------------------------------------------------------
_ALLOWED_GLOBALS = {
    ("torch.distributed.checkpoint.metadata", name)
    for name in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
        "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING",
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
        metadata = _MetadataUnpickler(io.BytesIO(data)).load()
    except UnsafeCheckpointError:
        raise
    except Exception as exc:  # noqa: BLE001 - any decoding failure means a damaged file
        raise CheckpointCorruptError(f"{where}: .metadata cannot be decoded ({exc})") from exc
    if not isinstance(metadata, Metadata):
        raise CheckpointCorruptError(f"{where}: .metadata holds a {type(metadata).__name__}, not DCP Metadata")
    return metadata
