"""CheckpointManager: retention, crash recovery, async saves in flight."""
import os

import pytest

import dmuon
import dmuon.dcp as ddcp
from tests.helpers import faults
from tests.helpers.launch import RankFailed, run_ranks
from tests.helpers.setup import max_abs_diff
from tests.helpers.training import build, train


def retention_worker(rank, world, root, storage_options):
    model, opt = build()
    manager = ddcp.CheckpointManager(root, keep=2, storage_options=storage_options)
    assert manager.resume(model, opt) is None  # nothing there yet
    for step in range(1, 6):
        train(model, opt, rank, world, range(step - 1, step))
        manager.save(step, model, opt, extra={"step": step})
    return {"steps": manager.steps(), "state": dmuon.get_model_state_dict(model)}


def resume_worker(rank, world, root, storage_options):
    model, opt = build()
    manager = ddcp.CheckpointManager(root, keep=2, storage_options=storage_options)
    step = manager.resume(model, opt)
    return {"step": step, "extra": manager.last_extra, "state": dmuon.get_model_state_dict(model)}


@pytest.mark.parametrize("backend", ["local", "s3", "rgw"])
def test_keep_and_resume(checkpoint_location, backend):
    root, options = checkpoint_location(backend)
    saved = run_ranks(retention_worker, 2, root, options)[0]
    assert saved["steps"] == [4, 5]
    if backend == "local":
        assert sorted(os.listdir(root)) == ["step-4", "step-5"]
    resumed = run_ranks(resume_worker, 2, root, options)[0]
    assert resumed["step"] == 5 and resumed["extra"] == {"step": 5}
    assert max_abs_diff(resumed["state"], saved["state"]) == 0.0


def crash_worker(rank, world, root):
    model, opt = build()
    manager = ddcp.CheckpointManager(root, keep=3)
    for step in (1, 2):
        train(model, opt, rank, world, range(step - 1, step))
        manager.save(step, model, opt)
    state = dmuon.get_model_state_dict(model)
    if rank == 0:
        import torch

        torch.save(state, os.path.join(root, "..", "step2-state.pt"))
    train(model, opt, rank, world, range(2, 3))
    if rank == 1:
        faults.on_call("_ChecksummingStream.write", faults.sigkill, nth=3)  # dies mid-write
    manager.save(3, model, opt)


def after_crash_worker(rank, world, root):
    model, opt = build()
    manager = ddcp.CheckpointManager(root, keep=3)
    step = manager.resume(model, opt)
    listed = manager.steps()
    loaded = dmuon.get_model_state_dict(model)
    train(model, opt, rank, world, range(2, 3))
    manager.save(3, model, opt)
    return {"step": step, "listed": listed, "state": loaded, "after": manager.steps()}


def test_crash_mid_save_resumes_from_previous_step(tmp_path):
    import torch

    root = tmp_path / "run"
    with pytest.raises(RankFailed):
        run_ranks(crash_worker, 2, str(root), timeout=60)
    assert (root / "step-3").is_dir() and not (root / "step-3" / ".metadata").exists()
    res = run_ranks(after_crash_worker, 2, str(root))[0]
    assert res["step"] == 2 and res["listed"] == [1, 2]
    assert res["after"] == [1, 2, 3]
    expected = torch.load(tmp_path / "step2-state.pt")
    assert max_abs_diff(res["state"], expected) == 0.0


def async_worker(rank, world, root):
    model, opt = build()
    manager = ddcp.CheckpointManager(root, keep=2, async_save=True)
    for step in (1, 2):
        manager.save(step, model, opt)
    manager.wait()
    if rank == 0:  # the coordinator holds the commit back: step 3 stays "being written"
        faults.on_call("DMuonStorageWriter.commit_bytes", faults.pause(3.0))
    manager.save(3, model, opt)
    seen = {}
    if rank == 0:
        import time

        time.sleep(0.5)
        seen["writing"] = manager._writing()
        seen["removed"] = manager.clean_up()
        seen["dirs"] = sorted(os.listdir(root))
    manager.wait()
    faults.clear()
    seen["steps"] = manager.steps()
    return seen


def test_async_manager_keeps_the_step_being_written(tmp_path):
    res = run_ranks(async_worker, 2, str(tmp_path / "run"))[0]
    assert res["writing"] == 3
    assert res["removed"] == []  # step 1 went at save time; step 3, uncommitted but in flight, stays
    assert res["dirs"] == ["step-2", "step-3"]
    assert res["steps"] == [2, 3]


def test_async_manager_needs_keep_2():
    with pytest.raises(ValueError, match="keep must be >= 2"):
        ddcp.CheckpointManager("/tmp/x", keep=1, async_save=True)


# ---------------------------------------------------------------------------------------------
# resume falls back only past a step whose bytes are at fault, and never starts over silently
# ---------------------------------------------------------------------------------------------
def two_steps_worker(rank, world, root):
    model, opt = build()
    manager = ddcp.CheckpointManager(root, keep=3)
    for step in (1, 2):
        train(model, opt, rank, world, range(step - 1, step))
        manager.save(step, model, opt, extra={"step": step})
    return dmuon.get_model_state_dict(model)


def resume_or_fail_worker(rank, world, root):
    model, opt = build()
    before = dmuon.get_model_state_dict(model, rank0_only=False)
    manager = ddcp.CheckpointManager(root, keep=3)
    try:
        step = manager.resume(model, opt)
    except ddcp.CheckpointError as exc:
        return {"error": f"{type(exc).__name__}: {exc}",
                "unchanged": max_abs_diff(dmuon.get_model_state_dict(model, rank0_only=False), before) == 0.0}
    return {"step": step, "state": dmuon.get_model_state_dict(model)}


def refuse_metadata(path):
    """A .metadata naming a class the allow-list does not know, as another Python might write it."""
    import fractions
    import pickle

    from tests.helpers.tamper import rewrite

    metadata = pickle.loads((path / ".metadata").read_bytes())
    metadata.planner_data["__dmuon__"]["written_by"] = fractions.Fraction(1, 3)
    rewrite(path, pickle.dumps(metadata))


def flip_a_data_byte(path):
    victim = max(path.glob("*.distcp"), key=lambda p: p.stat().st_size)
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x10
    victim.write_bytes(bytes(data))


def test_resume_raises_on_a_refused_step_instead_of_falling_back(tmp_path):
    root = tmp_path / "run"
    run_ranks(two_steps_worker, 2, str(root))
    refuse_metadata(root / "step-2")
    for res in run_ranks(resume_or_fail_worker, 2, str(root)):
        assert res["error"].startswith("UnsafeCheckpointError") and "fractions.Fraction" in res["error"], res
        assert res["unchanged"]


def test_resume_skips_a_corrupted_step_and_raises_when_none_loads(tmp_path):
    root = tmp_path / "run"
    saved = run_ranks(two_steps_worker, 2, str(root))[0]
    flip_a_data_byte(root / "step-2")
    res = run_ranks(resume_or_fail_worker, 2, str(root))[0]
    assert res["step"] == 1 and "state" in res and max_abs_diff(res["state"], saved) > 0.0
    flip_a_data_byte(root / "step-1")
    for res in run_ranks(resume_or_fail_worker, 2, str(root)):
        assert res["error"].startswith("NoLoadableCheckpointError"), res
        assert "step-1" in res["error"] and "step-2" in res["error"] and "checksum" in res["error"], res


def oddshapes_resume_worker(rank, world, root):
    import torch

    from tests.dcp.test_format_compat import DEDICATED
    from tests.helpers.models import OddShapes
    from tests.helpers.setup import make_mesh, shard_model

    torch.manual_seed(1)
    model = OddShapes()
    _, opt = shard_model(model, make_mesh(), lambda n, p: n in DEDICATED, wrap=())
    manager = ddcp.CheckpointManager(root)
    step = manager.resume(model, opt)
    return {"step": step, "extra": manager.last_extra, "model": dmuon.get_model_state_dict(model)}


def test_resume_resumes_a_step_written_on_python_3_11_2(tmp_path):
    import shutil

    import torch

    from tests.dcp.test_format_compat import FIXTURES

    fixture = FIXTURES / "python-3.11.2"
    shutil.copytree(fixture / "dmuon-save", tmp_path / "run" / "step-2")
    got = run_ranks(oddshapes_resume_worker, 2, str(tmp_path / "run"))[0]
    assert got["step"] == 2 and got["extra"]["note"] == "written on Python 3.11.2"
    assert max_abs_diff(got["model"], torch.load(fixture / "expected.pt", weights_only=True)["model"]) == 0.0
