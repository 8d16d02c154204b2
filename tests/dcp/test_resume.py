"""Bit-exact resume through DCP: torch's dcp.save/load with dmuon planners, and dmuon.dcp."""
from functools import partial

import pytest
import torch.distributed.checkpoint as dcp

import dmuon.dcp as ddcp
from tests.helpers.training import check_bit_exact_resume


def save_half(model, opt, step, *, path, how, storage_options=None):
    if how == "torch":
        state = ddcp.AppState(model, opt, extra={"step": step})
        dcp.save({"app": state}, storage_writer=dcp.FileSystemWriter(path), planner=ddcp.DMuonSavePlanner())
    else:
        ddcp.save(model, opt, path, extra={"step": step}, storage_options=storage_options)


def load_half(model, opt, *, path, how, storage_options=None):
    if how == "torch":
        state = ddcp.AppState(model, opt, extra={"step": 0})
        dcp.load({"app": state}, storage_reader=dcp.FileSystemReader(path), planner=ddcp.DMuonLoadPlanner())
        return state.loaded_extra["step"]
    return ddcp.load(model, opt, path, storage_options=storage_options)["step"]


@pytest.mark.parametrize("how", ["torch", "dmuon"])
@pytest.mark.parametrize("world,replicate", [(2, 1), (4, 1), (4, 2)], ids=["2ranks", "4ranks", "hsdp2x2"])
def test_bit_exact_resume_local(tmp_path, world, replicate, how):
    where = dict(path=str(tmp_path / "ckpt"), how=how)
    check_bit_exact_resume(world, replicate, partial(save_half, **where), partial(load_half, **where))
