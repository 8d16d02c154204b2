"""The zip container of a ``torch.save`` file: records written in order, one record found.

A ``torch.save`` file is an uncompressed zip archive: ``archive/data.pkl`` (the pickled object,
whose tensors refer to their storages by key), one record ``archive/data/<key>`` per storage
(raw bytes, aligned to 64 bytes in the file, or placed where the writer asks: see
:data:`Placement`), and small records (``byteorder``, ``version``...). :class:`TorchFileWriter`
writes such records to a stream that only needs ``write``; :func:`single_record_offset` finds
the bytes of the one storage of a payload without unpacking it. What goes into the records is
``torch_file``'s business.
"""

from __future__ import annotations

import io
import struct
import sys
import zipfile
import zlib
from collections.abc import Callable
from typing import Any

from .tensor_bytes import write_in_slices

__all__ = ["ARCHIVE", "STORAGE_ALIGNMENT", "Placement", "TorchFileWriter", "single_record_offset"]

ARCHIVE = "archive"
STORAGE_ALIGNMENT = 64
Placement = tuple[int, int]
"""(modulus, residue): a storage record whose bytes start at a payload position congruent to
``residue`` modulo ``modulus``, padded as torch's writer pads to 64 bytes. A writer uses it to
line a tensor's bytes in the file up with their address in memory, so that they can be written
to the device from that memory (direct I/O). ``torch.load`` reads the record wherever it lies:
it takes each record's start from its header."""

_LOCAL_HEADER = b"PK\x03\x04"
_LOCAL_HEADER_SIZE = 30
_SENTINEL = 0xFFFFFFFF  # "see the ZIP64 field" in a 32-bit size or offset
_ZIP64_LIMIT = _SENTINEL  # from here on a size or offset needs ZIP64 (lowered by a test)
_PAD_EXTRA_ID = b"FB"  # the padding extra field torch's own writer uses for alignment


class TorchFileWriter:
    """Writes the records of a ``torch.save`` zip to a stream that only needs ``write``.

    ``write_record`` streams each record (a large one in ``tensor_bytes.SLICE``-sized writes); ``close``
    writes the central directory. Records larger than 4 GiB get ZIP64 fields.
    """

    def __init__(self, out: Any, *, pos: int = 0, central: list[bytes] | None = None) -> None:
        """``pos`` and ``central``: go on from a writer that already wrote records (its
        :attr:`pos` and :attr:`central`), as if those records were in ``out`` too."""
        self.out = out
        self.pos = pos
        self.central: list[bytes] = list(central or ())  # one central-directory entry per record

    def _write(self, data) -> None:
        self.pos += write_in_slices(self.out, data)

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
        self.central.append(
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
        for entry in self.central:
            self._write(entry)
        size = self.pos - start
        count = len(self.central)
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
