"""Scenario 8: the background write of async_save fails (disk full part-way).

The failure surfaces on ``wait()`` and, if nobody waited, at the next save; training goes on
meanwhile and is never blocked for good; the failed checkpoint is never committed.
"""
import os
import time

import dmuon.dcp as ddcp
from tests.helpers.launch import run_ranks
from tests.helpers.training import build, train


def async_failure_worker(rank, world, root):
    from tests.helpers.quota_fs import register

    register()
    if rank == 1:
        os.environ["DMUON_QUOTA_BYTES"] = "20000"  # rank 1 runs out of space mid-file
    model, opt = build()
    out = {}
    bad = f"quota://{root}/bad"
    t0 = time.monotonic()
    handle = ddcp.async_save(model, opt, bad)
    out["returned_after"] = time.monotonic() - t0
    losses = train(model, opt, rank, world, range(3))  # training goes on while it fails
    out["trained"] = len(losses)
    try:
        handle.wait(timeout=120)
        out["wait"] = None
    except ddcp.CheckpointError as exc:
        out["wait"] = str(exc)
    out["committed_bad"] = os.path.exists(f"{root}/bad/.metadata")
    # a second failure nobody waits for surfaces at the next save instead
    ddcp.async_save(model, opt, f"quota://{root}/bad2")
    try:
        ddcp.save(model, opt, f"{root}/good")
        out["next_save"] = None
    except ddcp.CheckpointError as exc:
        out["next_save"] = str(exc)
    out["committed_bad2"] = os.path.exists(f"{root}/bad2/.metadata")
    os.environ.pop("DMUON_QUOTA_BYTES", None)
    ddcp.save(model, opt, f"{root}/good")  # and then saving works again
    out["committed_good"] = os.path.exists(f"{root}/good/.metadata")
    return out


def test_async_failure_surfaces_and_commits_nothing(tmp_path, reliability_report):
    results = run_ranks(async_failure_worker, 2, str(tmp_path), timeout=180)
    for res in results:
        assert res["trained"] == 3
        assert res["wait"] and "No space left on device" in res["wait"]
        assert res["next_save"] and "async save" in res["next_save"]
        assert not res["committed_bad"] and not res["committed_bad2"]
        assert res["committed_good"]
    reliability_report["async_failure"] = {
        "surfaced_on_wait": sum(bool(r["wait"]) for r in results),
        "surfaced_at_next_save": sum(bool(r["next_save"]) for r in results),
        "committed": sum(r["committed_bad"] + r["committed_bad2"] for r in results), "ranks": len(results)}
