"""The checksum manifest: encoded and decoded exactly; items decoded one at a time, when read."""
import json

import pytest

from dmuon.dcp.format.checksums import CHECKSUMS, WRITE_CHECKSUM, checksum_of
from dmuon.dcp.errors import CheckpointCorruptError
from dmuon.dcp.format.manifest import (
    MANIFEST_V2,
    MANIFEST_V3,
    FileStats,
    ItemChecksums,
    Manifest,
    decode_manifest,
    encode_manifest,
)


def _manifest(checksum: str = WRITE_CHECKSUM) -> Manifest:
    big = (1 << (8 * CHECKSUMS[checksum].width)) - 1  # the widest value the kind has
    items = {0: ItemChecksums(100, 40, 16, 12, [1, 2, big, 4, 5]), 100: ItemChecksums.whole(7, 99)}
    return Manifest("abc", checksum, 10, big - 7, {"__0_abc.distcp": FileStats(107, items)})


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
    assert stats.items[0].checksums == _manifest().files["__0_abc.distcp"].items[0].checksums
    with pytest.raises(CheckpointCorruptError, match=r"__0_abc.distcp at 100 is malformed"):
        stats.items[100]


@pytest.mark.parametrize("checksum", sorted(CHECKSUMS))
def test_every_kind_round_trips_at_its_width(checksum):
    decoded = decode_manifest("m", encode_manifest(_manifest(checksum)))
    assert decoded.version == MANIFEST_V3 and decoded.checksum == checksum
    assert dict(decoded.files["__0_abc.distcp"].items) == _manifest(checksum).files["__0_abc.distcp"].items
    assert decoded.metadata_checksum == _manifest(checksum).metadata_checksum


def _as_version_2(manifest: Manifest) -> bytes:
    """What dmuon 0.2 wrote for ``manifest``: the same document under version 2's name."""
    line = encode_manifest(manifest).partition(b"\n")[0]
    body = json.loads(line)
    body["format"] = MANIFEST_V2
    line = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    return line + f"\ncrc32c={checksum_of('crc32c', line):08x}\n".encode()


def test_version_2_is_read_with_crc32c_only():
    decoded = decode_manifest("m", _as_version_2(_manifest("crc32c")))
    assert decoded.version == MANIFEST_V2 and decoded.checksum == "crc32c"
    assert dict(decoded.files["__0_abc.distcp"].items) == _manifest("crc32c").files["__0_abc.distcp"].items
    with pytest.raises(CheckpointCorruptError, match="checksum manifest m is corrupted"):
        decode_manifest("m", _as_version_2(_manifest("xxh3-64")))  # version 2 never named it


def test_the_digest_fed_in_pieces_equals_the_one_shot_value():
    data = bytes(range(256)) * 300
    for kind in CHECKSUMS.values():
        digest = kind.new()
        for start in range(0, len(data), 7777):
            digest.update(memoryview(data)[start : start + 7777])
        assert digest.intdigest() == kind.of(data) == checksum_of(kind.name, bytearray(data)), kind.name
        assert 0 <= kind.of(data) < 1 << (8 * kind.width)
