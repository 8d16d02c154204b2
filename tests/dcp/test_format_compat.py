"""Checkpoints written by earlier dmuon releases load, verify and export with today's code."""
import shutil
from pathlib import Path

import pytest
import torch

import dmuon
import dmuon.dcp as ddcp
from tests.helpers.launch import run_ranks
from tests.helpers.models import OddShapes
from tests.helpers.setup import make_mesh, max_abs_diff, shard_model

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "checkpoint-v0.1.0"
DEDICATED = ("mid.weight", "out.weight", "gate.weight", "inp.bias")


def load_worker(rank, world, path):
    torch.manual_seed(1)  # another initialisation than the saved run's
    model = OddShapes()
    _, opt = shard_model(model, make_mesh(), lambda n, p: n in DEDICATED, wrap=())
    extra = ddcp.load(model, opt, path)
    return {"extra": extra, "model": dmuon.get_model_state_dict(model),
            "optim": dmuon.get_optimizer_state_dict(model, opt)}


@pytest.mark.parametrize("world", [2, 3])
def test_a_v0_1_checkpoint_loads_bit_exactly(tmp_path, world):
    path = tmp_path / "ckpt"
    shutil.copytree(FIXTURE / "checkpoint", path)  # loading must not need to write
    expected = torch.load(FIXTURE / "expected.pt", weights_only=True)
    got = run_ranks(load_worker, world, str(path))[0]
    assert got["extra"] == {"step": 2, "note": "written by dmuon c885f44"}
    assert max_abs_diff(got["model"], expected["model"]) == 0.0
    for section in ("fsdp2", "dedicated"):
        assert got["optim"][section].keys() == expected["optim"][section].keys()
        for fqn, entry in expected["optim"][section].items():
            assert max_abs_diff(got["optim"][section][fqn], entry) == 0.0, fqn


def test_a_v0_1_checkpoint_verifies_and_exports(tmp_path):
    from safetensors.torch import load_file

    assert ddcp.verify(FIXTURE / "checkpoint") == []
    doc = ddcp.inspect(FIXTURE / "checkpoint")
    assert doc["checksum"] == "crc32" and doc["topology"] == {"replicate": 1, "shard": 2}
    [out] = ddcp.export(FIXTURE / "checkpoint", tmp_path / "hf")
    expected = torch.load(FIXTURE / "expected.pt", weights_only=True)["model"]
    assert max_abs_diff(load_file(out), expected) == 0.0
