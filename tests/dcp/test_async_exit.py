"""An async save in flight when a real torchrun job ends is committed, or reported loudly.

Each case launches ``tests/helpers/async_exit_job.py`` under ``torch.distributed.run`` on 2
ranks, with the background write held back so that the save is surely still in flight when
the script ends (see the job's docstring for the endings). Afterwards the checkpoint must be
committed and hold, bit for bit, the model the save was started from; or, where the save
cannot succeed, every rank must say so on stderr and the job must not exit 0.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch

import dmuon.dcp as ddcp
from tests.helpers.launch import free_port
from tests.helpers.setup import max_abs_diff

ROOT = Path(__file__).resolve().parents[2]
JOB_TIMEOUT = 90


def launch(path: str, out: Path, ending: str, *, entry: str = "async_save", storage_options=None,
           slow: float = 2.0) -> subprocess.Popen:
    out.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
            "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
            "-m", "tests.helpers.async_exit_job", "--path", path, "--out", str(out),
            "--ending", ending, "--entry", entry, "--slow", str(slow)]
    for key, value in (storage_options or {}).items():
        argv += ["--storage-option", f"{key}={value}"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)


def finish(proc: subprocess.Popen, out: Path, ending: str) -> tuple[int, str]:
    """Wait for the job (SIGTERM to the launcher first, for that ending); kill it all on timeout."""
    try:
        if ending == "sigterm":
            deadline = time.monotonic() + JOB_TIMEOUT
            while not all((out / f"in-flight.{rank}").exists() for rank in range(2)):
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise AssertionError("the job never started its save")
                time.sleep(0.1)
            proc.send_signal(signal.SIGTERM)  # the launcher passes it on to every worker
        output, _ = proc.communicate(timeout=JOB_TIMEOUT)
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)  # the launcher's session: the launcher and its workers
        proc.communicate()
        raise
    return proc.returncode, output


def torch_teardown_abort(code: int, output: str, path: str) -> bool:
    """The job failed only by a C++ abort at interpreter exit, after every rank's guard had
    reported the save committed."""
    return (code != 0 and "terminate called without an active exception" in output
            and output.count(f"async save to {path} committed") == 2)


def saved_model(path: str, storage_options, tmp_path: Path) -> dict:
    from safetensors.torch import load_file

    [exported] = ddcp.export(path, str(tmp_path / "exported"), storage_options=storage_options)
    return load_file(exported)


ENDINGS = {  # ending -> whether the job itself may exit 0
    "destroy": True,
    "exit": True,
    "raise": False,
    "sigterm": False,
}


@pytest.mark.parametrize("backend", ["local", "s3"])
@pytest.mark.parametrize("ending", sorted(ENDINGS))
def test_a_save_in_flight_at_the_end_of_the_job_is_committed(checkpoint_location, tmp_path, backend, ending):
    for attempt in (1, 2):
        path, options = checkpoint_location(backend, f"ckpt-{attempt}")
        out = tmp_path / f"out-{attempt}"
        code, output = finish(launch(path, out, ending, storage_options=options), out, ending)
        if attempt == 1 and torch_teardown_abort(code, output, path) and ENDINGS[ending]:
            # torch's own teardown at interpreter exit, after dmuon's part was done (the save
            # committed on every rank): plain torch jobs abort so 1 time in 10 here
            # (docs/reliability.md, "Exit status"; dmuon's own cause, its roll-call thread, is
            # fixed). The project's rule for native crashes is one more run, with a warning
            warnings.warn(f"the job aborted at interpreter exit after committing; running it once more:\n"
                          f"{output[-1500:]}", stacklevel=1)
            continue
        break
    assert (code == 0) == ENDINGS[ending], output[-3000:]
    assert ddcp.verify(path, storage_options=options) == [], output[-3000:]
    expected = torch.load(out / "expected.pt", weights_only=True)
    assert max_abs_diff(saved_model(path, options, tmp_path), expected) == 0.0
    if ending in ("destroy", "sigterm"):  # the guard says what it waited for, on every rank
        assert output.count(f"async save to {path} committed") == 2, output[-3000:]


@pytest.mark.parametrize("entry", ["manager", "torch"])
def test_other_entry_points_are_finished_before_destroy(tmp_path, entry):
    """CheckpointManager(async_save=True) without close(), and torch's own dcp.async_save
    (torchtitan's async mode), followed by destroy_process_group()."""
    root = tmp_path / "run"
    out = tmp_path / "out"
    code, output = finish(launch(str(root), out, "destroy", entry=entry), out, "destroy")
    assert code == 0, output[-3000:]
    path = root / "step-2" if entry == "manager" else root
    assert ddcp.verify(path) == [], output[-3000:]
    expected = torch.load(out / "expected.pt", weights_only=True)
    assert max_abs_diff(saved_model(str(path), None, tmp_path), expected) == 0.0


@pytest.mark.parametrize("ending", ["destroy", "exit"])
def test_a_save_that_cannot_commit_is_reported_on_every_rank_and_fails_the_job(tmp_path, ending):
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("x")
    out = tmp_path / "out"
    code, output = finish(launch(str(blocker), out, ending, slow=0.0), out, ending)
    assert code != 0, output[-3000:]
    assert output.count(f"dmuon: async save to {blocker} was NOT committed") == 2, output[-3000:]
    assert blocker.read_text() == "x"
