"""Bit-exact resume through DCP: torch's dcp.save/load with dmuon planners, and dmuon.dcp."""
import pytest
import torch.distributed.checkpoint as dcp

import dmuon
import dmuon.dcp as ddcp
from tests.helpers.training import build, check_bit_exact_resume, train

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


@pytest.mark.parametrize("how", ["torch", "dmuon"])
@pytest.mark.parametrize("world,replicate", [(2, 1), (4, 1), (4, 2)], ids=["2ranks", "4ranks", "hsdp2x2"])
def test_bit_exact_resume_local(tmp_path, world, replicate, how):
    check_bit_exact_resume(resume_worker, world, replicate, str(tmp_path / "ckpt"), how)
