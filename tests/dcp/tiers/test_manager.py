"""TieredCheckpointManager on two "nodes": torchrun agents on localhost (c10d rendezvous), each
node with its own local directory, the persistent tier on S3 (SeaweedFS).

The four scenarios of issue 24: (a) one node's local files lost: restored from the peer's
replica, bit-exact; (b) both lost: from S3, bit-exact; (c) SIGTERM to one worker mid-training:
the current step is committed before the job exits and resuming from it is bit-exact against
an uninterrupted run; (d) a kill in the middle of replication or promotion never leaves a step
that a restore would pick but cannot load.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import time
from pathlib import Path

import pytest
import torch

from tests.helpers.nodes import launch_nodes
from tests.helpers.setup import max_abs_diff

JOB = "tests.helpers.tiers_job"
STEPS = 6


def run_job(tmp: Path, name: str, local: Path, mode: str, *extra: str, persistent=None, options=None,
            expect_ok: bool = True, timeout: float = 90.0):
    out = tmp / name
    out.mkdir(parents=True)
    args = ["--mode", mode, "--local-root", f"{local}/node{{node}}", "--out", str(out), "--steps", str(STEPS),
            *extra]
    if persistent is not None:
        args += ["--persistent", persistent]
    for key, value in (options or {}).items():
        args += ["--storage-option", f"{key}={value}"]
    job = launch_nodes(JOB, args, out / "logs")
    codes = job.wait(timeout)
    if expect_ok:
        assert codes == [0, 0], job.output()
    return out, codes, job


def assert_same_state(got: dict, want: dict) -> None:
    assert max_abs_diff(got["model"], want["model"]) == 0.0
    for section in ("fsdp2", "dedicated"):
        assert want["optim"][section].keys() == got["optim"][section].keys()
        for fqn, entry in want["optim"][section].items():
            assert max_abs_diff(got["optim"][section][fqn], entry) == 0.0, fqn
    assert got["optim"]["param_groups"] == want["optim"]["param_groups"]


def load(path: Path) -> dict:
    return torch.load(path, weights_only=False)


@pytest.fixture(scope="module")
def trained(tmp_path_factory, s3_server):
    """One uninterrupted run: local tier every 2 steps, S3 every 4; 6 steps."""
    tmp = tmp_path_factory.mktemp("tiers")
    persistent = s3_server.url("tiers-run")
    out, _, _ = run_job(tmp, "train", tmp / "local", "train", "--persistent-every", "4", persistent=persistent,
                        options=s3_server.storage_options)
    return {"out": out, "local": tmp / "local", "persistent": persistent, "options": s3_server.storage_options}


def copy_local(trained, tmp_path: Path) -> Path:
    local = tmp_path / "local"
    shutil.copytree(trained["local"], local, symlinks=True)
    return local


def test_uninterrupted_run_filled_both_tiers(trained):
    import dmuon.dcp as ddcp

    for node in (0, 1):
        root = trained["local"] / f"node{node}"
        assert sorted(os.listdir(root)) == [f"peer-{1 - node}", "step-4", "step-6"]  # keep=2
        assert sorted(os.listdir(root / f"peer-{1 - node}")) == ["step-4", "step-6"]
    persistent = ddcp.CheckpointManager(trained["persistent"], storage_options=trained["options"])
    assert persistent.steps() == [4]
    assert ddcp.verify(persistent.path(4), storage_options=trained["options"]) == []
    # The local copy is for a restore on this node: written through the page cache, which keeps it.
    from dmuon.dcp.storage.write_path import BUFFERED_ASKED

    for rank in (0, 1):
        assert json.loads((trained["out"] / f"write_paths.{rank}.json").read_text()) == [BUFFERED_ASKED.describe()]


def test_a_one_node_lost_restores_from_the_peer_replica(trained, tmp_path):
    local = copy_local(trained, tmp_path)
    shutil.rmtree(local / "node0")
    out, _, _ = run_job(tmp_path, "restore", local, "restore", persistent=trained["persistent"],
                        options=trained["options"])
    reports = [json.loads((out / f"restore.{rank}.json").read_text()) for rank in (0, 1)]
    assert [r["step"] for r in reports] == [6, 6]  # not step 4 from S3
    assert [r["source"] for r in reports] == ["local", "local"]
    assert reports[0]["fetched_bytes"] > 0  # rank 0's node had nothing: its bytes came from node 1
    assert reports[0]["extra"] == {"step": 6}
    assert_same_state(load(out / "restored.pt"), load(trained["out"] / "expected-6.pt"))
    assert not (local / "node0" / "restore-view").exists() and not (local / "node1" / "restore-view").exists()


def test_b_both_nodes_lost_restores_from_s3(trained, tmp_path):
    local = tmp_path / "local"  # nothing there
    out, _, _ = run_job(tmp_path, "restore", local, "restore", persistent=trained["persistent"],
                        options=trained["options"])
    report = json.loads((out / "restore.json").read_text())
    assert (report["step"], report["source"], report["fetched_bytes"]) == (4, "persistent", 0)
    assert_same_state(load(out / "restored.pt"), load(trained["out"] / "expected-4.pt"))


def committed_across_nodes(local: Path, step: int) -> bool:
    """Is step ``step`` committed, with every data file of its manifest whole on some node?"""
    from dmuon.dcp.tiers.local import LocalTier
    from dmuon.dcp.tiers.restore import choose_candidates

    holdings = [LocalTier(local / f"node{n}").holdings(n) for n in (0, 1)]
    return any(c.step == step for c in choose_candidates(holdings, []))


@pytest.mark.slow
def test_c_sigterm_to_one_worker_saves_the_current_step_and_resumes_bit_exactly(trained, tmp_path):
    local = tmp_path / "local"
    out = tmp_path / "preempted"
    out.mkdir()
    args = ["--mode", "train", "--local-root", f"{local}/node{{node}}", "--out", str(out), "--steps", str(STEPS),
            "--local-every", "4", "--step-seconds", "0.5"]
    job = launch_nodes(JOB, args, out / "logs")
    deadline = time.monotonic() + 60
    while not ((out / "step.1").exists() and int((out / "step.1").read_text() or 0) >= 2):
        assert time.monotonic() < deadline and all(a.poll() is None for a in job.agents), job.output()
        time.sleep(0.05)
    os.kill(int((out / "pid.1").read_text()), signal.SIGTERM)  # one worker, not the launcher
    assert job.wait(60) == [0, 0], job.output()
    preempted = json.loads((out / "preempted.json").read_text())
    stopped = preempted["step"]
    assert preempted["saved"] and preempted["replicated"], preempted
    assert 3 <= stopped < STEPS, preempted  # mid-training, at the boundary after the signal
    assert committed_across_nodes(local, stopped)
    assert "preemption notice at step" in job.output()
    # resume on to the uninterrupted run's end: bit-exact
    resumed, _, _ = run_job(tmp_path, "resume", local, "resume", "--local-every", "4")
    report = json.loads((resumed / "restore.json").read_text())
    assert (report["step"], report["source"]) == (stopped, "local")
    assert_same_state(load(resumed / "final.pt"), load(trained["out"] / "final.pt"))


@pytest.mark.slow
def test_d_kill_during_replication_leaves_only_loadable_steps(trained, tmp_path):
    local = tmp_path / "local"
    out, codes, job = run_job(tmp_path, "killed", local, "train", "--kill", "replication", expect_ok=False)
    assert codes != [0, 0], job.output()
    peer = local / "node1" / "peer-0" / "step-4"
    assert [n for n in os.listdir(peer) if ".tmp-" in n], os.listdir(peer)  # died mid-file
    assert not [n for n in os.listdir(peer) if n.endswith(".distcp")]
    # with node 0's disk gone, step 4 is incomplete (its node-0 part never reached node 1)
    shutil.rmtree(local / "node0")
    assert not committed_across_nodes(local, 4)
    restored, _, _ = run_job(tmp_path, "restore", local, "restore")
    report = json.loads((restored / "restore.json").read_text())
    assert (report["step"], report["source"]) == (2, "local")
    assert_same_state(load(restored / "restored.pt"), load(out / "expected-2.pt"))


@pytest.mark.slow
def test_d_kill_during_promotion_leaves_only_loadable_steps(trained, tmp_path, s3_server):
    import s3fs

    local = tmp_path / "local"
    persistent = s3_server.url("tiers-kill")
    out, codes, job = run_job(tmp_path, "killed", local, "train", "--persistent-every", "2", "--kill", "promotion",
                              persistent=persistent, options=s3_server.storage_options, expect_ok=False)
    assert codes != [0, 0], job.output()
    fs = s3fs.S3FileSystem(skip_instance_cache=True, **s3_server.storage_options)
    prefix = persistent.split("://", 1)[1]
    assert fs.exists(f"{prefix}/step-2/.metadata") and not fs.exists(f"{prefix}/step-4/.metadata")
    shutil.rmtree(local)  # both nodes' disks gone: only S3 is left
    restored, _, _ = run_job(tmp_path, "restore", local, "restore", persistent=persistent,
                             options=s3_server.storage_options)
    report = json.loads((restored / "restore.json").read_text())
    assert (report["step"], report["source"]) == (2, "persistent")
    assert_same_state(load(restored / "restored.pt"), load(out / "expected-2.pt"))


@pytest.mark.slow
def test_the_example_in_docs_tiers_md_runs_as_written(tmp_path, s3_server):
    import dmuon.dcp as ddcp
    from tests.core.test_docs_examples import examples

    script = tmp_path / "train.py"
    script.write_text(examples(Path(__file__).resolve().parents[3] / "docs" / "tiers.md")["tiers-train"])
    persistent = s3_server.url("docs-example")
    machines = [tmp_path / "machine-a", tmp_path / "machine-b"]  # one disk per agent, whatever its node rank

    def run(steps: int, name: str) -> str:
        envs = [{"LOCAL_CKPT": str(m), "PERSISTENT_CKPT": persistent, "STEPS": str(steps),
                 "CKPT_STORAGE_OPTIONS": json.dumps(s3_server.storage_options)} for m in machines]
        job = launch_nodes(str(script), [], tmp_path / name, envs=envs, cwd=tmp_path)
        assert job.wait(90) == [0, 0], job.output()
        return job.output()

    assert "starting after step 0 (from scratch)" in run(70, "first")
    assert ddcp.CheckpointManager(persistent, storage_options=s3_server.storage_options).steps() == [60]
    shutil.rmtree(machines[0])  # one machine replaced: its part of step 60 is on the other's disk
    assert "starting after step 60 (from local)" in run(100, "second")
