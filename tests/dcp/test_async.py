"""async_save: returns after staging, writes in the background on its own group."""
import pytest

import dmuon
import dmuon.dcp as ddcp
from dmuon.dcp.storage import write_path
from dmuon.dcp.storage.local import DIRECT_IO_FILESYSTEMS, filesystem_type
from tests.helpers.launch import run_ranks
from tests.helpers.setup import max_abs_diff
from tests.helpers.training import build, train


def async_worker(rank, world, path, replicate):
    model, opt = build(replicate)
    train(model, opt, rank, world, range(2))
    snapshot = dmuon.get_model_state_dict(model, rank0_only=False)
    snapshot_optim = dmuon.get_optimizer_state_dict(model, opt, rank0_only=False)
    handle = ddcp.async_save(model, opt, path, extra={"step": 2})
    running_after_return = not handle.done()
    # training (collectives on the training group) goes on while the write runs
    losses = train(model, opt, rank, world, range(2, 5))
    handle.wait()
    assert handle.done()
    written = list(write_path.known_choices().values())  # (only this save wrote)
    fresh, fresh_opt = build(replicate)
    extra = ddcp.load(fresh, fresh_opt, path)
    loaded = dmuon.get_model_state_dict(fresh, rank0_only=False)
    loaded_optim = dmuon.get_optimizer_state_dict(fresh, fresh_opt, rank0_only=False)
    return {
        "extra": extra,
        "model_diff": max_abs_diff(loaded, snapshot),
        "optim_diff": max(max_abs_diff(loaded_optim[s][k], snapshot_optim[s][k])
                          for s in ("fsdp2", "dedicated") for k in snapshot_optim[s]),
        "moved_on": max_abs_diff(dmuon.get_model_state_dict(model, rank0_only=False), snapshot),
        "losses": losses,
        "running_after_return": running_after_return,
        "write_paths": written,
    }


def reference_worker(rank, world, replicate):
    model, opt = build(replicate)
    return train(model, opt, rank, world, range(5))[2:]


@pytest.mark.parametrize("world,replicate", [(2, 1), (4, 2)], ids=["2ranks", "hsdp2x2"])
def test_mutations_after_return_never_reach_the_checkpoint(tmp_path, world, replicate):
    results = run_ranks(async_worker, world, str(tmp_path / "ckpt"), replicate)
    reference = run_ranks(reference_worker, world, replicate)
    for rank, res in enumerate(results):
        assert res["extra"] == {"step": 2}
        assert res["model_diff"] == 0.0 and res["optim_diff"] == 0.0
        assert res["moved_on"] > 0.0  # training did change the live model after the call
        assert res["losses"] == reference[rank]  # the background write did not disturb training
        background = res["write_paths"] == [write_path.DIRECT_IN_BACKGROUND]  # (its CPU, not its wall, costs training)
        assert background == (filesystem_type(str(tmp_path)) in DIRECT_IO_FILESYSTEMS), res["write_paths"]


def failing_async_worker(rank, world, path):
    model, opt = build()
    handle = ddcp.async_save(model, opt, path)  # path is a regular file: the write must fail
    outcome = {}
    try:
        handle.wait(timeout=60)
        outcome["wait"] = None
    except ddcp.CheckpointError as exc:
        outcome["wait"] = str(exc)
    handle2 = ddcp.async_save(model, opt, path)
    try:
        ddcp.save(model, opt, path + ".ok")  # the next save surfaces the unobserved failure
        outcome["next_save"] = None
    except ddcp.CheckpointError as exc:
        outcome["next_save"] = str(exc)
    outcome["done"] = handle2.done()
    return outcome


def test_background_failure_surfaces_on_wait_and_at_next_save(tmp_path):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("x")
    for res in run_ranks(failing_async_worker, 2, str(blocker)):
        assert res["wait"] and "async save" in res["wait"]
        assert res["next_save"] and "async save" in res["next_save"]
        assert res["done"]
    assert blocker.read_text() == "x"


def same_body_worker(rank, world, root):
    """What the async save's writer thread runs is the synchronous save's body: a committed
    checkpoint refused with its own type, the collector paused while it runs."""
    import gc

    from tests.helpers import faults

    model, opt = build()
    ddcp.save(model, opt, f"{root}/ckpt")
    seen = []
    faults.on_call("DMuonStorageWriter.write_data", lambda: seen.append(gc.isenabled()), this_thread=False)
    checkpointer = ddcp.AsyncCheckpointer()
    out = {}
    try:
        checkpointer.save(model, opt, f"{root}/ckpt").wait(timeout=60)
    except ddcp.CheckpointError as exc:
        out["refused"] = (type(exc).__name__, str(exc), exc.ranks)
    checkpointer.save(model, opt, f"{root}/other").wait(timeout=60)
    faults.clear()
    checkpointer.close()
    out["collector_in_write"] = seen
    out["collector_after"] = gc.isenabled()
    return out


def test_the_async_save_runs_the_synchronous_body(tmp_path):
    for res in run_ranks(same_body_worker, 2, str(tmp_path)):
        kind, text, ranks = res["refused"]
        assert kind == "CheckpointExistsError" and ranks == (0,), res["refused"]  # (the coordinator checks)
        assert text.startswith(f"async save to {tmp_path}/ckpt failed on rank 0 while planning: ")
        assert "already holds a committed checkpoint" in text
        assert res["collector_in_write"] == [False]  # the second save wrote with it paused
        assert res["collector_after"] is True  # and it runs again once the save is over
