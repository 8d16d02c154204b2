"""The checksum manifest: what every byte of a checkpoint must be.

Written by the coordinator just before ``.metadata``; one line of JSON, then a line with the
checksum of exactly that line, so any change to any byte of the manifest is detected.

Version 4 (what dmuon writes) keeps each data file's item checksums out of the manifest, in a
trailer at the end of that file (``file_sums.py``): the rank that wrote the file knows them, and
the coordinator, who writes the manifest, then needs only each file's size and where its
trailer starts -- what a save whose layout did not change knows without asking any rank::

    {"format": "dmuon-manifest/4", "checksum": "xxh3-64", "save_id": "<hex>",
     "metadata": {"size": <bytes of .metadata>, "checksum": <int>},
     "files": {"<data file>": {"size": <bytes>, "sums_at": <offset of its trailer>}},
     "index": "<base64 of the sharding index>"}
    crc32c=<8 hex digits of the line above>

``index`` (optional; written since issue 43, ignored by readers that predate it, absent where
the layout fits no rule) is what ``.metadata`` says, in a form whose size does not grow with the
ranks (``sharding_index.py``): a load reads it instead of unpickling ``.metadata``.

Version 3::

    {"format": "dmuon-manifest/3", "checksum": "xxh3-64", "save_id": "<hex>",
     "metadata": {"size": <bytes of .metadata>, "checksum": <int>},
     "files": {"<data file>": {"size": <bytes>,
                               "items": {"<offset>": [<length>, <head>, <block>, <tail>, "<checksums>"]}}}}
    crc32c=<8 hex digits of the line above>

``checksum`` names a kind of :mod:`.checksums`. The items of a file tile it end to end, and
each item is cut into *segments* that tile it: a head of ``head`` bytes, then its data region
in blocks of ``block`` bytes (the last one may be shorter), then a tail of ``tail`` bytes;
``<checksums>`` is the base64 of the checksums of the non-empty segments, in order, each a
little-endian unsigned integer of the kind's width (8 bytes for ``xxh3-64``). For a tensor the
data region is exactly the tensor's bytes, so a reader that needs only some rows reads and
verifies only the blocks holding them; an object is one head segment (``block`` 0). Every byte
is covered once.

In version 4 the items tile a file up to its trailer, which checks itself. Earlier versions
are still read and verified (``tests/fixtures`` holds a checkpoint of each).
Version 2 is version 3 with ``crc32c`` as the only kind (4-byte values). Version 1 is the same layout with
zlib CRC-32 under ``crc32`` keys and a ``crc32=`` trailer; its oldest manifests also carry a
whole-file ``crc32`` per file, which :class:`FileStats.whole_file` keeps for verification.
"""

from __future__ import annotations

import base64
import json
import struct
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

from ..errors import CheckpointCorruptError
from .checksums import CHECKSUMS, checksum_of

__all__ = [
    "EncodedItems",
    "FileStats",
    "ItemChecksums",
    "Manifest",
    "block_size_for",
    "checked_line",
    "decode_manifest",
    "encode_items",
    "encode_manifest",
    "parse_checked_line",
]

MANIFEST_V1 = "dmuon-manifest/1"
MANIFEST_V2 = "dmuon-manifest/2"
MANIFEST_V3 = "dmuon-manifest/3"
MANIFEST_V4 = "dmuon-manifest/4"
# The checksum of the manifest's own line: CRC-32C from version 2 on (the line is small),
# zlib CRC-32 in version 1, which also used it for everything else.
_TRAILER_CHECKSUM = "crc32c"
V1_CHECKSUM = "crc32"
_TRAILERS = (_TRAILER_CHECKSUM, V1_CHECKSUM)


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

    def __init__(self, name: str, encoded: dict[str, list], checksum: str) -> None:
        self._name = name
        self._checksum = checksum
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
                item = _decode_item(value, self._checksum)
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
    """One data file as the manifest describes it. In version 4 its items are in the file's
    trailer, from byte ``sums_at`` on: ``items`` is None until a reader reads it
    (``file_sums.py``)."""

    size: int
    items: Mapping[int, ItemChecksums] | None  # by offset in the file
    whole_file: int | None = None  # version 1's oldest manifests only
    sums_at: int | None = None  # version 4: where the file's checksum trailer starts

    def item_length(self, offset: int) -> int | None:
        """Length of the item at ``offset`` (None: no item there, or not read yet), without
        decoding it."""
        if self.items is None:
            return None
        if isinstance(self.items, EncodedItems):
            return self.items.length(offset)
        item = self.items.get(offset)
        return item.length if item is not None else None


@dataclass
class Manifest:
    save_id: str
    checksum: str  # a key of checksums.CHECKSUMS
    metadata_size: int
    metadata_checksum: int
    files: Mapping[str, FileStats] = field(default_factory=dict)
    version: str = MANIFEST_V3
    index: bytes | None = None  # the sharding index (``sharding_index.py``), where the save has one

    def describes_metadata(self, metadata_bytes: bytes) -> bool:
        return (
            len(metadata_bytes) == self.metadata_size
            and checksum_of(self.checksum, metadata_bytes) == self.metadata_checksum
        )


def checked_line(body: dict) -> bytes:
    """``body`` as one line of JSON, then a line with its checksum: the form of every small
    file dmuon writes (manifests, data-file trailers)."""
    line = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    return line + f"\n{_TRAILER_CHECKSUM}={checksum_of(_TRAILER_CHECKSUM, line):08x}\n".encode()


def parse_checked_line(data: bytes) -> tuple[dict, str] | None:
    """(the body, the checksum kind of its line) of what :func:`checked_line` wrote (or
    version 1's ``crc32=`` form); None if any byte of it is wrong."""
    line, _, rest = data.partition(b"\n")
    trailer = rest.partition(b"=")[0].decode("ascii", "replace")
    if trailer not in _TRAILERS or rest != f"{trailer}={checksum_of(trailer, line):08x}\n".encode():
        return None
    try:
        body = json.loads(line)
    except (ValueError, UnicodeDecodeError):
        return None
    return (body, trailer) if isinstance(body, dict) else None


def encode_manifest(manifest: Manifest) -> bytes:
    """Version 4 for a manifest whose files carry their checksums in trailers, else version 3,
    whatever version ``manifest`` was read as (its checksum kind is kept)."""
    in_trailers = any(stats.sums_at is not None for stats in manifest.files.values())
    files: dict[str, dict] = {}
    for name, stats in manifest.files.items():
        if in_trailers:
            if stats.sums_at is None:
                raise ValueError(f"{name}: a version 4 manifest needs every file's trailer offset")
            files[name] = {"size": stats.size, "sums_at": stats.sums_at}
        else:
            files[name] = {"size": stats.size, "items": encode_items(stats.items or {}, manifest.checksum)}
    body = {
        "format": MANIFEST_V4 if in_trailers else MANIFEST_V3,
        "checksum": manifest.checksum,
        "save_id": manifest.save_id,
        "metadata": {"size": manifest.metadata_size, "checksum": manifest.metadata_checksum},
        "files": files,
    }
    if manifest.index is not None:
        body["index"] = base64.b64encode(manifest.index).decode("ascii")
    return checked_line(body)


def decode_manifest(name: str, data: bytes) -> Manifest:
    """Parse and check a manifest of any version; :class:`CheckpointCorruptError` if any
    byte of it is wrong."""
    parsed = parse_checked_line(data)
    if parsed is not None:
        body, trailer = parsed
        version = body.get("format")
        try:
            if version in _LATER_VERSIONS and trailer == _TRAILER_CHECKSUM:
                return _from_v2_or_later(body)
            if version == MANIFEST_V1 and trailer == V1_CHECKSUM:
                return _from_v1(body)
        except (KeyError, TypeError, ValueError):
            pass
    raise CheckpointCorruptError(f"checksum manifest {name} is corrupted (checksum or format mismatch)")


def encode_items(items: Mapping[int, ItemChecksums], checksum: str) -> dict[str, list]:
    """A file's items as a manifest or trailer encodes them (module docstring)."""
    return {str(offset): _encode_item(item, checksum) for offset, item in sorted(items.items())}


def _encode_item(item: ItemChecksums, checksum: str) -> list:
    code = CHECKSUMS[checksum].struct_code
    packed = base64.b64encode(struct.pack(f"<{len(item.checksums)}{code}", *item.checksums)).decode()
    return [item.length, item.head, item.block, item.tail, packed]


def _decode_item(value: list, checksum: str) -> ItemChecksums:
    length, head, block, tail, packed = value
    kind = CHECKSUMS[checksum]
    raw = base64.b64decode(packed, validate=True)
    checksums = list(struct.unpack(f"<{len(raw) // kind.width}{kind.struct_code}", raw))
    item = ItemChecksums(int(length), int(head), int(block), int(tail), checksums)
    if len(raw) % kind.width or not item.consistent():
        raise ValueError(f"inconsistent item {value!r}")
    return item


# The kinds each later version may name: version 2 only ever wrote CRC-32C.
_LATER_VERSIONS = {MANIFEST_V2: {"crc32c"}, MANIFEST_V3: set(CHECKSUMS), MANIFEST_V4: set(CHECKSUMS)}


def _from_v2_or_later(body: dict) -> Manifest:
    version, checksum = body["format"], body["checksum"]
    if checksum not in _LATER_VERSIONS[version]:
        raise ValueError(checksum)
    if version == MANIFEST_V4:
        files = {
            name: FileStats(int(stats["size"]), None, sums_at=int(stats["sums_at"]))
            for name, stats in body["files"].items()
        }
        if any(not 0 <= stats.sums_at <= stats.size for stats in files.values()):  # type: ignore[operator]
            raise ValueError("a trailer offset outside its file")
    else:
        files = {
            name: FileStats(int(stats["size"]), EncodedItems(name, stats["items"], checksum))
            for name, stats in body["files"].items()
        }
    return Manifest(
        str(body["save_id"]),
        checksum,
        int(body["metadata"]["size"]),
        int(body["metadata"]["checksum"]),
        files,
        version,
        base64.b64decode(body["index"], validate=True) if "index" in body else None,
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
    metadata = body["metadata"]
    return Manifest(
        str(body["save_id"]), V1_CHECKSUM, int(metadata["size"]), int(metadata["crc32"]), files, MANIFEST_V1
    )
