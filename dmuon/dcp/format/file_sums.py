"""A data file's checksum trailer: its items' checksums, at the end of the file itself.

The rank that writes a data file is the one that knows its checksums, as the bytes go out.
From manifest version 4 on it appends them to the file, after its last item, instead of sending
them to the coordinator: a save then moves no checksums between ranks, and a save whose layout
did not change needs nothing from any rank to write its manifest (sizes and trailer offsets are
the previous save's; ``manifest.py``). A reader reads the trailer of a file before the first item
it verifies there: one small ranged read per file it touches, not the whole checkpoint's
checksums on every rank.

The trailer is one line of JSON and a line with its checksum (``manifest.checked_line``)::

    {"format": "dmuon-sums/1", "save_id": "<hex>", "file": "<data file>", "checksum": "xxh3-64",
     "items": {"<offset>": [<length>, <head>, <block>, <tail>, "<checksums>"]}}
    crc32c=<8 hex digits of the line above>

with the items encoded as in a version-3 manifest. It names its file and save: a trailer of
another file or another save is refused. Readers that know no trailers (torch's own) read items
by offset and never reach it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import BinaryIO

from ..errors import CheckpointCorruptError
from .manifest import EncodedItems, FileStats, ItemChecksums, checked_line, encode_items, parse_checked_line

__all__ = ["SUMS_FORMAT", "decode_file_sums", "encode_file_sums", "read_file_sums"]

SUMS_FORMAT = "dmuon-sums/1"


def encode_file_sums(save_id: str, name: str, checksum: str, items: Mapping[int, ItemChecksums]) -> bytes:
    """The trailer of data file ``name`` of save ``save_id``."""
    body = {
        "format": SUMS_FORMAT,
        "save_id": save_id,
        "file": name,
        "checksum": checksum,
        "items": encode_items(items, checksum),
    }
    return checked_line(body)


def decode_file_sums(name: str, data: bytes, checksum: str, save_id: str) -> EncodedItems:
    """The items of ``name``'s trailer ``data``, checked: intact, of this file, this save and
    this checksum kind; :class:`CheckpointCorruptError` otherwise."""
    parsed = parse_checked_line(data)
    body = parsed[0] if parsed is not None else None
    if (
        body is None
        or body.get("format") != SUMS_FORMAT
        or body.get("file") != name
        or body.get("save_id") != save_id
        or body.get("checksum") != checksum
        or not isinstance(body.get("items"), dict)
    ):
        raise CheckpointCorruptError(f"the checksum trailer of {name} is corrupted or not this save's")
    try:
        return EncodedItems(name, body["items"], checksum)
    except ValueError as exc:
        raise CheckpointCorruptError(f"the checksum trailer of {name} is malformed") from exc


def read_file_sums(stream: BinaryIO, name: str, stats: FileStats, checksum: str, save_id: str) -> EncodedItems:
    """Read and decode the trailer of ``name`` from a seekable ``stream`` over it; the stream
    is left where it was (a read-ahead stream schedules what it was told from there on)."""
    assert stats.sums_at is not None
    here = stream.tell()
    stream.seek(stats.sums_at)
    want = stats.size - stats.sums_at
    data = stream.read(want)
    stream.seek(here)
    if len(data) != want:
        raise CheckpointCorruptError(f"{name} is truncated: its checksum trailer is cut short")
    items = decode_file_sums(name, data, checksum, save_id)
    end = max((offset + items.length(offset) for offset in items), default=0)  # type: ignore[operator]
    if end != stats.sums_at:
        raise CheckpointCorruptError(f"the items of {name} end at byte {end}, its trailer starts at {stats.sums_at}")
    return items
