"""The ``torch.save`` file format, written and read by dmuon without ``torch.save``/``torch.load``.

A ``torch.save`` file is an uncompressed zip archive: ``archive/data.pkl`` (the pickled object,
whose tensors refer to their storages by key), one record ``archive/data/<key>`` per storage
(raw bytes, aligned to 64 bytes in the file, or placed where the writer asks: see
:data:`Placement`), and small records (``byteorder``, ``version``...).
``torch.load(weights_only=True)`` reads what :class:`TorchFileWriter` writes.

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
import struct
import sys
import warnings
import zipfile
import zlib
from collections.abc import Callable
from typing import Any

import torch

from ... import compat

__all__ = [
    "Placement",
    "TensorFrames",
    "TorchFileWriter",
    "single_record_offset",
    "tensor_frame",
    "tensor_from_payload",
    "tensor_memory",
    "write_tensor_payload",
]

ARCHIVE = "archive"
STORAGE_ALIGNMENT = 64
Placement = tuple[int, int]
"""(modulus, residue): a storage record whose bytes start at a payload position congruent to
``residue`` modulo ``modulus``, padded as torch's writer pads to 64 bytes. A writer uses it to
line a tensor's bytes in the file up with their address in memory, so that they can be written
to the device from that memory (direct I/O). ``torch.load`` reads the record wherever it lies:
it takes each record's start from its header."""
SLICE = 8 << 20  # bytes handed to the stream per write: bounded, and big enough for fast I/O

_LOCAL_HEADER = b"PK\x03\x04"
_LOCAL_HEADER_SIZE = 30
_SENTINEL = 0xFFFFFFFF  # "see the ZIP64 field" in a 32-bit size or offset
_ZIP64_LIMIT = _SENTINEL  # from here on a size or offset needs ZIP64 (lowered by a test)
_PAD_EXTRA_ID = b"FB"  # the padding extra field torch's own writer uses for alignment


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


def tensor_memory(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy."""
    if tensor.numel() == 0:
        return memoryview(b"")
    flat = tensor.detach().reshape(-1).view(torch.uint8)
    return memoryview(flat.numpy())  # type: ignore[arg-type]


def _write_in_slices(out: Any, data) -> int:
    """``data`` to ``out`` in :data:`SLICE`-sized writes; the number of bytes written."""
    view = memoryview(data).cast("B")
    for start in range(0, view.nbytes, SLICE):
        out.write(view[start : start + SLICE])
    return view.nbytes


# ---------------------------------------------------------------------------------------------
# the zip container
# ---------------------------------------------------------------------------------------------
class TorchFileWriter:
    """Writes the records of a ``torch.save`` zip to a stream that only needs ``write``.

    ``write_record`` streams each record (a large one in :data:`SLICE`-sized writes); ``close``
    writes the central directory. Records larger than 4 GiB get ZIP64 fields.
    """

    def __init__(self, out: Any) -> None:
        self.out = out
        self.pos = 0
        self._central: list[bytes] = []

    def _write(self, data) -> None:
        self.pos += _write_in_slices(self.out, data)

    def write_record(
        self,
        name: str,
        data,
        *,
        align: bool = False,
        place: Placement | None = None,
        write_data: Callable[[memoryview], None] | None = None,
    ) -> None:
        """One record; ``align`` (storages) starts its bytes on a 64-byte boundary and leaves
        its CRC field 0; small records get a real CRC-32, so any zip reader reads them.
        ``place`` (with ``align``) starts them at the position it asks for instead.

        ``write_data(view)``, if given, writes the record's bytes to the stream instead of this
        writer (a checksumming stream checksums them block by block).
        """
        view = memoryview(data).cast("B")
        crc = 0 if align else zlib.crc32(view)
        size = view.nbytes
        full_name = f"{ARCHIVE}/{name}".encode()
        zip64 = size >= _ZIP64_LIMIT
        extra = struct.pack("<HHQQ", 1, 16, size, size) if zip64 else b""
        if align:
            header_end = self.pos + _LOCAL_HEADER_SIZE + len(full_name) + len(extra) + 4
            modulus, residue = place or (STORAGE_ALIGNMENT, 0)
            pad = (residue - header_end) % modulus
            extra += _PAD_EXTRA_ID + struct.pack("<H", pad) + b"Z" * pad
        stored = _SENTINEL if zip64 else size
        version = 45 if zip64 else 20
        offset = self.pos
        self._write(
            struct.pack(
                "<4sHHHHHIIIHH",
                _LOCAL_HEADER,
                version,
                0,
                0,
                0,
                0,
                crc,
                stored,
                stored,
                len(full_name),
                len(extra),
            )
            + full_name
            + extra
        )
        if write_data is None:
            self._write(view)
        else:
            write_data(view)
            self.pos += size
        central_extra = b""
        fields = []
        if zip64:
            fields += [size, size]
        if offset >= _ZIP64_LIMIT:
            fields.append(offset)
        if fields:
            central_extra = struct.pack("<HH", 1, 8 * len(fields)) + struct.pack(f"<{len(fields)}Q", *fields)
        self._central.append(
            struct.pack(
                "<4sHHHHHHIIIHHHHHII",
                b"PK\x01\x02",
                45,
                max(version, 45 if fields else 20),
                0,
                0,
                0,
                0,
                crc,
                stored,
                stored,
                len(full_name),
                len(central_extra),
                0,
                0,
                0,
                0,
                _SENTINEL if offset >= _ZIP64_LIMIT else offset,
            )
            + full_name
            + central_extra
        )

    def close(self) -> None:
        start = self.pos
        for entry in self._central:
            self._write(entry)
        size = self.pos - start
        count = len(self._central)
        zip64 = start >= _ZIP64_LIMIT or size >= _ZIP64_LIMIT or count >= 0xFFFF
        if zip64:
            record = self.pos
            self._write(struct.pack("<4sQHHIIQQQQ", b"PK\x06\x06", 44, 45, 45, 0, 0, count, count, size, start))
            self._write(struct.pack("<4sIQI", b"PK\x06\x07", 0, record, 1))
        entries = 0xFFFF if zip64 else count
        self._write(
            struct.pack(
                "<4sHHHHIIH",
                b"PK\x05\x06",
                0,
                0,
                entries,
                entries,
                _SENTINEL if zip64 else size,
                _SENTINEL if zip64 else start,
                0,
            )
        )


def write_preamble(writer: TorchFileWriter, pickled: bytes) -> None:
    writer.write_record("data.pkl", pickled)
    writer.write_record(".format_version", b"1")
    writer.write_record(".storage_alignment", str(STORAGE_ALIGNMENT).encode())
    writer.write_record("byteorder", sys.byteorder.encode())


def write_postamble(writer: TorchFileWriter) -> None:
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
    return out.getvalue(), writer._central


def _frame_after(preamble: _Preamble, tensor: torch.Tensor, place: Placement | None) -> tuple[bytes, bytes]:
    records, central = preamble
    out = io.BytesIO()
    head_len = -1

    def skip_data(view: memoryview) -> None:
        nonlocal head_len
        head_len = out.tell()

    writer = TorchFileWriter(out)
    writer.pos, writer._central = len(records), list(central)  # as if it had just written them
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
        _write_in_slices(out, view)
    out.write(tail)


# ---------------------------------------------------------------------------------------------
# reading
# ---------------------------------------------------------------------------------------------
def single_record_offset(data: bytes | memoryview, nbytes: int) -> int | None:
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
            if byteorder and archive.read(byteorder[0]) != b"little":  # (small records carry real CRCs)
                return None
            info = records[0]
    except (zipfile.BadZipFile, ValueError, KeyError):
        return None
    if info.file_size != nbytes:
        return None
    header = info.header_offset
    if header + _LOCAL_HEADER_SIZE > len(data) or bytes(data[header : header + 4]) != _LOCAL_HEADER:
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
