"""The scale simulator (benchmarks/scale_sim.py) runs at a tiny N and counts sanely, so that CI
keeps it working while the code it measures changes."""

from __future__ import annotations

import os
import sys

import pytest
import torch

BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
sys.path.insert(0, BENCHMARKS)

import scale_sim  # noqa: E402
from scale_sim_state import SPECS, Call, Mesh, Model, ShardStub, tally  # noqa: E402


def test_shard_stubs_tile_the_tensor():
    """torch's dim-0 chunking, empty shards past the end included."""
    chunks = [ShardStub((10, 3), torch.float32, i, 4).chunk for i in range(4)]
    assert [tuple(c.offsets) for c in chunks] == [(0, 0), (3, 0), (6, 0), (9, 0)]
    assert [c.sizes[0] for c in chunks] == [3, 3, 3, 1]
    empty = ShardStub((3,), torch.float32, 7, 8).chunk
    assert tuple(empty.sizes) == (0,) and tuple(empty.offsets) == (3,)


def test_tally_counts_from_and_to_the_root():
    calls = [Call("gather", [5, 7, 9]), Call("scatter", [1, 2, 3]), Call("broadcast", [10]),
             Call("all_gather", [4, 4, 4])]
    got = tally(calls, 3)
    assert got["rank0_in"] == 7 + 9 + 8
    assert got["rank0_out"] == 2 + 3 + 10 * 2 + 4 * 2
    assert got["other_in_max"] == 3 + 10 + 8


def test_dmuon_layout_writers_are_owners():
    model = Model(SPECS["tiny"], Mesh(16, 2), dedicated=True)
    layout = model.layout()
    assert layout.entries and layout.topology == (2, 8)
    for entry in layout.entries.values():
        r, s = entry.owner
        assert entry.writer == r * 8 + s


@pytest.fixture(scope="module")
def rows():
    return scale_sim.simulate(["tiny"], ["fsdp", "hsdp"], [8, 16], 16, log=lambda *a: None)


def _row(rows, method, op, world=16, mesh="fsdp"):
    (row,) = [r for r in rows if (r["method"], r["op"], r["world"], r["mesh_kind"]) == (method, op, world, mesh)]
    return row


def test_protocol_and_counts(rows):
    for method in scale_sim.METHODS:
        for mesh in ("fsdp", "hsdp"):
            first, steady = _row(rows, method, "first save", mesh=mesh), _row(rows, method, "steady save", mesh=mesh)
            assert first["calls"][:4] == ["gather", "scatter", "gather", "broadcast"]
            assert first["rank0_in"] > 0 and first["other_in_max"] > 0 and first["rank0_cpu"] >= 0
            assert steady["rank0_in"] <= first["rank0_in"]
            load = _row(rows, method, "load", mesh=mesh)
            assert "gather" in load["calls"] and load["small_files"] and load["rank_plan_cpu_max"] > 0
    # the caches make a steady save gather less: dmuon's and torch's
    assert _row(rows, "dmuon", "steady save")["rank0_in"] < _row(rows, "dmuon", "first save")["rank0_in"]
    assert _row(rows, "torch+cache", "steady save")["rank0_in"] < _row(rows, "torch", "steady save")["rank0_in"]
    # a plan grows with the world: more ranks, more bytes into rank 0
    assert _row(rows, "torch", "first save", 16)["rank0_in"] > _row(rows, "torch", "first save", 8)["rank0_in"]
    assert ".metadata" in _row(rows, "dmuon", "first save")["small_files"]


def test_extrapolation_and_tables(rows):
    more = scale_sim.extrapolate(rows, [64])
    assert {r["world"] for r in more} == {64}
    assert all(not r["measured"] for r in more)
    text = scale_sim.tables(rows + more)
    assert "#### steady save" in text and "≈ 64" in text
