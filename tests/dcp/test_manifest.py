"""The checksum manifest: encoded and decoded exactly; items decoded one at a time, when read."""
import pytest

from dmuon.dcp.errors import CheckpointCorruptError
from dmuon.dcp.manifest import FileStats, ItemChecksums, Manifest, decode_manifest, encode_manifest


def _manifest() -> Manifest:
    items = {0: ItemChecksums(100, 40, 16, 12, [1, 2, 3, 4, 5]), 100: ItemChecksums.whole(7, 99)}
    return Manifest("abc", "crc32c", 10, 1234, {"__0_abc.distcp": FileStats(107, items)})


def test_round_trip_and_lazy_items():
    decoded = decode_manifest("m", encode_manifest(_manifest()))
    stats = decoded.files["__0_abc.distcp"]
    assert stats.item_length(100) == 7 and stats.item_length(5) is None
    assert not stats.items._decoded  # lengths come without decoding any checksums
    assert stats.items[0] == _manifest().files["__0_abc.distcp"].items[0]
    assert list(stats.items._decoded) == [0]
    assert dict(stats.items) == _manifest().files["__0_abc.distcp"].items
    assert encode_manifest(decoded) == encode_manifest(_manifest())


def test_a_malformed_item_is_refused_when_read_naming_file_and_offset():
    manifest = _manifest()
    manifest.files["__0_abc.distcp"].items[100] = ItemChecksums(7, 7, 0, 0, [1, 2])  # 2 checksums, 1 segment
    stats = decode_manifest("m", encode_manifest(manifest)).files["__0_abc.distcp"]
    assert stats.items[0].checksums == [1, 2, 3, 4, 5]
    with pytest.raises(CheckpointCorruptError, match=r"__0_abc.distcp at 100 is malformed"):
        stats.items[100]
