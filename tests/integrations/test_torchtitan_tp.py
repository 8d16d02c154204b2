"""torchtitan 0.3.0's own Trainer with tensor parallelism and ``with_dmuon``, on 4 CPU ranks (gloo).

The tiny Llama 3 with ``tensor_parallel_degree`` 2 on 4 ranks: dp_shard 2 x tp 2, torchtitan's TP
plan (its sharding configs: q/k/v and w1/w3 column-wise, wo and w2 row-wise, norms replicated
on tp, sequence parallelism on by default), then FSDP over ``fsdp``. The blocks' matrices are
not dedicated: they stay torchtitan's DTensors and dmuon assembles each on a home rank for its
Muon update (``dedicate_params(sharded_matrices=)``). Checked: a run stopped after its step-3
checkpoint and resumed in fresh processes gives every loss, weight and optimizer state of an
uninterrupted run bit for bit; that checkpoint loads at dp_shard 4 without TP (matrices
dedicated there), weights and momentum exact; a checkpoint of dp_shard 2 resumed at TP 2 trains
on as without TP, with and without sequence parallelism; the container's joint clipping counts
each gradient once (shards on tp, replicas on tp divided); HSDP x TP trains as dp_shard 2 x tp 2;
the tiny Qwen3 MoE at TP 2 (experts cut on tp) resumes bit for bit from the step-3
checkpoint of its uninterrupted run.
Shared helpers: tests/integrations/test_torchtitan_parallel.py.
"""
import shutil
from types import SimpleNamespace

import pytest
import torch

from tests.helpers.launch import run_ranks
from tests.integrations.test_torchtitan_parallel import (
    INTERVAL,
    STEPS,
    TIMEOUT,
    assert_bit_exact,
    assert_resumed_bit_exact,
    assert_same,
    assert_trained,
    load_only,
    resume_from_whole,
    train,
)

TP2 = {"tensor_parallel_degree": 2}
TP2_NO_SP = {**TP2, "enable_sequence_parallel": False}
COLUMNWISE = ("attention.qkv_linear.wq", "attention.qkv_linear.wk", "attention.qkv_linear.wv",
              "feed_forward.w1", "feed_forward.w3")
ROWWISE = ("attention.wo", "feed_forward.w2")
MATRICES = sorted(f"layers.{i}.{name}.weight" for i in range(2) for name in COLUMNWISE + ROWWISE)


@pytest.fixture(scope="module")
def tp2(tmp_path_factory):
    return train(tmp_path_factory.mktemp("titan-tp2"), **TP2)


@pytest.fixture(scope="module")
def tp2_checkpoint(tmp_path_factory):
    """A job at TP 2 stopped after its step-3 checkpoint: (its folder, what it ended with)."""
    folder = tmp_path_factory.mktemp("titan-tp2-step3")
    return folder, train(folder, stop_after=INTERVAL, **TP2)


def test_tensor_parallel_matrices_stay_sharded_and_are_updated_by_muon(tp2):
    for result in tp2:
        assert result["optimizer"] == "MuonOptimizersContainer"
        assert result["matrices"] == MATRICES and result["dedicated"] == []
        for fqn in MATRICES:
            mesh, placements, _local = result["layouts"][fqn]
            rowwise = any(f".{name}." in fqn for name in ROWWISE)
            assert mesh == ("fsdp", "tp") and placements[1].dim == (1 if rowwise else 0), fqn
            momentum = result["optimizer_state"][f"state.{fqn}.momentum_buffer"]
            assert momentum.shape == result["weights"][fqn].shape and momentum.abs().sum() > 0
        norms = [layout for fqn, layout in result["layouts"].items() if "norm" in fqn]
        assert len(norms) == 5 and all(placements[1].is_replicate() for _, placements, _ in norms)
        assert_trained(result)


def test_tensor_parallel_stop_and_resume_is_bit_exact(tmp_path, tp2, tp2_checkpoint):
    folder, first = tp2_checkpoint
    shutil.copytree(folder / "checkpoint", tmp_path / "checkpoint")
    second = train(tmp_path, **TP2)
    assert_bit_exact(first, second, tp2)


def test_tensor_parallel_checkpoint_loads_without_tensor_parallelism(tmp_path, tp2_checkpoint):
    """Saved at dp_shard 2 x tp 2 (sharded matrices, momentum as DTensors); loaded at dp_shard 4,
    where the same matrices are dedicated: weights and optimizer state exact."""
    folder, saved = tp2_checkpoint
    shutil.copytree(folder / "checkpoint", tmp_path / "checkpoint")
    loaded = load_only(tmp_path)
    assert loaded[0]["step"] == INTERVAL and loaded[0]["losses"] == {}
    assert loaded[0]["matrices"] == [] and loaded[0]["dedicated"] == MATRICES
    assert_same(loaded[0]["weights"], saved[0]["weights"])
    assert_same(loaded[0]["optimizer_state"], saved[0]["optimizer_state"])


@pytest.fixture(scope="module")
def dp2(tmp_path_factory):
    """The same model on 2 ranks without TP, 6 steps: its folder and what it ended with."""
    folder = tmp_path_factory.mktemp("titan-dp2")
    return SimpleNamespace(folder=folder, results=train(folder, world=2))


@pytest.mark.parametrize("knobs", [TP2, TP2_NO_SP], ids=["sequence-parallel", "no-sequence-parallel"])
def test_tensor_parallel_trains_the_model_data_parallelism_trains(tmp_path, dp2, knobs):
    """dp_shard 2 with dedicated matrices, 6 steps; its step-3 checkpoint resumed at TP 2 x
    dp_shard 2 (the same 2 data-parallel ranks, the same samples): steps 4-6 give the same
    losses and weights up to float32 rounding (reductions in another order, Newton-Schulz on
    the same whole matrices); a matrix orthogonalised per TP piece would not. (From scratch the
    two would not start alike: a dedicated matrix is drawn on its owner only, which moves the
    other ranks' random streams.)"""
    step = f"step-{INTERVAL}"
    shutil.copytree(dp2.folder / "checkpoint" / step, tmp_path / "checkpoint" / step)
    tensor_parallel = train(tmp_path, **knobs)
    assert sorted(tensor_parallel[0]["losses"]) == list(range(INTERVAL + 1, STEPS + 1))
    for step, loss in tensor_parallel[0]["losses"].items():
        assert loss == pytest.approx(dp2.results[0]["losses"][step], rel=1e-5), step
    for fqn, value in dp2.results[0]["weights"].items():
        difference = float((tensor_parallel[0]["weights"][fqn] - value).norm() / value.norm().clamp_min(1e-30))
        assert difference < 1e-5, (fqn, difference)


def test_hsdp_with_tensor_parallelism_trains_as_fsdp_with_it(tmp_path, tp2):
    """dp_replicate 2 x tp 2 (matrices on (dp_replicate, fsdp, tp), each assembled from one
    replica's pieces) against dp_shard 2 x tp 2: the same 2 data-parallel ranks and samples,
    the same losses and weights up to float32 rounding."""
    hsdp = train(tmp_path, data_parallel_replicate_degree=2, data_parallel_shard_degree=1, **TP2)
    assert hsdp[0]["layouts"][MATRICES[0]][0] == ("dp_replicate", "fsdp", "tp")
    assert_same(hsdp[0]["initial"], tp2[0]["initial"])
    for step, loss in tp2[0]["losses"].items():
        assert hsdp[0]["losses"][step] == pytest.approx(loss, rel=1e-5), step
    for fqn, value in tp2[0]["weights"].items():
        difference = float((hsdp[0]["weights"][fqn] - value).norm() / value.norm().clamp_min(1e-30))
        assert difference < 1e-5, (fqn, difference)


def clipping_job(rank, world, folder, **knobs):
    """One step of the Trainer at TP 2: the container's norm against every gradient gathered
    whole, then the norm after clipping to a quarter of it."""
    from torch.distributed.tensor import DTensor

    from tests.helpers import titan_trainer

    config = titan_trainer.tiny_config(folder, steps=1, interval=100, **knobs)
    trainer = config.build()
    container = trainer.optimizers
    step = container.step
    seen = {}

    def whole_norm():
        grads = [p.grad for part in trainer.model_parts for p in part.parameters() if p.grad is not None]
        assert grads and all(isinstance(g, DTensor) for g in grads)
        seen.setdefault("placements", {repr(tuple(g.placements)) for g in grads})
        return sum(float(g.full_tensor().double().pow(2).sum()) for g in grads) ** 0.5

    def checked_step(*args, **kwargs):
        seen["before"] = whole_norm()
        container.max_norm = seen["before"] / 4
        step(*args, **kwargs)
        seen["reported"] = float(container.grad_norm)
        seen["after"] = whole_norm()

    container.step = checked_step
    try:
        trainer.train()
    finally:
        trainer.close()
    return seen


@pytest.mark.parametrize("knobs", [TP2, TP2_NO_SP], ids=["sequence-parallel", "no-sequence-parallel"])
def test_joint_clipping_counts_every_gradient_once_under_tensor_parallelism(tmp_path, knobs):
    """Gradients sharded on (fsdp, tp), whose local shards are each held once, and gradients
    replicated on tp (the norms), held by both TP ranks: one norm over all, each counted once
    (a replica counted on each TP rank would not match), then clipped."""
    for seen in run_ranks(clipping_job, 4, str(tmp_path), timeout=TIMEOUT, **knobs):
        assert "(Shard(dim=0), Replicate())" in seen["placements"]  # the norms
        assert "(Shard(dim=0), Shard(dim=1))" in seen["placements"]  # wo, w2
        assert seen["reported"] == pytest.approx(seen["before"], rel=1e-5)
        assert seen["after"] == pytest.approx(seen["before"] / 4, rel=1e-4)
        assert torch.isfinite(torch.tensor(seen["before"]))


def test_moe_with_tensor_parallelism_stop_and_resume_is_bit_exact(tmp_path):
    """The tiny Qwen3 MoE at TP 2 x dp_shard 2: torchtitan's plan cuts every expert's matrices
    on tp (stacks ``(Shard(0), Shard(1))``, ``w2`` on its dim 2), which the expert-stack update
    undoes per expert (optim/expert_stacks.py); the router's gate, replicated on tp, is a
    sharded matrix like the attention's."""
    knobs = {**TP2, "model": "moe"}
    whole = train(tmp_path / "whole", **knobs)
    for result in whole:
        assert result["dedicated"] == []
        gates = [fqn for fqn in result["matrices"] if ".router.gate." in fqn]
        assert len(gates) == 2 and len(result["matrices"]) == 10
        for fqn, (mesh, placements, _local) in result["layouts"].items():
            if ".inner_experts." in fqn:
                assert mesh == ("fsdp", "tp") and placements[1].dim in (1, 2), fqn
        assert_trained(result)
    assert_resumed_bit_exact(resume_from_whole(tmp_path / "whole", tmp_path / "resumed", **knobs), whole)


def norms_selected_job(rank, world, folder):
    from dmuon.integrations.torchtitan import default_predicate, with_dmuon
    from tests.helpers import titan_trainer

    config = titan_trainer.tiny_config(folder, muon=False, **TP2)
    with_dmuon(config, predicate=lambda fqn, p: default_predicate(fqn, p) or fqn.endswith("norm.weight"))
    config.build()


def test_a_vector_the_tensor_parallel_plan_lays_out_is_refused_by_name(tmp_path):
    """Selected for dmuon (a norm's weight, to be dedicated and updated with AdamW), but TP made it a
    DTensor: neither a dedicated weight nor a sharded matrix; refused before FSDP, by name."""
    with pytest.raises(Exception, match=r"'layers\.\d\.\w+_norm\.weight' \(shape \(64,\)\) is selected for dmuon"):
        run_ranks(norms_selected_job, 2, str(tmp_path), timeout=TIMEOUT)
