"""Bit-exact resume through DCP: torch's dcp.save/load with dmuon planners, and dmuon.dcp."""
import pytest
import torch.distributed.checkpoint as dcp

import dmuon
import dmuon.dcp as ddcp
from tests.helpers.launch import run_ranks
from tests.helpers.setup import max_abs_diff
from tests.helpers.training import build, train

STEPS = 6


def save_half(model, opt, path, how, storage_options):
    if how == "torch":
        state = ddcp.AppState(model, opt, extra={"step": STEPS // 2})
        dcp.save({"app": state}, storage_writer=dcp.FileSystemWriter(path), planner=ddcp.DMuonSavePlanner())
    else:
        ddcp.save(model, opt, path, extra={"step": STEPS // 2}, storage_options=storage_options)


def load_half(model, opt, path, how, storage_options):
    if how == "torch":
        state = ddcp.AppState(model, opt, extra={"step": 0})
        dcp.load({"app": state}, storage_reader=dcp.FileSystemReader(path), planner=ddcp.DMuonLoadPlanner())
        return state.loaded_extra["step"]
    return ddcp.load(model, opt, path, storage_options=storage_options)["step"]


def resume_worker(rank, world, replicate, phase, path, how, storage_options=None):
    model, opt = build(replicate)
    if phase == "uninterrupted":
        losses = train(model, opt, rank, world, range(STEPS))
    elif phase == "first_half":
        losses = train(model, opt, rank, world, range(STEPS // 2))
        pending = sum(rec._replicate_work is not None for rec in model._dmuon_registry)
        save_half(model, opt, path, how, storage_options)
        return {"losses": losses, "pending": pending}
    else:
        start = load_half(model, opt, path, how, storage_options)
        losses = train(model, opt, rank, world, range(start, STEPS))
    return {"losses": losses, "model": dmuon.get_model_state_dict(model),
            "optim": dmuon.get_optimizer_state_dict(model, opt)}


def assert_bit_exact_resume(world, replicate, path, how, storage_options=None):
    full = run_ranks(resume_worker, world, replicate, "uninterrupted", path, how, storage_options)
    first = run_ranks(resume_worker, world, replicate, "first_half", path, how, storage_options)
    second = run_ranks(resume_worker, world, replicate, "second_half", path, how, storage_options)
    if replicate > 1:
        assert any(r["pending"] for r in first), "HSDP save must happen with broadcasts pending"
    for rank in range(world):
        assert first[rank]["losses"] + second[rank]["losses"] == full[rank]["losses"]
    assert max_abs_diff(second[0]["model"], full[0]["model"]) == 0.0
    for section in ("fsdp2", "dedicated"):
        for fqn, entry in full[0]["optim"][section].items():
            assert max_abs_diff(second[0]["optim"][section][fqn], entry) == 0.0, fqn


@pytest.mark.parametrize("how", ["torch", "dmuon"])
@pytest.mark.parametrize("world,replicate", [(2, 1), (4, 1), (4, 2)], ids=["2ranks", "4ranks", "hsdp2x2"])
def test_bit_exact_resume_local(tmp_path, world, replicate, how):
    assert_bit_exact_resume(world, replicate, str(tmp_path / "ckpt"), how)
