"""The compact form in which a load's first rank sends ``Metadata`` to the others: what comes
out is equal, entry by entry and index hint by index hint, to what went in; and it is smaller
than the compressed ``.metadata`` it replaced (issue 43, item 5)."""
from __future__ import annotations

import zlib

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from dmuon import compat
from dmuon.dcp.checkpoint import open_checkpoint
from dmuon.dcp.format.layout import METADATA
from dmuon.dcp.metadata_wire import decode_metadata, encode_metadata
from tests.helpers.launch import run_ranks
from tests.helpers.training import build, train


def assert_round_trip(metadata: Metadata) -> bytes:
    wire = encode_metadata(metadata)
    back = decode_metadata(wire)
    assert back == metadata
    assert list(back.state_dict_metadata) == list(metadata.state_dict_metadata)  # the order too
    if metadata.storage_data is not None:
        # MetadataIndex compares without its ``index`` hint: compare the hints themselves
        hints = {key: key.index for key in metadata.storage_data}
        assert {key: key.index for key in back.storage_data} == hints
        for key, info in metadata.storage_data.items():
            assert type(back.storage_data[key]) is type(info)
    return wire


def _chunk(offsets, sizes):
    return ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))


def test_every_kind_of_entry_comes_back_as_it_went():
    info = compat.StorageInfo
    fp32 = TensorProperties(dtype=torch.float32)
    bf16 = TensorProperties(dtype=torch.bfloat16, requires_grad=True)
    state = {
        "model.w": TensorStorageMetadata(fp32, torch.Size([4, 3]), [_chunk([0, 0], [2, 3]), _chunk([2, 0], [2, 3])]),
        "model.lost": TensorStorageMetadata(bf16, torch.Size([5]), [_chunk([0], [5])]),  # no storage entry
        "model.scalar": TensorStorageMetadata(fp32, torch.Size([]), [_chunk([], [])]),
        "model.coded": TensorStorageMetadata(fp32, torch.Size([2]), [_chunk([0], [2])]),
        "optim.step": BytesStorageMetadata(),
    }
    storage = {
        MetadataIndex("optim.step"): info("__0_0.distcp", 0, 7),
        MetadataIndex("model.w", torch.Size([0, 0]), 3): info("__0_0.distcp", 7, 24),
        MetadataIndex("model.w", torch.Size([2, 0]), 0): info("__1_0.distcp", 0, 24),
        MetadataIndex("model.scalar", torch.Size([])): info("__1_0.distcp", 40, 4),  # a gap before it
        MetadataIndex("model.coded", torch.Size([0])): info("__1_0.distcp", 44, 9, ["zstd"]),
    }
    planner = {
        "model.w": ("model", "w"),
        "model.lost": ("model", "lost"),
        "model.scalar": ("model", 0),  # not the key's own parts: sent as it is
        "optim.step": ("optim", "step"),
        "__reserved__": {"owners": {"model.w": 1}},
    }
    meta = StorageMeta(checkpoint_id="somewhere", save_id="abc")
    assert_round_trip(Metadata(state, planner_data=planner, storage_data=storage, storage_meta=meta, version="1.0.0"))
    assert_round_trip(Metadata(state, planner_data=None, storage_data=None))
    assert_round_trip(Metadata({}, planner_data={}, storage_data={}))


def save_worker(rank, world, path, replicate):
    model, opt = build(replicate)
    train(model, opt, rank, world, range(1))
    import dmuon.dcp as ddcp

    ddcp.save(model, opt, path, extra={"step": 1})


def test_dmuon_and_torch_checkpoints_come_back_smaller(tmp_path):
    run_ranks(save_worker, 4, str(tmp_path / "fsdp"), 1)
    run_ranks(save_worker, 4, str(tmp_path / "hsdp"), 2)
    state = {"w": torch.arange(12.0).reshape(3, 4), "step": 3, "nested": {"b": torch.ones(2)}}
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(tmp_path / "torch")), no_dist=True)
    for name in ("fsdp", "hsdp", "torch"):
        metadata = open_checkpoint(str(tmp_path / name)).metadata
        wire = assert_round_trip(metadata)
        if name != "torch":  # (a few keys: the columns' fixed costs are all there is)
            with open(tmp_path / name / METADATA, "rb") as f:
                before = len(zlib.compress(f.read(), 1))
            assert len(wire) < before / 2, (name, len(wire), before)
