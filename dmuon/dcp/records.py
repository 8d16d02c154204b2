"""The bytes of one stored tensor: a ``torch.save`` payload, parsed without ``torch.load``.

DCP stores each tensor item as what ``torch.save`` writes: a zip archive (uncompressed) whose
record ``<archive>/data/<n>`` holds the tensor's raw bytes. A payload holding exactly one
little-endian storage can be read as a view over those bytes, which saves ``torch.load``'s
unpickling and copy. Anything else is left to ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import io
import math
import struct
import sys
import warnings
import zipfile

import torch

__all__ = ["single_record_offset", "tensor_from_payload"]

_LOCAL_HEADER = b"PK\x03\x04"
_LOCAL_HEADER_SIZE = 30


def single_record_offset(data: bytes, nbytes: int) -> int | None:
    """Offset of the tensor bytes inside a ``torch.save`` payload holding exactly one storage
    of ``nbytes`` little-endian bytes, stored uncompressed; None for anything else."""
    if sys.byteorder != "little":
        return None
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            infos = archive.infolist()
            records = [i for i in infos if "/data/" in i.filename and not i.filename.endswith("/")]
            byteorder = [i for i in infos if i.filename.endswith("/byteorder")]
            if len(records) != 1 or records[0].compress_type != zipfile.ZIP_STORED:
                return None
            if byteorder and archive.read(byteorder[0]) != b"little":
                return None
            info = records[0]
    except (zipfile.BadZipFile, ValueError, KeyError):
        return None
    if info.file_size != nbytes:
        return None
    header = info.header_offset
    if header + _LOCAL_HEADER_SIZE > len(data) or data[header : header + 4] != _LOCAL_HEADER:
        return None
    name_len, extra_len = struct.unpack_from("<HH", data, header + 26)
    start = header + _LOCAL_HEADER_SIZE + name_len + extra_len
    return start if start + nbytes <= len(data) else None


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
