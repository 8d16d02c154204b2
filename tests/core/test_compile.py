"""Dedicated parameters under torch.compile: per-block compile before and after fully_shard.

dmuon's unshard/reshard hooks run eagerly at each FSDP2 module's boundary (dynamo skips them,
as it skips FSDP2's), so a block compiled with ``fullgraph=True`` stays one graph and never
sees a dedicated weight's 0-element placeholder. Each case trains 10 steps compiled and 10
eagerly from the same start and compares the losses; the number of graphs dynamo compiled
must not grow after the first steps (no recompilation per step).
"""
from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch

import dmuon
from tests.helpers.launch import run_ranks
from tests.helpers.models import TinyTransformer, lm_loss, proj_predicate
from tests.helpers.setup import make_mesh, max_abs_diff
from tests.helpers.training import build_compiled, local_batch

DOCS = Path(__file__).resolve().parents[2] / "docs"
STEPS = 10
WARMUP = 3  # steps after which no new graph may be compiled


def compile_worker(rank, world, replicate, backend, order, bf16):
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model, opt = build_compiled(replicate, backend, order, bf16)
    losses, graphs = [], []
    for step in range(STEPS):
        loss = lm_loss(model, local_batch(step, rank, world))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        graphs.append(counters["stats"]["unique_graphs"])
    return {"losses": losses, "graphs": graphs, "model": dmuon.get_model_state_dict(model)}


CASES = [  # (world, replicate, backend, order, bf16)
    pytest.param(2, 1, "inductor", "before", False, id="inductor-before-1d"),
    pytest.param(2, 1, "inductor", "after", False, id="inductor-after-1d"),
    pytest.param(4, 2, "inductor", "before", False, id="inductor-before-hsdp", marks=pytest.mark.slow),
    pytest.param(2, 1, "aot_eager", "before", False, id="aot_eager-before-1d"),
    pytest.param(4, 2, "aot_eager", "after", False, id="aot_eager-after-hsdp"),
    pytest.param(2, 1, "aot_eager", "after", True, id="aot_eager-after-1d-bf16"),
]


# The eager reference of each (world, replicate, bf16), run once for the module: without a
# backend nothing is compiled, so the order is moot and the cases that share a mesh and a dtype
# compare against the same 10 eager steps.
@functools.cache
def eager_run(world: int, replicate: int, bf16: bool) -> dict:
    return run_ranks(compile_worker, world, replicate, None, "before", bf16)[0]


@pytest.mark.parametrize("world,replicate,backend,order,bf16", CASES)
def test_compiled_training_matches_eager(world, replicate, backend, order, bf16):
    compiled = run_ranks(compile_worker, world, replicate, backend, order, bf16, timeout=600)[0]
    eager = eager_run(world, replicate, bf16)
    tolerance = 2e-2 if bf16 else 1e-4  # bf16: compiled kernels round at other points
    for step, (got, want) in enumerate(zip(compiled["losses"], eager["losses"])):
        assert abs(got - want) <= tolerance * abs(want), (step, compiled["losses"], eager["losses"])
    assert compiled["graphs"][WARMUP - 1] > 0  # the blocks really were compiled
    assert compiled["graphs"][-1] == compiled["graphs"][WARMUP - 1], compiled["graphs"]  # no recompiles
    if not bf16:
        assert max_abs_diff(compiled["model"], eager["model"]) < 1e-3


# ---------------------------------------------------------------------------------------------
# checkpoints of a compiled model
# ---------------------------------------------------------------------------------------------
def checkpoint_worker(rank, world, root):
    import torch.distributed.checkpoint as dcp

    import dmuon.dcp as ddcp
    from tests.helpers.training import build, train

    model, opt = build_compiled(1, "aot_eager", "before", False)
    for step in range(2):
        lm_loss(model, local_batch(step, rank, world)).backward()
        opt.step()
        opt.zero_grad()
    saved = dmuon.get_model_state_dict(model, rank0_only=False)
    keys = sorted(model.state_dict())
    ddcp.save(model, opt, f"{root}/dmuon")
    dcp.save(model.state_dict(), checkpoint_id=f"{root}/plain")

    plain_model, plain_opt = build()  # an uncompiled model of the same architecture
    train(plain_model, plain_opt, rank, world, range(1))  # other values, to be overwritten
    ddcp.load(plain_model, plain_opt, f"{root}/dmuon")
    from_dmuon = dmuon.get_model_state_dict(plain_model, rank0_only=False)
    fresh, _ = build()
    state = fresh.state_dict()
    dcp.load(state, checkpoint_id=f"{root}/plain")
    fresh.load_state_dict(state)
    from_plain = dmuon.get_model_state_dict(fresh, rank0_only=False)
    return {"keys": keys, "dmuon": max_abs_diff(from_dmuon, saved), "plain": max_abs_diff(from_plain, saved)}


def test_a_compiled_models_checkpoints_load_bit_exactly_into_an_uncompiled_model(tmp_path):
    for res in run_ranks(checkpoint_worker, 2, str(tmp_path), timeout=300):
        assert not [k for k in res["keys"] if "_orig_mod" in k], res["keys"]
        assert res["dmuon"] == 0.0 and res["plain"] == 0.0


def doc_example_worker(rank, world):
    from torch._dynamo.utils import counters
    from torch.distributed.fsdp import fully_shard

    from tests.core.test_docs_examples import examples

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = TinyTransformer()
    scope = {"dmuon": dmuon, "fully_shard": fully_shard, "model": model, "mesh": make_mesh()}
    exec(examples(DOCS / "runtime.md")["compile"], scope)
    losses, graphs = [], []
    for step in range(STEPS):
        loss = lm_loss(model, local_batch(step, rank, world))
        loss.backward()
        scope["optimizer"].step()
        scope["optimizer"].zero_grad()
        losses.append(loss.item())
        graphs.append(counters["stats"]["unique_graphs"])
    return {"losses": losses, "graphs": graphs}


def test_the_docs_compile_example_runs_as_written():
    got = run_ranks(doc_example_worker, 2, timeout=600)[0]
    eager = run_ranks(compile_worker, 2, 1, None, "before", False)[0]
    assert got["graphs"][0] > 0 and got["graphs"][-1] == got["graphs"][0], got["graphs"]
    for got_loss, want in zip(got["losses"], eager["losses"]):
        assert abs(got_loss - want) <= 1e-4 * abs(want), (got["losses"], eager["losses"])


def sites_worker(rank, world):
    from torch.distributed.fsdp import fully_shard

    from tests.helpers.models import OddShapes

    torch.manual_seed(0)
    model = TinyTransformer()
    mesh = make_mesh()
    dmuon.dedicate_params(model, mesh, proj_predicate)
    before = sorted(type(site.module).__name__ for site in model._dmuon_registry.sites)
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    after = [(type(site.module).__name__, len(site.recs)) for site in model._dmuon_registry.sites]
    odd = OddShapes()  # dedicated weights outside any inner unit go to the root's unit
    dmuon.dedicate_params(odd, mesh, lambda n, p: n in ("mid.weight", "out.weight"))
    fully_shard(odd, mesh=mesh)
    odd_sites = [(type(site.module).__name__, len(site.recs)) for site in odd._dmuon_registry.sites]
    return before, after, odd_sites


def test_each_fully_shard_unit_moves_its_own_dedicated_weights():
    """A block's dedicated weights unshard at that block (FSDP2's granularity), never all at
    the root: an outer fully_shard leaves inner units' hooks where they are."""
    before, after, odd_sites = run_ranks(sites_worker, 2)[0]
    assert before == ["Linear"] * 12  # 6 projections per block, each on its own Linear first
    assert after == [("FSDPBlock", 6), ("FSDPBlock", 6)]  # fully_shard swaps in a subclass
    assert odd_sites == [("FSDPOddShapes", 2)]
