"""The scale tools (benchmarks/scale/): the simulator runs at a tiny N and counts sanely, so that CI
keeps it working while the code it measures changes; its simulated world runs real SPMD code
(dmuon's rounds, torch's dcp.save) and says so when the ranks part ways."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("greenlet")  # (the simulator's ranks; installed with the test extra on 3.11)
BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
SCALE = os.path.join(BENCHMARKS, "scale")
sys.path.insert(0, BENCHMARKS)
sys.path.insert(0, SCALE)

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


def test_tally_all_reduce_is_the_same_at_any_world():
    """An all-reduce of k int64: 2 x 8k in and out of every rank, whatever N; a gather's size
    exchange costs every rank 8 bytes per other rank on the wire."""
    for world in (2, 64, 4096):
        got = tally([Call("all_reduce", [40])], world)
        assert got["rank0_in"] == got["rank0_out"] == got["other_in_max"] == got["wire_max_in"] == 80
    assert tally([Call("gather", [4] * 64)], 64)["wire_max_in"] == 4 * 63 + 8 * 63


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
            assert first["rank0_in"] > 0 and first["other_in_max"] > 0 and first["rank0_cpu"] >= 0
            assert steady["rank0_in"] <= first["rank0_in"]
            load = _row(rows, method, "load", mesh=mesh)
            assert load["small_files"] and load["rank_cpu_max"] > 0
            if method != "dmuon":  # torch's dcp.load: plans gathered on the coordinator
                assert "gather" in load["calls"]
            if method != "dmuon":  # torch's dcp.save: plans gathered and scattered at every save
                assert first["calls"] == steady["calls"] == ["gather", "scatter", "gather", "broadcast"]
    # the caches make a steady save gather less: torch's
    assert _row(rows, "torch+cache", "steady save")["rank0_in"] < _row(rows, "torch", "steady save")["rank0_in"]
    # a plan grows with the world: more ranks, more bytes into rank 0
    assert _row(rows, "torch", "first save", 16)["rank0_in"] > _row(rows, "torch", "first save", 8)["rank0_in"]


def test_dmuon_rounds(rows):
    """dmuon's own run_save, open_once and run_load, as the simulated ranks run them."""
    for mesh in ("fsdp", "hsdp"):
        first, steady = _row(rows, "dmuon", "first save", mesh=mesh), _row(rows, "dmuon", "steady save", mesh=mesh)
        assert first["path"] == "full" and steady["path"] == "steady"
        assert first["calls"] == ["all_reduce", "gather", "scatter", "gather", "all_reduce"]
        assert steady["calls"] == ["all_reduce", "all_reduce", "all_reduce"]
        assert ".metadata" in first["small_files"] and ".metadata" in steady["small_files"]
        # steady: 5 + 2 + 1 int64 all-reduced (2 x 8k each way); nothing else, on any rank
        assert steady["rank0_in"] == steady["other_out_max"] == steady["rank0_out"] == 2 * 8 * (5 + 2 + 1)
        assert steady["small_files"][".metadata"] == first["small_files"][".metadata"]  # the cached metadata
        load, alone = _row(rows, "dmuon", "load", mesh=mesh), _row(rows, "dmuon", "load alone", mesh=mesh)
        # the listing; planning; the outcome. Under HSDP (2 replicas of 8 at 16 ranks), between
        # them, within each replica pair: the keys all hold, the shared list's digest, the
        # reads done (no plan sent anywhere)
        if mesh == "hsdp":
            assert load["calls"] == ["broadcast", "all_reduce"] + ["all_reduce"] * 3 + ["all_reduce"]
            # into rank 0: all-reduces only (16 B an int64 both ways; one per checkpoint key)
            assert load["rank0_in"] % 16 == 0 and load["rank0_in"] < 16 * 4096, load["rank0_in"]
        else:  # FSDP2 1-D: no two ranks hold the same region, nothing to share
            assert load["calls"] == ["broadcast", "all_reduce", "all_reduce"]
        assert alone["calls"] == ["broadcast", "all_reduce", "all_reduce"]  # the listing, two agreements
        # planning: did a rank fail, three flags, two numbers both ways (machine, replica layout)
        assert alone["rank0_in"] == 2 * 8 * (1 + 3 + 2 * 2 + 1)
        read = load["small_files"]
        assert read[".metadata"] == first["small_files"][".metadata"]  # read once, by rank 0
    # the steady save's bytes do not grow with the world
    small, large = _row(rows, "dmuon", "steady save", 8), _row(rows, "dmuon", "steady save", 16)
    assert small["other_in_max"] == large["other_in_max"] and small["wire_max_in"] == large["wire_max_in"]


def test_dmuon_write_results_carry_no_checksums():
    from scale_sim_stand_ins import dmuon_results
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

    from dmuon.dcp.format.manifest import FileStats
    from dmuon.dcp.writer import FILE_STATS_KEY, plan_storage_data

    data = TensorWriteData(ChunkStorageMetadata(torch.Size([0]), torch.Size([10])), TensorProperties(torch.float32),
                           torch.Size([10]))
    plan = SavePlan([WriteItem(MetadataIndex("w", torch.Size([0])), WriteItemType.SHARD, tensor_data=data)],
                    storage_data=plan_storage_data(3, "00000000000000ab"))
    item, stats = dmuon_results(3, plan)
    assert item.storage_data.offset == 0 and item.storage_data.length > 40
    assert stats.index.fqn.startswith(FILE_STATS_KEY)
    name, file = stats.storage_data
    assert name == plan.storage_data["file"]
    assert isinstance(file, FileStats) and file.items is None
    assert file.sums_at == item.storage_data.length and file.size > file.sums_at  # the trailer after the items


def test_extrapolation_and_tables(rows):
    more = scale_sim.extrapolate(rows, [64])
    assert {r["world"] for r in more} == {64}
    assert all(not r["measured"] for r in more)
    text = scale_sim.tables(rows + more)
    assert "#### steady save" in text and "≈ 64" in text


def test_the_world_runs_spmd_code_and_names_a_divergence():
    from scale_sim_world import SimulatedWorld, SimulatorGap

    world = SimulatedWorld(4)

    def body(rank, transport):
        total = transport.share(rank * 10)
        assert transport.broadcast(f"from {rank}", 2) == "from 2"
        return sum(total)

    outcomes = world.run(body)
    assert [o.value for o in outcomes] == [60] * 4 and [c.kind for c in world.calls] == ["all_gather", "broadcast"]
    with pytest.raises(SimulatorGap, match="different collectives"):
        world.run(lambda rank, transport: transport.barrier() if rank else transport.share(rank))


def _run_tool(*args: str) -> str:
    done = subprocess.run([sys.executable, SCALE, *args], capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return done.stdout


def test_the_scale_tools_run_from_their_one_command():
    """``python benchmarks/scale sim|real``, as docs/performance.md gives them: each runs a tiny
    case to its end and prints its table."""
    sim = _run_tool("sim", "--models", "tiny", "--meshes", "fsdp", "--worlds", "8", "16", "--extrapolate",
                    "--load-max", "16", "--methods", "dmuon")
    load_rows = [line for line in sim.splitlines() if line.startswith("| tiny | FSDP2 | 16 | dmuon")]
    assert len(load_rows) == 4, sim  # first save, steady save, load, load alone
    real = _run_tool("real", "--tensors", "100", "--worlds", "2", "--saves", "1")
    assert "dmuon / torch: last save" in real, real
    usage = subprocess.run([sys.executable, SCALE], capture_output=True, text=True, timeout=60)
    assert usage.returncode == 2 and "python benchmarks/scale sim" in usage.stdout, usage
