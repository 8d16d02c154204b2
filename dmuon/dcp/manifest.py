"""The checksum manifest: what every byte of a checkpoint must be.

Written by the coordinator just before ``.metadata``; one line of JSON, then a line with the
checksum of exactly that line, so any change to any byte of the manifest is detected.

Version 2 (written since dmuon 0.2)::

    {"format": "dmuon-manifest/2", "checksum": "crc32c", "save_id": "<hex>",
     "metadata": {"size": <bytes of .metadata>, "checksum": <int>},
     "files": {"<data file>": {"size": <bytes>,
                               "items": {"<offset>": [<length>, <head>, <block>, <tail>, "<checksums>"]}}}}
    crc32c=<8 hex digits of the line above>

The items of a file tile it end to end, and each item is cut into *segments* that tile it: a
head of ``head`` bytes, then its data region in blocks of ``block`` bytes (the last one may be
shorter), then a tail of ``tail`` bytes; ``<checksums>`` is the base64 of the little-endian
uint32 checksums of the non-empty segments, in order. For a tensor the data region is exactly
the tensor's bytes, so a reader that needs only some rows reads and verifies only the blocks
holding them; an object is one head segment (``block`` 0). Every byte is covered once.

Version 1 (dmuon 0.1) is still read: the same layout with zlib CRC-32 under ``crc32`` keys
and a ``crc32=`` trailer; its oldest manifests also carry a whole-file ``crc32`` per file,
which :class:`FileStats.whole_file` keeps for verification.
"""

from __future__ import annotations

import base64
import json
import struct
import zlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

import crc32c as _crc32c_library

from .errors import CheckpointCorruptError

__all__ = [
    "CHECKSUMS",
    "EncodedItems",
    "FileStats",
    "ItemChecksums",
    "Manifest",
    "block_size_for",
    "checksum_of",
    "decode_manifest",
    "encode_manifest",
]

MANIFEST_V1 = "dmuon-manifest/1"
MANIFEST_V2 = "dmuon-manifest/2"


def _crc32(data, running: int = 0) -> int:
    return zlib.crc32(data, running) & 0xFFFFFFFF


def _crc32c(data, running: int = 0) -> int:
    return _crc32c_library.crc32c(data, running)


#: Checksum kinds by name: ``update(data, running) -> running``; start from 0. CRC-32C runs
#: in hardware (SSE 4.2 / ARMv8 CRC) at several GiB/s, about 3x zlib's CRC-32 here.
CHECKSUMS: dict[str, Callable[..., int]] = {"crc32": _crc32, "crc32c": _crc32c}
WRITE_CHECKSUM = "crc32c"


MIN_BLOCK = 16 << 10
MAX_BLOCKS_PER_ITEM = 1024


def block_size_for(nbytes: int) -> int:
    """Checksum block of a tensor's bytes: 16 KiB, doubled until an item has at most 1024
    blocks. A reader that needs some rows reads at most one block more at each end, and the
    manifest holds at most one checksum per 16 KiB."""
    block = MIN_BLOCK
    while nbytes > block * MAX_BLOCKS_PER_ITEM:
        block *= 2
    return block


def checksum_of(kind: str, data) -> int:
    return CHECKSUMS[kind](data, 0)


@dataclass
class ItemChecksums:
    """The checksummed segments of one item (see the module docstring)."""

    length: int
    head: int
    block: int
    tail: int
    checksums: list[int]

    @classmethod
    def whole(cls, length: int, checksum: int) -> ItemChecksums:
        return cls(length, length, 0, 0, [checksum])

    def segments(self) -> list[tuple[int, int]]:
        """``(offset in the item, length)`` of each checksummed segment, in order."""
        out = [(0, self.head)] if self.head else []
        data_end = self.length - self.tail
        if self.block:
            out += [(start, min(self.block, data_end - start)) for start in range(self.head, data_end, self.block)]
        if self.tail:
            out.append((data_end, self.tail))
        return out

    def consistent(self) -> bool:
        """Do the numbers describe segments that tile the item, one checksum each?"""
        data = self.length - self.head - self.tail
        if min(self.head, self.block, self.tail, data) < 0 or (self.block == 0 and data != 0):
            return False
        blocks = -(-data // self.block) if self.block else 0
        return len(self.checksums) == (self.head > 0) + blocks + (self.tail > 0)


class EncodedItems(Mapping[int, ItemChecksums]):
    """A data file's items as the manifest encodes them, decoded one at a time when asked for.

    A rank decodes the checksums of the items it reads, not the whole checkpoint's (at 10,000
    tensors on 16 ranks that is 85,000 entries per rank, most of the manifest's decoding
    time); :meth:`length` answers the range checks without decoding anything.
    """

    def __init__(self, name: str, encoded: dict[str, list]) -> None:
        self._name = name
        try:
            self._encoded = {int(offset): value for offset, value in encoded.items()}
        except (TypeError, ValueError) as exc:
            raise ValueError(f"bad item offsets in {name}") from exc
        self._decoded: dict[int, ItemChecksums] = {}

    def length(self, offset: int) -> int | None:
        value = self._encoded.get(offset)
        return int(value[0]) if isinstance(value, list) and value else None

    def __getitem__(self, offset: int) -> ItemChecksums:
        item = self._decoded.get(offset)
        if item is None:
            value = self._encoded[offset]  # KeyError: no item there
            try:
                item = _decode_item(value)
            except (TypeError, ValueError, struct.error) as exc:
                raise CheckpointCorruptError(f"the manifest's entry for {self._name} at {offset} is malformed") from exc
            self._decoded[offset] = item
        return item

    def __iter__(self) -> Iterator[int]:
        return iter(self._encoded)

    def __len__(self) -> int:
        return len(self._encoded)


@dataclass
class FileStats:
    size: int
    items: Mapping[int, ItemChecksums]  # by offset in the file
    whole_file: int | None = None  # version 1's oldest manifests only

    def item_length(self, offset: int) -> int | None:
        """Length of the item at ``offset`` (None: no item there), without decoding it."""
        if isinstance(self.items, EncodedItems):
            return self.items.length(offset)
        item = self.items.get(offset)
        return item.length if item is not None else None


@dataclass
class Manifest:
    save_id: str
    checksum: str  # a key of CHECKSUMS
    metadata_size: int
    metadata_checksum: int
    files: dict[str, FileStats] = field(default_factory=dict)
    version: str = MANIFEST_V2

    def describes_metadata(self, metadata_bytes: bytes) -> bool:
        return (
            len(metadata_bytes) == self.metadata_size
            and checksum_of(self.checksum, metadata_bytes) == self.metadata_checksum
        )


def encode_manifest(manifest: Manifest) -> bytes:
    """Version 2, whatever version ``manifest`` was read as."""
    body = {
        "format": MANIFEST_V2,
        "checksum": manifest.checksum,
        "save_id": manifest.save_id,
        "metadata": {"size": manifest.metadata_size, "checksum": manifest.metadata_checksum},
        "files": {
            name: {"size": stats.size, "items": {str(o): _encode_item(v) for o, v in sorted(stats.items.items())}}
            for name, stats in manifest.files.items()
        },
    }
    line = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    return line + f"\ncrc32c={checksum_of('crc32c', line):08x}\n".encode()


def decode_manifest(name: str, data: bytes) -> Manifest:
    """Parse and check a manifest of either version; :class:`CheckpointCorruptError` if any
    byte of it is wrong."""
    line, _, rest = data.partition(b"\n")
    trailers = {b"crc32c=": "crc32c", b"crc32=": "crc32"}
    body = None
    for prefix, kind in trailers.items():
        if rest == prefix + f"{checksum_of(kind, line):08x}\n".encode():
            try:
                body = json.loads(line)
            except (ValueError, UnicodeDecodeError):
                body = None
            break
    try:
        if isinstance(body, dict) and body.get("format") == MANIFEST_V2 and rest.startswith(b"crc32c="):
            return _from_v2(body)
        if isinstance(body, dict) and body.get("format") == MANIFEST_V1 and rest.startswith(b"crc32="):
            return _from_v1(body)
    except (KeyError, TypeError, ValueError):
        pass
    raise CheckpointCorruptError(f"checksum manifest {name} is corrupted (checksum or format mismatch)")


def _encode_item(item: ItemChecksums) -> list:
    packed = base64.b64encode(struct.pack(f"<{len(item.checksums)}I", *item.checksums)).decode()
    return [item.length, item.head, item.block, item.tail, packed]


def _decode_item(value: list) -> ItemChecksums:
    length, head, block, tail, packed = value
    raw = base64.b64decode(packed, validate=True)
    checksums = list(struct.unpack(f"<{len(raw) // 4}I", raw))
    item = ItemChecksums(int(length), int(head), int(block), int(tail), checksums)
    if len(raw) % 4 or not item.consistent():
        raise ValueError(f"inconsistent item {value!r}")
    return item


def _from_v2(body: dict) -> Manifest:
    if body["checksum"] not in CHECKSUMS:
        raise ValueError(body["checksum"])
    files = {
        name: FileStats(int(stats["size"]), EncodedItems(name, stats["items"])) for name, stats in body["files"].items()
    }
    return Manifest(
        str(body["save_id"]),
        body["checksum"],
        int(body["metadata"]["size"]),
        int(body["metadata"]["checksum"]),
        files,
        MANIFEST_V2,
    )


def _from_v1(body: dict) -> Manifest:
    files = {
        name: FileStats(
            int(stats["size"]),
            {int(o): ItemChecksums.whole(int(v[0]), int(v[1])) for o, v in stats["items"].items()},
            stats.get("crc32"),
        )
        for name, stats in body["files"].items()
    }
    return Manifest(
        str(body["save_id"]), "crc32", int(body["metadata"]["size"]), int(body["metadata"]["crc32"]), files, MANIFEST_V1
    )
