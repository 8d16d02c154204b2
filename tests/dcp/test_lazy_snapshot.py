"""Lazy snapshots (issue 36): an async save returns before its copy of the state is taken,
training goes on, and the checkpoint is still the state at the call, bit for bit."""
from __future__ import annotations

import pytest

import dmuon
import dmuon.dcp as ddcp
from tests.helpers import faults
from tests.helpers.launch import run_ranks
from tests.helpers.training import build, build_compiled, train


def lazy_worker(rank, world, replicate, path, door, compiled=False):
    # compiled: each block compiled (aot_eager: the graphs torch.compile makes, without
    # inductor's minutes of C++ compilation on a CPU runner)
    model, opt = build_compiled(replicate, "aot_eager") if compiled else build(replicate)
    train(model, opt, rank, world, range(2))
    at_call = dmuon.get_model_state_dict(model), dmuon.get_optimizer_state_dict(model, opt)
    # the copy is held back in its thread, so that the steps below certainly run during it
    faults.on_call("DefaultStager._stage", faults.pause(1.0), this_thread=False)
    if door == "manager":
        manager = ddcp.CheckpointManager(path, keep=2, async_save=True)
        handle = manager.save(2, model, opt)
    else:
        handle = ddcp.async_save(model, opt, path)
    returned_before_the_copy = not handle.copied.done()
    losses = train(model, opt, rank, world, range(2, 5))  # every step changes weights and moments
    handle.wait()
    faults.clear()
    after = dmuon.get_model_state_dict(model)
    fresh, fresh_opt = build(replicate)
    if door == "manager":
        assert manager.resume(fresh, fresh_opt) == 2
        manager.close()
    else:
        ddcp.load(fresh, fresh_opt, path)
        ddcp.api.model_checkpointer(model).close()
    loaded = dmuon.get_model_state_dict(fresh), dmuon.get_optimizer_state_dict(fresh, fresh_opt)
    return {"returned_before_the_copy": returned_before_the_copy, "at_call": at_call, "loaded": loaded,
            "after": after, "losses": losses}


def _equal(a, b) -> bool:
    import torch

    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    return a == b


@pytest.mark.parametrize("world,replicate,door,compiled",
                         [(2, 1, "async_save", False), (4, 2, "async_save", False), (2, 1, "manager", False),
                          (2, 1, "async_save", True)],
                         ids=["fsdp2", "hsdp-2x2", "manager", "compiled-steps"])
def test_the_checkpoint_is_the_state_at_the_call(tmp_path, world, replicate, door, compiled):
    results = run_ranks(lazy_worker, world, replicate, str(tmp_path / "ckpt"), door, compiled, timeout=180)
    for got in results:
        assert got["returned_before_the_copy"]  # training went on while the copy was held back
    got = results[0]
    at_model, at_optim = got["at_call"]
    loaded_model, loaded_optim = got["loaded"]
    assert _equal(loaded_model, at_model) and _equal(loaded_optim, at_optim)
    assert not _equal(got["after"], at_model)  # the steps did change the weights meanwhile
