"""Restoring from the tiers: which step is picked, and what happens when it cannot load.

Two forked ranks stand for two nodes (``node_rank=rank``, a local directory each); the
torchrun scenarios are in test_manager.py.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest

import dmuon
import dmuon.dcp as ddcp
from dmuon.dcp.tiers.local import Holdings, StepCommit
from dmuon.dcp.tiers.restore import LOCAL, PERSISTENT, choose_candidates
from tests.helpers.launch import run_ranks
from tests.helpers.setup import max_abs_diff
from tests.helpers.training import build, train


def holdings(node: int, files: dict[int, dict[str, int]], commits: dict[int, dict[str, int]]) -> Holdings:
    return Holdings(node, files, {s: [StepCommit(s, f"id{s}", sizes)] for s, sizes in commits.items()})


MANIFEST = {"__0_a.distcp": 10, "__1_a.distcp": 20}


def test_the_newest_step_complete_somewhere_comes_first():
    nodes = [
        holdings(0, {4: {"__0_a.distcp": 10}, 6: {"__0_a.distcp": 10}}, {4: MANIFEST, 6: MANIFEST}),
        holdings(1, {4: {"__1_a.distcp": 20, "__0_a.distcp": 10}}, {4: MANIFEST}),  # node 1's part of 6 is lost
    ]
    order = [(c.step, c.source) for c in choose_candidates(nodes, [2, 4])]
    assert order == [(4, LOCAL), (4, PERSISTENT), (2, PERSISTENT)]
    best = choose_candidates(nodes, [])[0]
    assert best.holders == {"__0_a.distcp": [0, 1], "__1_a.distcp": [1]} and best.commit_node == 0


def test_a_file_of_the_wrong_size_does_not_count_and_persistent_steps_fill_in():
    nodes = [holdings(0, {6: {"__0_a.distcp": 10, "__1_a.distcp": 19}}, {6: MANIFEST})]
    assert [(c.step, c.source) for c in choose_candidates(nodes, [6, 3])] == [(6, PERSISTENT), (3, PERSISTENT)]
    assert choose_candidates([holdings(0, {}, {})], []) == []


# ---------------------------------------------------------------------------------------------
def train_worker(rank, world, base):
    model, opt = build()
    manager = ddcp.TieredCheckpointManager(f"{base}/node{rank}", local_every=2, node_rank=rank)
    states = {}
    for step in range(1, 5):
        train(model, opt, rank, world, range(step - 1, step))
        manager.step(step, model, opt, extra={"step": step})
        if step % 2 == 0:
            states[step] = dmuon.get_model_state_dict(model)
    manager.close()
    return states


def restore_worker(rank, world, base, model_kwargs):
    model, opt = build(**model_kwargs)
    manager = ddcp.TieredCheckpointManager(f"{base}/node{rank}", node_rank=rank)
    try:
        step = manager.resume(model, opt)
    except ddcp.CheckpointError as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    finally:
        manager.close()
    return {"step": step, "report": manager.last_restore, "state": dmuon.get_model_state_dict(model)}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    base = tmp_path_factory.mktemp("tiers")
    return base, run_ranks(train_worker, 2, str(base))[0]


def copy_of(saved, tmp_path: Path) -> Path:
    import shutil

    shutil.copytree(saved[0], tmp_path / "run")
    return tmp_path / "run"


def test_a_corrupted_local_file_falls_back_to_the_step_before(saved, tmp_path):
    base = copy_of(saved, tmp_path)
    step_dir = base / "node0" / "step-4"
    [name] = [n for n in os.listdir(step_dir) if n.endswith(".distcp")]
    data = bytearray((step_dir / name).read_bytes())
    data[len(data) // 2] ^= 0xFF
    (step_dir / name).write_bytes(bytes(data))
    res = run_ranks(restore_worker, 2, str(base), {})[0]
    assert res["step"] == 2 and res["report"].source == LOCAL
    [skipped] = res["report"].skipped
    assert "step 4" in skipped and "checksum mismatch" in skipped and name in skipped
    assert max_abs_diff(res["state"], saved[1][2]) == 0.0


def test_a_wrong_model_is_refused_on_every_rank_not_skipped(saved, tmp_path):
    base = copy_of(saved, tmp_path)
    res = run_ranks(restore_worker, 2, str(base), {"hidden": 40})
    for r in res:
        assert r["error"].startswith("CheckpointMismatchError"), r
        assert "shape" in r["error"]


def test_nothing_saved_restores_nothing(tmp_path):
    res = run_ranks(restore_worker, 2, str(tmp_path / "empty"), {})
    assert [r["step"] for r in res] == [None, None]


# ---------------------------------------------------------------------------------------------
# two nodes of two ranks, HSDP 2 x 2: replication partners and fetches spread over the ranks
# ---------------------------------------------------------------------------------------------
def hsdp_worker(rank, world, base, phase):
    model, opt = build(replicate=2)
    node = rank // 2
    manager = ddcp.TieredCheckpointManager(f"{base}/node{node}", local_every=2, node_rank=node)
    if phase == "train":
        train(model, opt, rank, world, range(2))
        manager.step(2, model, opt, extra={"step": 2})
        result = None
    else:
        result = {"step": manager.resume(model, opt), "report": manager.last_restore}
    manager.close()
    return {"restored": result, "model": dmuon.get_model_state_dict(model),
            "optim": dmuon.get_optimizer_state_dict(model, opt)}


def test_hsdp_on_two_nodes_of_two_ranks_restores_one_lost_node_bit_exactly(tmp_path):
    import shutil

    saved = run_ranks(hsdp_worker, 4, str(tmp_path), "train")[0]
    for node in (0, 1):  # each rank's file went to its partner on the other node
        peer = tmp_path / f"node{node}" / f"peer-{1 - node}" / "step-2"
        ranks = sorted(int(n.split("_")[2]) for n in os.listdir(peer) if n.endswith(".distcp"))
        assert ranks == [2 * (1 - node), 2 * (1 - node) + 1], ranks
    shutil.rmtree(tmp_path / "node0")
    res = run_ranks(hsdp_worker, 4, str(tmp_path), "restore")
    assert [r["restored"]["step"] for r in res] == [2] * 4
    assert all(r["restored"]["report"].fetched_bytes > 0 for r in res[:2])  # node 0's two ranks both received
    assert max_abs_diff(res[0]["model"], saved["model"]) == 0.0
    for section in ("fsdp2", "dedicated"):
        for fqn, entry in saved["optim"][section].items():
            assert max_abs_diff(res[0]["optim"][section][fqn], entry) == 0.0, fqn
