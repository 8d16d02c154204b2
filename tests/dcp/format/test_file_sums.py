"""A data file's checksum trailer (manifest version 4): intact, of its file, of its save."""

import io

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

import dmuon.dcp as ddcp
from dmuon.dcp.checkpoint import open_checkpoint
from dmuon.dcp.format.file_sums import decode_file_sums, encode_file_sums, read_file_sums
from dmuon.dcp.format.manifest import FileStats, ItemChecksums

ITEMS = {0: ItemChecksums(10, 10, 0, 0, [7]), 10: ItemChecksums(30, 4, 16, 4, [1, 2, 3, 4])}


def test_a_trailer_round_trips_and_names_its_file_and_save():
    data = encode_file_sums("abc", "__0_abc.distcp", "xxh3-64", ITEMS)
    items = decode_file_sums("__0_abc.distcp", data, "xxh3-64", "abc")
    assert {offset: items[offset] for offset in items} == ITEMS
    with pytest.raises(ddcp.CheckpointCorruptError, match="__1_abc.distcp"):
        decode_file_sums("__1_abc.distcp", data, "xxh3-64", "abc")  # another file's trailer
    with pytest.raises(ddcp.CheckpointCorruptError):
        decode_file_sums("__0_abc.distcp", data, "xxh3-64", "abd")  # another save's
    flipped = bytearray(data)
    flipped[20] ^= 1
    with pytest.raises(ddcp.CheckpointCorruptError):
        decode_file_sums("__0_abc.distcp", bytes(flipped), "xxh3-64", "abc")


def test_a_trailer_must_start_where_the_items_end():
    trailer = encode_file_sums("abc", "f", "xxh3-64", ITEMS)
    stream = io.BytesIO(b"x" * 40 + trailer)
    assert len(read_file_sums(stream, "f", FileStats(40 + len(trailer), None, sums_at=40), "xxh3-64", "abc")) == 2
    stream = io.BytesIO(b"x" * 41 + trailer)
    with pytest.raises(ddcp.CheckpointCorruptError, match="end at byte 40"):
        read_file_sums(stream, "f", FileStats(41 + len(trailer), None, sums_at=41), "xxh3-64", "abc")
    with pytest.raises(ddcp.CheckpointCorruptError, match="truncated"):
        read_file_sums(
            io.BytesIO(b"x" * 40 + trailer[:-3]), "f", FileStats(40 + len(trailer), None, sums_at=40), "xxh3-64", "abc"
        )


def test_a_damaged_trailer_is_reported_by_verify_and_refused_by_a_load(tmp_path):
    saved = {f"w{i}": torch.randn(16, 16) for i in range(4)}
    dcp.save(saved, storage_writer=ddcp.DMuonStorageWriter(str(tmp_path)))
    listing = open_checkpoint(str(tmp_path))
    assert listing.manifest.version == "dmuon-manifest/4" and listing.verify_files() == []
    [(name, stats)] = listing.manifest.files.items()
    path = tmp_path / name
    data = bytearray(path.read_bytes())
    data[stats.sums_at + 30] ^= 1
    path.write_bytes(bytes(data))
    [problem] = open_checkpoint(str(tmp_path)).verify_files()
    assert problem.startswith(f"{name}: the checksum trailer of {name}"), problem
    with pytest.raises(CheckpointException) as raised:  # (torch's, around dmuon's error)
        dcp.load(
            {k: torch.zeros_like(v) for k, v in saved.items()}, storage_reader=ddcp.DMuonStorageReader(str(tmp_path))
        )
    [(error, _)] = raised.value.failures.values()
    assert isinstance(error, ddcp.CheckpointCorruptError) and "checksum trailer" in str(error)
