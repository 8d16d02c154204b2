"""A DCP checkpoint loads on any topology, and plain torch reads its model part."""
import pytest
import torch

import dmuon
import dmuon.dcp as ddcp
from tests.helpers.launch import run_ranks
from tests.helpers.setup import max_abs_diff
from tests.helpers.training import build, train


def save_worker(rank, world, replicate, path, storage_options=None):
    model, opt = build(replicate)
    train(model, opt, rank, world, range(3))
    ddcp.save(model, opt, path, extra={"step": 3}, storage_options=storage_options)
    state = {"model": dmuon.get_model_state_dict(model), "optim": dmuon.get_optimizer_state_dict(model, opt)}
    train(model, opt, rank, world, range(3, 5))
    state["continued"] = dmuon.get_model_state_dict(model)
    return state


def load_worker(rank, world, replicate, path, storage_options=None):
    model, opt = build(replicate)
    extra = ddcp.load(model, opt, path, storage_options=storage_options)
    state = {"model": dmuon.get_model_state_dict(model), "optim": dmuon.get_optimizer_state_dict(model, opt),
             "extra": extra}
    train(model, opt, rank, world, range(extra["step"], 5))
    state["continued"] = dmuon.get_model_state_dict(model)
    return state


def assert_same_state(loaded, saved):
    assert max_abs_diff(loaded["model"], saved["model"]) == 0.0
    for section in ("fsdp2", "dedicated"):
        assert loaded["optim"][section].keys() == saved["optim"][section].keys()
        for fqn, entry in saved["optim"][section].items():
            assert max_abs_diff(loaded["optim"][section][fqn], entry) == 0.0, (section, fqn)
    assert loaded["optim"]["param_groups"] == saved["optim"]["param_groups"]


@pytest.mark.parametrize("source,target", [
    ((4, 1), (2, 1)),
    ((2, 1), (4, 1)),
    ((4, 2), (4, 1)),
    ((4, 1), (1, 1)),
], ids=["4to2", "2to4", "hsdp2x2to4", "4to1"])
def test_load_on_another_topology(tmp_path, source, target):
    path = str(tmp_path / "ckpt")
    saved = run_ranks(save_worker, source[0], source[1], path)[0]
    loaded = run_ranks(load_worker, target[0], target[1], path)[0]
    assert loaded["extra"] == {"step": 3}
    assert_same_state(loaded, saved)
    # same global batch on another split: training continues to the same point up to rounding
    assert max_abs_diff(loaded["continued"], saved["continued"]) <= 1e-5


PLAIN_READER = """
import sys
class BlockDmuon:
    def find_spec(self, name, path=None, target=None):
        if name == "dmuon" or name.startswith("dmuon."):
            raise ImportError("dmuon is blocked in this process")
sys.meta_path.insert(0, BlockDmuon())
sys.path.insert(0, sys.argv[1])
import torch
import torch.distributed.checkpoint as dcp
from tests.helpers.models import TinyTransformer

torch.manual_seed(123)
plain = TinyTransformer()
state = {"model": plain.state_dict()}
dcp.load(state, checkpoint_id=sys.argv[2])   # default planner and reader
plain.load_state_dict(state["model"])
torch.save(plain.state_dict(), sys.argv[3])
"""


def test_plain_torch_reads_the_model_part(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    path = str(tmp_path / "ckpt")
    saved = run_ranks(save_worker, 4, 1, path)[0]
    out = tmp_path / "plain.pt"
    root = str(Path(__file__).resolve().parents[2])
    subprocess.run([sys.executable, "-c", PLAIN_READER, root, path, str(out)], check=True, timeout=120)
    assert max_abs_diff(torch.load(out), saved["model"]) == 0.0
