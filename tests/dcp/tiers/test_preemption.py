"""Preemption: the signal only sets a flag; the step boundary saves, within a deadline or not
at all; the handler composes with dmuon's exit guard (an async save in flight is finished
first, and the process goes on to its step boundary instead of dying)."""
from __future__ import annotations

import os
import signal

import dmuon.dcp as ddcp
from dmuon.dcp.tiers.preemption import PreemptionWatcher
from tests.helpers import faults
from tests.helpers.launch import run_ranks
from tests.helpers.training import build, train


def test_the_handler_only_sets_a_flag_and_close_puts_the_previous_one_back():
    seen = []
    previous = signal.signal(signal.SIGUSR1, lambda signum, frame: seen.append(signum))
    try:
        watcher = PreemptionWatcher((signal.SIGUSR1,))
        assert not watcher.requested
        os.kill(os.getpid(), signal.SIGUSR1)  # handled before the next bytecode: we are alive
        assert watcher.requested and watcher.received == signal.SIGUSR1 and seen == []
        os.kill(os.getpid(), signal.SIGUSR1)  # a second notice changes nothing
        watcher.close()
        os.kill(os.getpid(), signal.SIGUSR1)
        assert seen == [signal.SIGUSR1]
    finally:
        signal.signal(signal.SIGUSR1, previous)


def exit_guard_worker(rank, world, base):
    """An async save in flight (exit_guard's handler in front), then SIGTERM on rank 1."""
    model, opt = build()
    manager = ddcp.TieredCheckpointManager(f"{base}/node{rank}", local_every=100, node_rank=rank)
    train(model, opt, rank, world, range(1))
    faults.on_call("DMuonStorageWriter._write_file", faults.pause(1.0))
    handle = ddcp.async_save(model, opt, f"{base}/async", extra={"step": 1})
    guard_in_front = signal.getsignal(signal.SIGTERM) != manager.preemption._on_signal
    if rank == 1:
        os.kill(os.getpid(), signal.SIGTERM)  # the guard finishes the save, then calls ours
    committed = handle.done()
    faults.clear()
    train(model, opt, rank, world, range(1, 2))
    stop = manager.step(2, model, opt, extra={"step": 2})
    report = manager.last_preemption
    manager.close()
    ddcp.api.model_checkpointer(model).close()
    restored = signal.getsignal(signal.SIGTERM)
    return {"guard_in_front": guard_in_front, "committed_by_handler": committed, "stop": stop, "report": report,
            "steps": manager.local_steps(), "handler_after_close": restored}


def test_sigterm_during_an_async_save_finishes_it_and_then_saves_at_the_step_boundary(tmp_path):
    res = run_ranks(exit_guard_worker, 2, str(tmp_path))
    assert res[0]["guard_in_front"] and res[1]["guard_in_front"]
    assert res[1]["committed_by_handler"]  # exit_guard waited for it inside the signal handler
    assert ddcp.verify(str(tmp_path / "async")) == []
    for r in res:  # every rank agreed at the boundary, and step 2 is saved
        assert r["stop"] and r["report"].saved and r["report"].replicated and r["steps"] == [2]
        assert r["handler_after_close"] == signal.SIG_DFL
    assert res[0]["report"] == res[1]["report"]  # the same report on every rank, message included
    assert "saved to the local tier in" in res[0]["report"].message


def deadline_worker(rank, world, base):
    model, opt = build()
    manager = ddcp.TieredCheckpointManager(f"{base}/node{rank}", local_every=2, node_rank=rank,
                                           preemption_signals=(signal.SIGUSR1,), preemption_deadline_s=0.3)
    train(model, opt, rank, world, range(2))
    faults.on_call("DMuonStorageWriter._write_file", faults.pause(0.6))  # this save takes > 0.6 s
    manager.step(2, model, opt)
    faults.clear()
    train(model, opt, rank, world, range(2, 3))
    if rank == 0:
        os.kill(os.getpid(), signal.SIGUSR1)
    stop = manager.step(3, model, opt)
    report = manager.last_preemption
    manager.close()
    return {"stop": stop, "report": report, "steps": manager.local_steps(), "save_s": manager.last_save_seconds}


def test_a_save_that_cannot_meet_the_deadline_is_not_started_and_says_so(tmp_path):
    res = run_ranks(deadline_worker, 2, str(tmp_path))
    for r in res:
        assert r["save_s"] > 0.6
        assert r["stop"] and not r["report"].saved, r["report"]
        assert "step 3 NOT saved" in r["report"].message and "step 2, is intact" in r["report"].message
        assert r["steps"] == [2]
    assert res[0]["report"] == res[1]["report"]  # the same report on every rank, message included
    message = res[0]["report"].message
    assert message.count(" s were left") + message.count("had passed") == 1, message  # one figure of time left
