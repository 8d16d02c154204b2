"""The examples of docs/integrations.md run as written, on 2 CPU ranks."""
import os
from pathlib import Path

import torch

from tests.core.test_docs_examples import examples
from tests.helpers.launch import run_ranks
from tests.helpers.setup import max_abs_diff

DOC = Path(__file__).resolve().parents[2] / "docs" / "integrations.md"


def integration_examples_worker(rank, world, workdir, name, phase):
    import torch.distributed as dist
    from torch.distributed.checkpoint.stateful import Stateful

    import dmuon
    import dmuon.dcp as ddcp
    from tests.helpers.training import build, train

    class TrainState(Stateful):
        step = 0

        def state_dict(self):
            return {"step": self.step}

        def load_state_dict(self, state_dict):
            self.step = state_dict["step"]

    os.chdir(workdir)
    model, optimizer = build()
    code = examples(DOC)
    train_state = TrainState()
    scope = {"ddcp": ddcp, "dist": dist, "torch": torch, "model": model, "optimizer": optimizer,
             "train_state": train_state}
    if phase == "save":
        train(model, optimizer, rank, world, range(2))
        train_state.step = 3
    if name == "torchtitan":  # one block: set-up, save, wait, load, close
        before, after = code[name].split("checkpointer.save(3)")
        if phase == "save":
            exec(before + "checkpointer.save(3)\ncheckpointer.maybe_wait_for_saving()\ncheckpointer.close()\n",
                 scope)
        else:
            exec(before + after.replace("checkpointer.maybe_wait_for_saving()", ""), scope)
            assert train_state.step == 3
    elif phase == "save":
        exec(code[f"{name}-save"] if f"{name}-save" in code else code[name], scope)
    else:
        exec(code[f"{name}-save"].split("\n\n")[0], scope)  # its imports
        exec(code[f"{name}-load"], scope)
    return {"model": dmuon.get_model_state_dict(model),
            "optim": dmuon.get_optimizer_state_dict(model, optimizer)}


def same(a, b):
    assert max_abs_diff(a["model"], b["model"]) == 0.0
    for section in ("fsdp2", "dedicated"):
        for fqn, entry in a["optim"][section].items():
            assert max_abs_diff(entry, b["optim"][section][fqn]) == 0.0, fqn


def test_integration_examples_run_as_written(tmp_path):
    for name in ("plain-dcp", "torch-api", "torchtitan"):
        saved = run_ranks(integration_examples_worker, 2, tmp_path, name, "save")[0]
        loaded = run_ranks(integration_examples_worker, 2, tmp_path, name, "load")[0]
        if name == "plain-dcp":  # the model only
            assert max_abs_diff(loaded["model"], saved["model"]) == 0.0
        else:
            same(loaded, saved)
    run_ranks(integration_examples_worker, 2, tmp_path, "torch-async", "save")
    assert (tmp_path / "checkpoints" / "async" / ".metadata").exists()
