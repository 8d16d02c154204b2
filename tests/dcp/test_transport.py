"""The transport's rounds (dmuon/dcp/transport.py): every rank the same outcome, or every rank
the same typed error naming the failed ranks and the round; typed fields reduced in one
all-reduce."""
from __future__ import annotations

import math
from dataclasses import dataclass

import pytest

from dmuon.dcp.errors import CheckpointCorruptError, CheckpointError, CheckpointExistsError
from dmuon.dcp.group_transport import SingleProcess
from dmuon.dcp.rank_failure import Phases
from dmuon.dcp.transport import Attempt, lowest, same
from tests.helpers.launch import run_ranks


@dataclass(frozen=True)
class Offer:
    changed: bool = False
    token: int | None = same()
    save_id: int = -1


@dataclass(frozen=True)
class Times:
    left: float = lowest(math.inf)
    slowest: float = 0.0


def outcome(call):
    try:
        value = call()
    except Exception as exc:
        cause = type(exc.__cause__).__name__ if exc.__cause__ else None
        return type(exc).__name__, str(exc), cause, getattr(exc, "ranks", None), getattr(exc, "phase", None)
    return "ok", value


def transport_worker(rank, world):
    from dmuon.dcp.errors import CheckpointIncompleteError, StorageError
    from dmuon.dcp.group_transport import transport_over

    transport = transport_over(None)
    mine = CheckpointCorruptError("file 1 is damaged") if rank == 1 else None
    results = {
        "none": outcome(lambda: transport.settle(None, "reading")),
        "derived": outcome(lambda: transport.settle(mine, "reading")),
        "forced": outcome(lambda: transport.settle(mine, "fetching", CheckpointIncompleteError)),
        "plain": outcome(lambda: transport.settle(OSError("disk gone") if rank == 2 else None, "writing")),
        "message": outcome(lambda: transport.settle("late" if rank != 0 else None, "replicating", StorageError)),
        # one all-reduce: a flag, a token the same everywhere or not, a maximum, a minimum of floats
        "same": outcome(lambda: transport.reduce(Offer(rank == 2, 7, rank), None, "planning")),
        "differs": outcome(lambda: transport.reduce(Offer(False, 7 + (rank == 1), -1), None, "planning")),
        "floats": outcome(lambda: transport.reduce(Times(10.0 - rank, rank * 0.5), None, "boundary")),
    }

    def fails():
        raise OSError("no such bucket")

    results["decided_ok"] = transport.decided(lambda: rank * 10 + 7, 0, "listing")
    results["decided_fails"] = outcome(lambda: transport.decided(fails, 1, "listing", StorageError))

    def decide(everyone):
        if len(everyone) == world and everyone[1] == "bad":
            raise CheckpointExistsError("already committed")
        return [f"answer {r} to {m}" for r, m in enumerate(everyone)]

    results["scattered"] = transport.gather_scatter(f"plan {rank}", decide, "planning")
    with transport.operation("save to s3://b/ckpt", Phases("planning"), "nothing was committed"):
        results["refused"] = outcome(lambda: transport.gather_scatter("bad" if rank == 1 else "ok", decide, "planning"))

        def nested():  # a round inside a step: its error, raised everywhere, is not reported twice
            with Attempt() as writing:
                transport.settle(OSError("disk full") if rank == 2 else None, "writing")
            transport.settle(writing, "committing")

        results["nested"] = outcome(nested)
    return results


def test_every_rank_gets_one_outcome_and_one_error_type():
    results = run_ranks(transport_worker, 3, timeout=60)
    for rank, got in enumerate(results):
        assert got["none"] == ("ok", None)
        kind, text, cause, ranks, phase = got["derived"]
        assert kind == "CheckpointCorruptError" and text == "reading: rank 1: file 1 is damaged"
        assert (ranks, phase) == ((1,), "reading")
        assert cause == ("CheckpointCorruptError" if rank == 1 else None)  # the failing rank's own error
        assert got["forced"][:2] == ("CheckpointIncompleteError", "fetching: rank 1: file 1 is damaged")
        assert got["plain"][:2] == ("CheckpointError", "writing: rank 2: OSError: disk gone")
        assert got["message"][:2] == ("StorageError", "replicating: ranks 1, 2: late")
        assert got["message"][3] == (1, 2)
        assert got["same"] == ("ok", Offer(True, 7, 2))
        assert got["differs"] == ("ok", Offer(False, None, -1))
        assert got["floats"] == ("ok", Times(8.0, 1.0))
        assert got["decided_ok"] == 7
        assert got["decided_fails"][:2] == ("StorageError", "listing: OSError: no such bucket")
        assert got["scattered"] == f"answer {rank} to plan {rank}"
        kind, text, cause, ranks, phase = got["refused"]  # the coordinator's failure, its type kept
        assert kind == "CheckpointExistsError" and ranks == (0,) and phase == "planning"
        assert text == "save to s3://b/ckpt failed on rank 0 while planning: already committed"
        kind, text, _, ranks, phase = got["nested"]
        assert (kind, ranks, phase) == ("CheckpointError", (2,), "writing"), got["nested"]
        assert text == "save to s3://b/ckpt failed on rank 2 while writing: OSError: disk full"


def test_one_process_runs_every_round_alone():
    transport = SingleProcess()
    assert transport.reduce(Offer(True, 3, 9), None, "planning") == Offer(True, 3, 9)
    assert transport.gather_scatter("x", lambda everyone: [everyone[0] * 2], "planning") == "xx"
    with transport.operation("load from /ckpt", Phases("planning"), "load again"):
        with pytest.raises(CheckpointExistsError, match="load from /ckpt failed on rank 0 while reading: exists"):
            transport.settle(CheckpointExistsError("exists"), "reading")
        with Attempt() as step:
            raise ValueError("bad value")
        assert isinstance(step.error, ValueError)
        with pytest.raises(CheckpointError, match="while planning: ValueError: bad value") as raised:
            transport.reduce(Offer(), step, "planning")
        assert raised.value.ranks == (0,) and raised.value.__cause__ is step.error
    assert transport.title == ""  # the operation's title is gone with it
