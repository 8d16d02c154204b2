"""torchtitan 0.3.0's own Trainer with expert and pipeline parallelism and ``with_dmuon``, on 4
CPU ranks (gloo).

``with_dmuon`` as a user's config applies it: attention and router matrices dedicated, the
experts' stacks updated by Muon per expert where expert parallelism and FSDP put them, the rest
AdamW; torchtitan's own ``CheckpointManager``.

* Expert parallelism: a tiny Qwen3 MoE (8 experts per block, stacks ``[8, 32, 64]``) with
  ``expert_parallel_degree`` 2 on ``dp_shard`` 4, i.e. experts on an (efsdp 2, ep 2) mesh, 2 per
  rank, dense weights on fsdp 4. Tokens reach the experts through torchtitan's all-to-all
  dispatcher (gloo's ``all_to_all_single``); the grouped matmuls run in bf16 on the CPU.
* Pipeline parallelism: the tiny Llama 3 with ``pipeline_parallel_degree`` 2 on 4 ranks (pp 2 x
  fsdp 2): 1F1B (one stage per rank) and Interleaved1F1B (4 blocks, 4 stages, two model parts
  per rank, each with its own FSDP).

A run stopped after its step-3 checkpoint and resumed in fresh processes gives every loss and
every final weight of an uninterrupted run bit for bit (where a test runs the uninterrupted job
anyway, the resume starts from a copy of the step-3 checkpoint that job wrote: saves are
synchronous here, so a job stopped after it would have written the same); a checkpoint loads, weights and optimizer
state exact, into a job of another expert-, data- or pipeline-parallel degree.
What the Trainer needs on CPU: tests/helpers/titan_cpu.py; the model and data:
tests/helpers/titan_trainer.py.
"""
import shutil

import pytest
import torch

from tests.helpers.launch import run_ranks

STEPS, INTERVAL = 6, 3
TIMEOUT = 240.0
EXPERTS = "moe.routed_experts.inner_experts."

EP2 = {"model": "moe", "expert_parallel_degree": 2}
EP1 = {"model": "moe", "expert_parallel_degree": 1}
EP4 = {"model": "moe", "expert_parallel_degree": 4}
PP_1F1B = {"pipeline_parallel_degree": 2, "pipeline_parallel_schedule": "1F1B"}
# 4 blocks and no stage lightened for the embedding or the head: stages of one block each
PP_INTERLEAVED = {"pipeline_parallel_degree": 2, "pipeline_parallel_schedule": "Interleaved1F1B", "layers": 4,
                  "pipeline_parallel_first_stage_less_layers": 0, "pipeline_parallel_last_stage_less_layers": 0}


def trainer_job(rank, world, folder, *, stop_after=None, **knobs):
    from tests.helpers import titan_trainer

    config = titan_trainer.tiny_config(folder, steps=STEPS, interval=INTERVAL, **knobs)
    return titan_trainer.run(config, stop_after=stop_after, initial=True, optimizer_state=True)


def train(folder, world=4, **kwargs):
    return run_ranks(trainer_job, world, str(folder), timeout=TIMEOUT, **kwargs)


def resume_from(folder, checkpoint, **knobs):
    """A fresh job, in ``folder``, from a copy of ``checkpoint``'s step-3 checkpoint (see
    ``stopped_at_step3``): (what the stopped job ended with, what the resumed one did)."""
    stopped_folder, first = checkpoint
    shutil.copytree(stopped_folder / "checkpoint", folder / "checkpoint")
    return first, train(folder, **knobs)


def resume_from_whole(whole_folder, folder, **knobs):
    """A fresh job in ``folder`` from a copy of the step-3 checkpoint that the uninterrupted run
    in ``whole_folder`` wrote on its way (synchronously: what a job stopped there would leave)."""
    step = f"step-{INTERVAL}"
    shutil.copytree(whole_folder / "checkpoint" / step, folder / "checkpoint" / step)
    return train(folder, **knobs)


def assert_bit_exact(first, second, whole):
    for rank, reference in enumerate(whole):
        assert first[rank]["step"] == INTERVAL
        assert first[rank]["losses"] == {s: reference["losses"][s] for s in range(1, INTERVAL + 1)}
    assert_resumed_bit_exact(second, whole)


def assert_resumed_bit_exact(second, whole):
    for rank, reference in enumerate(whole):
        assert second[rank]["step"] == STEPS
        # the resumed job starts at step 4: it loaded the checkpoint, it did not retrain
        assert second[rank]["losses"] == {s: reference["losses"][s] for s in range(INTERVAL + 1, STEPS + 1)}
        assert_same(second[rank]["weights"], reference["weights"])
        assert_same(second[rank]["optimizer_state"], reference["optimizer_state"])


def assert_same(state, reference):
    assert state.keys() == reference.keys()
    for key, value in reference.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(state[key], value), key
        else:
            assert state[key] == value, key


def assert_trained(result):
    """Every weight moved from its initial value, and the loss is finite."""
    for fqn, value in result["initial"].items():
        if fqn.endswith("tokens_per_expert_E"):
            continue
        assert not torch.equal(result["weights"][fqn], value), fqn
    assert all(torch.isfinite(torch.tensor(loss)) for loss in result["losses"].values())


@pytest.fixture(scope="module")
def moe_ep2(tmp_path_factory):
    return train(tmp_path_factory.mktemp("titan-moe-ep2"), **EP2)


def test_experts_are_sharded_over_expert_and_data_parallel_ranks(moe_ep2):
    """Each rank holds 2 of the 8 experts of every stack, on the (efsdp, ep) mesh; the stacks are
    not dedicated (Muon updates them per expert where they are) and their momentum is a stack."""
    for result in moe_ep2:
        assert result["optimizer"] == "MuonOptimizersContainer"
        experts = {fqn: layout for fqn, layout in result["layouts"].items() if EXPERTS in fqn}
        assert len(experts) == 6  # w1, w2, w3 of 2 blocks
        for fqn, (mesh, _placements, local) in experts.items():
            assert mesh == ("efsdp", "ep") and local[0] == 2, fqn
            assert fqn not in result["dedicated"]
            momentum = result["optimizer_state"][f"state.{fqn}.momentum_buffer"]
            assert momentum.shape == result["weights"][fqn].shape and momentum.abs().sum() > 0
        assert sum(".router." in fqn for fqn in result["dedicated"]) == 2
        assert sum(".attention." in fqn for fqn in result["dedicated"]) == 8
        dense = [layout for fqn, layout in result["layouts"].items() if EXPERTS not in fqn]
        assert {mesh for mesh, _, _ in dense} == {("fsdp",)}
        # weights built from one whole draw: the 8 experts of a stack are 8 different matrices
        stack = result["initial"]["layers.0.moe.routed_experts.inner_experts.w1_EFD"]
        assert len({tuple(expert.flatten().tolist()) for expert in stack}) == 8
        assert_trained(result)


@pytest.fixture(scope="module")
def stopped_at_step3(tmp_path_factory):
    """``get(name, **knobs)``: a job stopped after its step-3 checkpoint, (its folder, what it
    ended with), run once per module: the stop-and-resume test of a configuration and the tests
    that load its checkpoint elsewhere start from the same checkpoint (each from a copy), so one
    job makes it instead of one per test (4-rank jobs of ~10 s each here)."""
    runs = {}

    def get(name, **knobs):
        if name not in runs:
            folder = tmp_path_factory.mktemp(f"titan-{name}-step3")
            first = train(folder, stop_after=INTERVAL, **knobs)
            assert sorted(p.name for p in (folder / "checkpoint").iterdir()) == [f"step-{INTERVAL}"]
            runs[name] = folder, first
        return runs[name]

    return get


@pytest.fixture(scope="module")
def ep2_checkpoint(stopped_at_step3):
    """A job at EP 2 stopped after its step-3 checkpoint: (its folder, what it ended with)."""
    return stopped_at_step3("ep2", **EP2)


def test_expert_parallel_stop_and_resume_is_bit_exact(tmp_path, moe_ep2, ep2_checkpoint):
    first, second = resume_from(tmp_path, ep2_checkpoint, **EP2)
    assert_bit_exact(first, second, moe_ep2)


@pytest.fixture(scope="module")
def moe_ep1(tmp_path_factory):
    """The MoE at EP 1 (experts on fsdp 4), 6 steps: its folder (checkpoints at steps 3 and 6)
    and what it ended with."""
    folder = tmp_path_factory.mktemp("titan-moe-ep1")
    return folder, train(folder, **EP1)


def test_expert_parallel_trains_the_model_plain_fsdp_trains(moe_ep2, moe_ep1):
    """EP 1 (experts on fsdp 4, no all-to-all) from the same initial weights and data.

    Equal up to rounding, which Newton-Schulz passes on: each expert's weight gradient is a bf16
    grouped matmul over the tokens routed to it, which EP 2 groups otherwise (all tokens of an
    expert in one matmul, not per rank then summed by FSDP). Measured: experts and the router
    (whose gradient comes through the experts' outputs) within 5%, dedicated attention matrices
    0.016%, the AdamW weights 0.009%. A mix-up of experts between ranks would give an expert
    another's updates: ~100%. The expert biases move by signs of token-count differences, which
    such rounding flips: left out.
    """
    _folder, plain = moe_ep1
    assert_same(plain[0]["initial"], moe_ep2[0]["initial"])
    for step, loss in moe_ep2[0]["losses"].items():
        assert plain[0]["losses"][step] == pytest.approx(loss, rel=1e-5)
    for fqn, value in moe_ep2[0]["weights"].items():
        if fqn.endswith("expert_bias_E") or fqn.endswith("tokens_per_expert_E"):
            continue
        difference = float((plain[0]["weights"][fqn] - value).norm() / value.norm().clamp_min(1e-30))
        tolerance = 0.1 if EXPERTS in fqn or ".router." in fqn else 1e-3 if fqn in moe_ep2[0]["dedicated"] else 1e-4
        assert difference < tolerance, (fqn, difference)


def test_uneven_experts_stop_and_resume_is_bit_exact(tmp_path):
    """6 experts on 4 ranks: 3 per expert-parallel rank, held as 2 + 1 by its two efsdp ranks."""
    knobs = {**EP2, "num_experts": 6}
    whole = train(tmp_path / "whole", **knobs)
    held = sorted(result["layouts"]["layers.0.moe.routed_experts.inner_experts.w1_EFD"][2][0] for result in whole)
    assert held == [1, 1, 2, 2]
    assert_resumed_bit_exact(resume_from_whole(tmp_path / "whole", tmp_path / "resumed", **knobs), whole)


def load_only(folder, world=4, **knobs):
    """A fresh job that loads the step-3 checkpoint and trains no further."""
    return train(folder, world=world, stop_after=INTERVAL, **knobs)


@pytest.mark.parametrize("knobs, world", [(EP1, 4), (EP4, 4), (EP2, 2)], ids=["ep1-fsdp4", "ep4", "ep2-2ranks"])
def test_expert_parallel_checkpoint_loads_at_other_degrees(tmp_path, ep2_checkpoint, knobs, world):
    """Saved at EP 2 x efsdp 2; loaded at EP 1 x fsdp 4, EP 4 x efsdp 1, and EP 2 on 2 ranks."""
    saved_folder, saved = ep2_checkpoint
    shutil.copytree(saved_folder / "checkpoint", tmp_path / "checkpoint")
    loaded = load_only(tmp_path, world=world, **knobs)
    assert loaded[0]["step"] == INTERVAL and loaded[0]["losses"] == {}
    assert_same(loaded[0]["weights"], saved[0]["weights"])
    assert_same(loaded[0]["optimizer_state"], saved[0]["optimizer_state"])


def test_checkpoint_without_expert_parallelism_loads_at_ep2(tmp_path, moe_ep1):
    """The EP 1 run's last checkpoint (step 6: the weights and state it ended with) at EP 2."""
    folder, saved = moe_ep1
    shutil.copytree(folder / "checkpoint", tmp_path / "checkpoint")
    loaded = load_only(tmp_path, **EP2)
    assert loaded[0]["step"] == STEPS and loaded[0]["losses"] == {}
    assert_same(loaded[0]["weights"], saved[0]["weights"])
    assert_same(loaded[0]["optimizer_state"], saved[0]["optimizer_state"])


@pytest.mark.parametrize("knobs, parts", [(PP_1F1B, 1), (PP_INTERLEAVED, 2)], ids=["1F1B", "Interleaved1F1B"])
def test_pipeline_stop_and_resume_is_bit_exact(tmp_path, knobs, parts):
    whole = train(tmp_path / "whole", **knobs)
    for rank, result in enumerate(whole):
        assert result["parts"] == parts
        # pp is the outer mesh dimension: ranks 2 and 3 hold the last stage and log the loss,
        # ranks 0 and 1 torchtitan's placeholder (-1 summed over their 2 data-parallel ranks)
        if rank < 2:
            assert set(result["losses"].values()) == {-2.0}
        else:
            assert min(result["losses"].values()) > 0
        assert result["weights"].keys() == result["initial"].keys()
        assert_trained(result)
    assert_resumed_bit_exact(resume_from_whole(tmp_path / "whole", tmp_path / "resumed", **knobs), whole)


def test_pipeline_trains_the_model_data_parallelism_trains(tmp_path):
    """4 blocks on 2 ranks without pipeline, 6 steps; its step-3 checkpoint resumed at
    Interleaved1F1B on pp 2 x fsdp 2 (each stage's matrices dedicated over its 2 data-parallel
    ranks, two parts and two dmuon.Muon per rank, gradients accumulated over microbatches). The
    same data per data-parallel rank: steps 4-6 give the same losses and weights up to float32
    rounding (measured: weights within 5e-7). (From scratch the two would not start alike: each stage
    draws its blocks' initial weights from its own random stream.)"""
    plain = train(tmp_path / "dp", world=2, layers=4)
    shutil.copytree(tmp_path / "dp" / "checkpoint" / f"step-{INTERVAL}", tmp_path / "pp" / "checkpoint" / f"step-{INTERVAL}")
    staged = train(tmp_path / "pp", **PP_INTERLEAVED)
    assert sorted(staged[-1]["losses"]) == list(range(INTERVAL + 1, STEPS + 1))
    for step, loss in staged[-1]["losses"].items():
        assert loss == pytest.approx(plain[0]["losses"][step], rel=1e-5)
    for fqn, value in plain[0]["weights"].items():
        difference = float((staged[0]["weights"][fqn] - value).norm() / value.norm().clamp_min(1e-30))
        assert difference < 1e-5, (fqn, difference)


def test_pipeline_checkpoint_loads_without_pipeline_and_with_another_split(tmp_path, stopped_at_step3):
    """Saved with two model parts per rank (Interleaved1F1B, pp 2 x fsdp 2); loaded at fsdp 4
    (one whole model per rank) and at 1F1B (one part of 2 blocks per rank)."""
    saved_folder, saved = stopped_at_step3("Interleaved1F1B", **PP_INTERLEAVED)
    for name, knobs in [("pp1", {"layers": 4}), ("1F1B", {**PP_1F1B, "layers": 4})]:
        shutil.copytree(saved_folder / "checkpoint", tmp_path / name / "checkpoint")
        loaded = load_only(tmp_path / name, **knobs)
        assert_same(loaded[0]["weights"], saved[0]["weights"])
        assert_same(loaded[0]["optimizer_state"], saved[0]["optimizer_state"])
