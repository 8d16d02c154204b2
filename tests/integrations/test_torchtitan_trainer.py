"""dmuon inside torchtitan 0.3.0's own Trainer, configured as a user would (``with_dmuon``).

2 CPU ranks (gloo), a tiny Llama 3 built by the Trainer on the meta device, dedicated by
``dedicated_parallelize`` before torchtitan's own ``parallelize_llama`` (FSDP2, compile),
materialised by ``to_empty`` + ``init_weights``, trained with ``dmuon.Muon`` and checkpointed by
torchtitan's ``CheckpointManager``. A run stopped after its step-3 checkpoint and resumed in
fresh processes matches an uninterrupted run bit for bit (every loss, every final weight).
With synchronous saves the stopped job's step-3 checkpoint is the uninterrupted run's (the same
steps, the same save; ending the job after it changes nothing written): those resumes start from
a copy of it. The async save, which the end of the job must wait for, is stopped for real.
What the Trainer needs on CPU beside dmuon: tests/helpers/titan_cpu.py.
"""
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.core.test_docs_examples import examples
from tests.helpers.launch import run_ranks

ROOT = Path(__file__).resolve().parents[2]

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


def resume_from_copy(whole_folder, folder, **kwargs):
    """A fresh job in ``folder`` from a copy of the step-3 checkpoint an uninterrupted run in
    ``whole_folder`` wrote (synchronously) on its way."""
    step = f"step-{INTERVAL}"
    shutil.copytree(whole_folder / "checkpoint" / step, folder / "checkpoint" / step)
    return train(folder, **kwargs)


def assert_bit_exact(first, second, whole):
    for rank in range(2):
        assert first[rank]["step"] == INTERVAL
        assert first[rank]["losses"] == {s: whole[rank]["losses"][s] for s in range(1, INTERVAL + 1)}
    assert_resumed_bit_exact(second, whole)


def assert_resumed_bit_exact(second, whole):
    for rank in range(2):
        assert second[rank]["step"] == STEPS
        # the resumed job starts at step 4: it loaded the checkpoint, it did not retrain
        assert second[rank]["losses"] == {s: whole[rank]["losses"][s] for s in range(INTERVAL + 1, STEPS + 1)}
        assert second[rank]["weights"].keys() == whole[rank]["weights"].keys()
        for fqn, value in whole[rank]["weights"].items():
            assert torch.equal(second[rank]["weights"][fqn], value), fqn


@pytest.fixture(scope="module")
def uninterrupted_run(tmp_path_factory):
    """The eager run of all 6 steps: (its folder, with checkpoints at steps 3 and 6, its results)."""
    folder = tmp_path_factory.mktemp("titan-whole")
    whole = train(folder)
    for rank in range(2):
        assert whole[rank]["optimizer"] == "MuonOptimizersContainer"
        # the default predicate: every matrix of the two blocks (q, k, v, o, w1, w2, w3)
        assert len(whole[rank]["dedicated"]) == 14
        assert all(fqn.startswith("layers.") for fqn in whole[rank]["dedicated"])
        assert sorted(whole[rank]["losses"]) == list(range(1, STEPS + 1))
    assert sorted(os.listdir(folder / "checkpoint")) == [f"step-{s}" for s in (INTERVAL, STEPS)]
    return folder, whole


@pytest.fixture(scope="module")
def uninterrupted(uninterrupted_run):
    return uninterrupted_run[1]


def test_trainer_resume_is_bit_exact(tmp_path, uninterrupted_run):
    folder, whole = uninterrupted_run
    second = resume_from_copy(folder, tmp_path)
    assert_resumed_bit_exact(second, whole)
    assert sorted(os.listdir(tmp_path / "checkpoint")) == [f"step-{s}" for s in (INTERVAL, STEPS)]


def test_trainer_stopped_with_an_async_save_in_flight_resumes_bit_exact(tmp_path, uninterrupted):
    """async_mode "async": the job ends right after its step-3 save began in the background."""
    first, second = stop_and_resume(tmp_path, async_mode="async")
    assert_bit_exact(first, second, uninterrupted)
    assert sorted(os.listdir(tmp_path / "checkpoint")) == [f"step-{s}" for s in (INTERVAL, STEPS)]


@pytest.mark.slow
def test_compiled_trainer_stop_and_resume_is_bit_exact(tmp_path, uninterrupted):
    """compile.enable with inductor: torchtitan compiles each block before FSDP wraps it."""
    whole = train(tmp_path / "whole", compile=True)
    second = resume_from_copy(tmp_path / "whole", tmp_path / "resumed", compile=True)
    assert all(result[0]["graphs"] > 0 for result in (whole, second))
    assert_resumed_bit_exact(second, whole)
    # compiled and eager training agree to float rounding
    for step, loss in uninterrupted[0]["losses"].items():
        assert whole[0]["losses"][step] == pytest.approx(loss, rel=1e-4)


PARSE = """
from tests.helpers import titan_cpu
titan_cpu.prepare()
from torchtitan.config import ConfigManager
from dmuon.integrations.torchtitan import MuonOptimizersContainer
config = ConfigManager().parse_args(["--module", "my_configs", "--config", "llama3_8b_muon",
                                     "--optimizer.lr", "0.01", "--optimizer.adamw_betas", "0.9", "0.95",
                                     "--checkpoint.async_mode", "async", "--training.max_norm", "0.5"])
assert isinstance(config.optimizer, MuonOptimizersContainer.Config), type(config.optimizer)
assert (config.optimizer.lr, config.optimizer.adamw_lr, config.optimizer.adamw_betas) == (0.01, 3e-4, (0.9, 0.95))
assert config.parallelism.spmd_backend == "partial_dtensor"
assert config.checkpoint.async_mode == "async" and config.training.max_norm == 0.5
assert config.model_spec.parallelize_fn.__wrapped__.__name__ == "parallelize_llama"
print("parsed")
"""


def test_docs_config_parses_through_torchtitans_config_manager(tmp_path):
    """docs/integrations.md's config module, as ``torchtitan.train --module/--config`` reads it.

    In a subprocess: the CPU stand-ins of titan_cpu.py stay out of the test process.
    """
    (tmp_path / "my_configs.py").write_text(examples(ROOT / "docs" / "integrations.md")["torchtitan-trainer"])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    done = subprocess.run([sys.executable, "-c", PARSE], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and done.stdout.strip().endswith("parsed"), done.stderr[-4000:]


@pytest.mark.parametrize("backend, enabled, message", [
    ("spmd_types", (), "spmd_backend='partial_dtensor'"),
    ("partial_dtensor", ("cp", "pp", "ep"), "do not support context parallelism yet; enabled here: ['cp']"),
    ("partial_dtensor", ("tp", "cp"), "do not support context parallelism yet; enabled here: ['cp']"),
    ("partial_dtensor", ("tp", "async_tp"), "does not support compile.enable_async_tensor_parallel"),
    ("partial_dtensor", ("tp", "float8"), "does not support float8 layers with tensor parallelism yet (found '0'"),
])
def test_dedicated_parallelize_refuses_what_cannot_hold_a_whole_weight(backend, enabled, message):
    from types import SimpleNamespace

    from dmuon.integrations.torchtitan import dedicated_parallelize

    def never(model, **kwargs):
        raise AssertionError("the wrapped parallelize_fn must not run")

    class Float8Linear(torch.nn.Linear):  # named as torchao's and torchtitan's float8 layers are
        pass

    dims = SimpleNamespace(**{f"{name}_enabled": name in enabled for name in ("tp", "cp", "pp", "ep")})
    compile_config = SimpleNamespace(enable_async_tensor_parallel="async_tp" in enabled)
    model = torch.nn.Sequential(Float8Linear(2, 2) if "float8" in enabled else torch.nn.Linear(2, 2))
    parallelize = dedicated_parallelize(never)
    with pytest.raises(NotImplementedError, match=re.escape(message)):
        parallelize(model, parallel_dims=dims, training=SimpleNamespace(max_norm=1.0),
                    parallelism=SimpleNamespace(spmd_backend=backend), compile_config=compile_config)


def test_tensor_parallelism_needs_torchtitans_module_parallelize():
    """A model without torchtitan's ``Module.parallelize`` (its TP plan): refused by name."""
    from types import SimpleNamespace

    from dmuon.integrations.torchtitan import dedicated_parallelize

    def never(model, **kwargs):
        raise AssertionError("the wrapped parallelize_fn must not run")

    dims = SimpleNamespace(tp_enabled=True, cp_enabled=False, dp_replicate_enabled=False)
    with pytest.raises(NotImplementedError, match=r"Module.parallelize \(its TP plan\), which Linear does not have"):
        dedicated_parallelize(never)(torch.nn.Linear(2, 2), parallel_dims=dims,
                                     training=SimpleNamespace(max_norm=1.0, mixed_precision_param="float32"),
                                     parallelism=SimpleNamespace(spmd_backend="partial_dtensor"))
