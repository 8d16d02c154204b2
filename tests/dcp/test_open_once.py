"""A load reads the checkpoint's small files once per job, not once per rank (issue 35)."""
from __future__ import annotations

from array import array

import pytest

import dmuon.dcp as ddcp
from dmuon.dcp.errors import CheckpointCorruptError
from dmuon.dcp.format.layout import RankFileNames, data_file_name
from dmuon.dcp.operation import FileColumns, FileSizes
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


def test_the_file_table_a_rank_receives_makes_only_what_it_reads():
    """The manifest's files on a rank that did not read it: columns, a file's entry made when
    asked for and kept (its reader fills in its items); nothing per file of the job else."""
    n = 16384
    names = RankFileNames("0123abcd", array("q", range(n)))
    sizes = array("q", (1000 + r for r in range(n + 1))).tobytes()
    sums_at = array("q", (900 + r for r in range(n + 1))).tobytes()
    table = FileColumns(names, ["extra.bin"], sizes, sums_at)
    mine = data_file_name(3, "0123abcd")
    assert table[mine].size == 1003 and table[mine].sums_at == 903
    assert table[mine] is table[mine]  # kept
    assert table["extra.bin"].size == 1000 + n
    assert table.get(data_file_name(3, "ffff0000")) is None
    assert len(table._made) == 2 and len(names._made) == 1
    assert len(table) == n + 1 and list(table)[-2:] == [data_file_name(n - 1, "0123abcd"), "extra.bin"]
    files = FileSizes(table, {".metadata": 77})
    assert files[".metadata"] == 77 and files[mine] == 1003 and len(files) == n + 2
    with pytest.raises(CheckpointCorruptError, match="columns"):
        FileColumns(names, [], sizes, sums_at)  # one size too many
