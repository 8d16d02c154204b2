"""The sharding index (issue 43, item 5): what ``.metadata`` says, in a size that does not grow
with the ranks; every chunk and storage entry it gives back equal to ``.metadata``'s; and a
rank that plans over it sees only the chunks its tensors overlap."""

from __future__ import annotations

import math
import pickle
import zlib
from array import array

import pytest
import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from dmuon import compat
from dmuon.dcp.checkpoint import open_checkpoint
from dmuon.dcp.errors import CheckpointCorruptError, UnsafeCheckpointError
from dmuon.dcp.format.layout import RankFileNames, data_file_name
from dmuon.dcp.format.sharding_index import (
    RegularChunks,
    chunk_at,
    decode_index,
    encode_index,
    narrowed,
)
from dmuon.dcp.metadata_wire import encode_metadata
from tests.helpers.launch import run_ranks
from tests.helpers.training import build, train

FP32 = TensorProperties(dtype=torch.float32)


def fsdp_metadata(world: int, shapes: dict[str, tuple], dedicated: dict[str, int] = {}) -> Metadata:
    """What an FSDP2 1-D save of ``world`` ranks records: every key cut along dim 0 into
    ``ceil(rows / world)``-row shards (the last ranks' short or empty), a dedicated key whole
    in its owner's file, a step counter in rank 0's; items end to end in each rank's file."""
    entries, storage, ends = {}, {}, [0] * world
    for fqn, shape in shapes.items():
        owner = dedicated.get(fqn)
        if owner is not None:
            cuts = [(owner, 0, shape[0])]
        else:
            rows = math.ceil(shape[0] / world)
            cuts = [(r, min(r * rows, shape[0]), max(0, min(rows, shape[0] - r * rows))) for r in range(world)]
        chunks = []
        for rank, start, rows in cuts:
            chunk = ChunkStorageMetadata(torch.Size((start,) + (0,) * (len(shape) - 1)), torch.Size((rows,) + shape[1:]))
            chunks.append(chunk)
            length = 64 + rows * math.prod(shape[1:]) * 4
            storage[MetadataIndex(fqn, chunk.offsets, len(chunks) - 1)] = compat.StorageInfo(
                data_file_name(rank, "5eed"), ends[rank], length
            )
            ends[rank] += length
        entries[fqn] = TensorStorageMetadata(FP32, torch.Size(shape), chunks)
    entries["optim.step"] = BytesStorageMetadata()
    storage[MetadataIndex("optim.step")] = compat.StorageInfo(data_file_name(0, "5eed"), ends[0], 9)
    return Metadata(entries, planner_data={fqn: tuple(fqn.split(".")) for fqn in entries}, storage_data=storage)


def layers(n: int) -> dict[str, tuple]:
    shapes = {}
    for i in range(n):
        shapes[f"model.layers.{i}.attn.weight"] = (64, 32)
        shapes[f"model.layers.{i}.mlp.weight"] = (96, 32)
        shapes[f"model.layers.{i}.norm.weight"] = (32,)
    return shapes


def expanded(metadata: Metadata) -> tuple[dict, dict]:
    """Every key's entry (chunks as a list, empty ones left out) and every storage entry."""
    entries = {}
    for fqn, md in metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            chunks = [(tuple(c.offsets), tuple(c.sizes)) for c in md.chunks if 0 not in tuple(c.sizes)]
            entries[fqn] = (tuple(md.size), md.properties, chunks)
        else:
            entries[fqn] = md
    storage = {}
    for fqn, (_, _, chunks) in ((f, e) for f, e in entries.items() if isinstance(e, tuple)):
        for offsets, _ in chunks:
            info = metadata.storage_data[MetadataIndex(fqn, torch.Size(offsets))]
            storage[(fqn, offsets)] = (info.relative_path, info.offset, info.length)
    return entries, storage


def assert_same_checkpoint(indexed: Metadata, full: Metadata) -> None:
    assert list(indexed.state_dict_metadata) == list(full.state_dict_metadata)
    assert expanded(indexed) == expanded(full)
    assert indexed.planner_data == full.planner_data
    for fqn, md in full.state_dict_metadata.items():
        if isinstance(md, BytesStorageMetadata):
            assert indexed.storage_data[MetadataIndex(fqn)] == full.storage_data[MetadataIndex(fqn)]


def test_the_index_gives_back_every_chunk_and_byte_range_and_does_not_grow_with_the_ranks():
    sizes = {}
    for world in (8, 64, 1024):
        full = fsdp_metadata(world, layers(12), dedicated={"model.layers.3.attn.weight": world - 1})
        index = encode_index(full)
        assert index is not None
        decoded = decode_index(index, "here")
        assert_same_checkpoint(decoded, full)
        rule = decoded.state_dict_metadata["model.layers.0.mlp.weight"].chunks
        assert isinstance(rule, RegularChunks) and len(rule) == math.ceil(96 / math.ceil(96 / world))  # non-empty ones
        sizes[world] = (len(index), len(encode_metadata(full)))
    # the index stays flat from 64 to 1,024 ranks (the file table: a few bytes a file);
    # the chunk-by-chunk wire it replaces grows with the ranks
    assert sizes[1024][0] < 2 * sizes[64][0], sizes
    assert sizes[1024][1] > 4 * sizes[64][1], sizes
    assert sizes[1024][0] * 10 < sizes[1024][1], sizes


def test_a_rank_plans_over_the_chunks_its_shard_overlaps():
    full = fsdp_metadata(16, layers(2))
    decoded = decode_index(encode_index(full), "here")

    class Shard:  # what a DTensor tells torch's planner of itself
        def __init__(self, offsets, sizes):
            self.box = ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes))

        def __create_chunk_list__(self):
            return [self.box]

    state = {
        "model.layers.0.mlp.weight": Shard((18, 0), (6, 32)),  # rows 18..23 of 96: chunks 3 (18-23)
        "model.layers.0.attn.weight": Shard((3, 0), (6, 32)),  # rows 3..8 of 64 (4 a chunk): chunks 0, 1, 2
        "model.layers.1.norm.weight": torch.zeros(32),  # a whole tensor: every chunk
    }
    mine = narrowed(decoded, state)
    chunks = {fqn: [tuple(c.offsets) for c in md.chunks] for fqn, md in mine.state_dict_metadata.items()
              if isinstance(md, TensorStorageMetadata)}
    assert chunks["model.layers.0.mlp.weight"] == [(18, 0)]
    assert chunks["model.layers.0.attn.weight"] == [(0, 0), (4, 0), (8, 0)]
    assert chunks["model.layers.1.norm.weight"] == [(2 * r,) for r in range(16)]
    assert chunks["model.layers.1.mlp.weight"] == []  # not held here: nothing to plan over
    assert mine.storage_data is decoded.storage_data  # every entry still answers
    md = decoded.state_dict_metadata["model.layers.0.mlp.weight"]
    assert tuple(chunk_at(md, (90, 0)).sizes) == (6, 32) and chunk_at(md, (91, 0)) is None


def test_a_layout_the_rules_cannot_say_gets_no_index():
    full = fsdp_metadata(4, layers(1))
    twice = dict(full.storage_data)  # two chunks of one key in one file
    key = next(k for k in twice if k.fqn == "model.layers.0.mlp.weight" and k.offset[0] == 24)
    twice[key] = compat.StorageInfo(data_file_name(0, "5eed"), 10_000, 64)
    assert encode_index(Metadata(full.state_dict_metadata, storage_data=twice)) is None
    foreign = {k: compat.StorageInfo("__0_0.distcp" if v.relative_path.startswith("__0") else "other.bin",
                                     v.offset, v.length) for k, v in full.storage_data.items()}
    assert encode_index(Metadata(full.state_dict_metadata, storage_data=foreign)) is None


def test_a_damaged_or_hostile_index_is_refused():
    index = encode_index(fsdp_metadata(4, layers(1)))
    with pytest.raises(CheckpointCorruptError, match="sharding index"):
        decode_index(index[:-5], "ckpt")

    class Hostile:
        def __reduce__(self):
            return (print, ("ran",))

    with pytest.raises(UnsafeCheckpointError):
        decode_index(zlib.compress(pickle.dumps(("dmuon-index/1", Hostile()))), "ckpt")


def save_worker(rank, world, path, replicate):
    model, opt = build(replicate)
    train(model, opt, rank, world, range(1))
    import dmuon.dcp as ddcp

    ddcp.save(model, opt, path, extra={"step": 1})


@pytest.mark.parametrize("replicate", [1, 2], ids=["fsdp", "hsdp"])
def test_a_dmuon_save_writes_an_index_equal_to_its_metadata(tmp_path, replicate):
    run_ranks(save_worker, 4, str(tmp_path), replicate)
    full = open_checkpoint(str(tmp_path))
    indexed = open_checkpoint(str(tmp_path), indexed=True)
    assert full.manifest.index is not None
    assert_same_checkpoint(indexed.metadata, full.metadata)


def test_file_names_by_rank_are_made_when_asked_for():
    """An index that names its files by rank gives each name, and each name's place, without a
    list of all N names: a rank's load asks for the few files it reads."""
    names = RankFileNames("0123abcd", array("q", range(16384)))
    assert len(names) == 16384 and names._made == {}
    assert names[5] == data_file_name(5, "0123abcd") and names[-1] == data_file_name(16383, "0123abcd")
    assert names.position(data_file_name(7, "0123abcd")) == 7
    assert names.position(data_file_name(7, "ffff0000")) is None  # another save's file
    assert names.position(data_file_name(16384, "0123abcd")) is None and names.position(".metadata") is None
    assert len(names._made) == 3
    with pytest.raises(IndexError):
        names[16384]
    shuffled = RankFileNames("0123abcd", array("q", [2, 0, 1]))
    assert list(shuffled) == [data_file_name(r, "0123abcd") for r in (2, 0, 1)]
    assert [shuffled.position(data_file_name(r, "0123abcd")) for r in range(3)] == [1, 2, 0]
    assert shuffled[1:] == [data_file_name(0, "0123abcd"), data_file_name(1, "0123abcd")]
