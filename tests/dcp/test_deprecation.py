"""Old names keep working for one release, each with a DeprecationWarning naming the new one."""
from __future__ import annotations

import importlib

import pytest
import torch
from torch import nn

import dmuon
import dmuon.dcp as ddcp


def test_dmuon_dcp_has_at_most_25_public_names_each_importable():
    assert len(ddcp.__all__) <= 25
    for name in ddcp.__all__:
        assert getattr(ddcp, name) is not None


@pytest.mark.parametrize("old", sorted(ddcp.MOVED))
def test_a_name_that_left_dmuon_dcp_warns_and_is_the_object_at_its_new_place(old):
    where, new = ddcp.MOVED[old]
    with pytest.warns(DeprecationWarning, match=rf"dmuon\.dcp\.{old} is deprecated .* use {where}\.{new}"):
        value = getattr(ddcp, old)
    assert value is getattr(importlib.import_module(where), new)


def test_from_import_of_an_old_name_warns():
    with pytest.warns(DeprecationWarning, match="use dmuon.dcp.plan_cache.SavePlanCache"):
        from dmuon.dcp import SavePlanCache  # noqa: F401


def test_an_unknown_name_is_still_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'NoSuchThing'"):
        ddcp.NoSuchThing  # noqa: B018


def test_the_old_async_checkpointer_module_warns_and_serves_the_new_objects():
    old = importlib.import_module("dmuon.dcp.async_checkpointer")  # (dmuon.dcp.async_checkpointer
    # itself was the function, and still names it)

    with pytest.warns(DeprecationWarning, match="use dmuon.dcp.checkpointer.SaveHandle"):
        assert old.AsyncSaveHandle is ddcp.SaveHandle
    with pytest.warns(DeprecationWarning, match="use dmuon.dcp.api.model_checkpointer"):
        assert old.async_checkpointer is ddcp.api.model_checkpointer


def _model():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4))
    return model, dmuon.Muon(model)


def test_manager_keep_last_and_load_latest_warn_and_still_work(tmp_path):
    model, opt = _model()
    renamed = r"CheckpointManager\(keep_last=...\) .* use CheckpointManager\(keep=...\)"
    with pytest.warns(DeprecationWarning, match=renamed):
        manager = ddcp.CheckpointManager(tmp_path, keep_last=1)
    assert manager.keep == 1
    with pytest.warns(DeprecationWarning, match=r"use CheckpointManager.keep$"):
        assert manager.keep_last == 1
    manager.save(1, model, opt)
    manager.save(2, model, opt)
    assert manager.steps() == [2]  # keep_last=1 took effect
    with pytest.warns(DeprecationWarning, match=r"use CheckpointManager.resume\(\)"):
        assert manager.load_latest(model, opt) == 2
    manager.close()


def test_tiered_local_keep_warns_and_is_keep():
    with pytest.warns(DeprecationWarning, match=r"TieredCheckpointManager\(local_keep=...\)"):
        with pytest.raises(ValueError, match="keep and persistent_keep must be >= 1, got 0"):
            ddcp.TieredCheckpointManager("/nonexistent", local_keep=0)


def test_wait_with_a_timeout_says_whether_the_save_finished(tmp_path):
    model, opt = _model()
    with ddcp.Checkpointer() as checkpointer:
        handle = checkpointer.save(model, opt, tmp_path / "a")
        assert handle.done() and handle.wait(0) and checkpointer.wait(0)
    manager = ddcp.CheckpointManager(tmp_path / "run", keep=2)
    assert manager.wait(0)  # nothing in flight
    manager.close()
