"""dmuon inside torchtitan 0.3.0's own Trainer, configured as a user would (``with_dmuon``).

2 CPU ranks (gloo), a tiny Llama 3 built by the Trainer on the meta device, dedicated by
``dedicated_parallelize`` before torchtitan's own ``parallelize_llama`` (FSDP2, compile),
materialised by ``to_empty`` + ``init_weights``, trained with ``dmuon.Muon`` and checkpointed by
torchtitan's ``CheckpointManager``. A run stopped after its step-3 checkpoint and resumed in
fresh processes matches an uninterrupted run bit for bit (every loss, every final weight).
What the Trainer needs on CPU beside dmuon: tests/helpers/titan_cpu.py.
"""
import os

import pytest
import torch

from tests.helpers.launch import run_ranks

STEPS, INTERVAL = 6, 3
TIMEOUT = 240.0


def trainer_job(rank, world, folder, *, stop_after=None, async_mode="disabled", compile=False):
    from tests.helpers import titan_trainer

    config = titan_trainer.tiny_config(folder, steps=STEPS, interval=INTERVAL, async_mode=async_mode,
                                       compile=compile, backend="inductor")
    out = titan_trainer.run(config, stop_after=stop_after)
    out["graphs"] = int(torch._dynamo.utils.counters["stats"]["unique_graphs"])
    return out


def train(folder, **kwargs):
    return run_ranks(trainer_job, 2, str(folder), timeout=TIMEOUT, **kwargs)


def stop_and_resume(folder, **kwargs):
    """Steps 1-3 (the checkpoint at 3, then the job ends), then a fresh job from that checkpoint."""
    first = train(folder, stop_after=INTERVAL, **kwargs)
    assert sorted(os.listdir(folder / "checkpoint")) == [f"step-{INTERVAL}"]
    second = train(folder, **kwargs)
    return first, second


def assert_bit_exact(first, second, whole):
    for rank in range(2):
        assert first[rank]["step"] == INTERVAL and second[rank]["step"] == STEPS
        assert first[rank]["losses"] == {s: whole[rank]["losses"][s] for s in range(1, INTERVAL + 1)}
        # the resumed job starts at step 4: it loaded the checkpoint, it did not retrain
        assert second[rank]["losses"] == {s: whole[rank]["losses"][s] for s in range(INTERVAL + 1, STEPS + 1)}
        assert second[rank]["weights"].keys() == whole[rank]["weights"].keys()
        for fqn, value in whole[rank]["weights"].items():
            assert torch.equal(second[rank]["weights"][fqn], value), fqn


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    whole = train(tmp_path_factory.mktemp("titan-whole"))
    for rank in range(2):
        assert whole[rank]["optimizer"] == "MuonOptimizersContainer"
        # the default predicate: every matrix of the two blocks (q, k, v, o, w1, w2, w3)
        assert len(whole[rank]["dedicated"]) == 14
        assert all(fqn.startswith("layers.") for fqn in whole[rank]["dedicated"])
        assert sorted(whole[rank]["losses"]) == list(range(1, STEPS + 1))
    return whole


@pytest.mark.parametrize("async_mode", ["disabled", "async"])
def test_trainer_stop_and_resume_is_bit_exact(tmp_path, uninterrupted, async_mode):
    first, second = stop_and_resume(tmp_path, async_mode=async_mode)
    assert_bit_exact(first, second, uninterrupted)
    assert sorted(os.listdir(tmp_path / "checkpoint")) == [f"step-{s}" for s in (INTERVAL, STEPS)]


@pytest.mark.slow
def test_compiled_trainer_stop_and_resume_is_bit_exact(tmp_path, uninterrupted):
    """compile.enable with inductor: torchtitan compiles each block before FSDP wraps it."""
    whole = train(tmp_path / "whole", compile=True)
    first, second = stop_and_resume(tmp_path / "stopped", compile=True)
    assert all(result[0]["graphs"] > 0 for result in (whole, first, second))
    assert_bit_exact(first, second, whole)
    # compiled and eager training agree to float rounding
    for step, loss in uninterrupted[0]["losses"].items():
        assert whole[0]["losses"][step] == pytest.approx(loss, rel=1e-4)
