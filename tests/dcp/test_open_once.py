"""A load reads the checkpoint's small files once per job, not once per rank (issue 35)."""
from __future__ import annotations

import pytest

import dmuon.dcp as ddcp
from tests.helpers.launch import RankFailed, run_ranks
from tests.helpers.training import build, train


def counting_worker(rank, world, path):
    from dmuon.dcp.format.layout import METADATA, is_manifest_name
    from dmuon.dcp.storage.local import LocalStore

    model, opt = build()
    train(model, opt, rank, world, range(1))
    ddcp.save(model, opt, path)
    reads = []
    original = LocalStore.read

    def counted(self, name):
        if name == METADATA or is_manifest_name(name):
            reads.append(name)
        return original(self, name)

    LocalStore.read = counted
    try:
        ddcp.load(model, opt, path)
    finally:
        LocalStore.read = original
    return reads


def test_metadata_and_manifest_are_read_by_one_rank(tmp_path):
    reads = run_ranks(counting_worker, 4, str(tmp_path / "ckpt"), timeout=90)
    assert len(reads[0]) == 2 and ".metadata" in reads[0], reads[0]  # .metadata and the manifest, once
    assert reads[1:] == [[], [], []]  # the other ranks got them from rank 0


def missing_worker(rank, world, path):
    model, opt = build()
    ddcp.load(model, opt, path)


def test_a_missing_checkpoint_fails_every_rank_with_its_type(tmp_path):
    with pytest.raises(RankFailed) as info:
        run_ranks(missing_worker, 2, str(tmp_path / "nothing-here"), timeout=60, grace=20)
    text = str(info.value)
    assert text.count("CheckpointNotFoundError") >= 2 and text.count("no checkpoint at") >= 2, text
