"""Every rank agrees, or every rank raises the same error type (dmuon/dcp/agreement.py)."""
from __future__ import annotations

from tests.helpers.launch import run_ranks


def _gather(obj):
    import torch.distributed as dist

    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _broadcast(obj, src):
    import torch.distributed as dist

    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def agreement_worker(rank, world):
    from dmuon.dcp.agreement import agree, decided
    from dmuon.dcp.errors import CheckpointCorruptError, CheckpointIncompleteError, StorageError

    def outcome(call):
        try:
            call()
        except Exception as exc:
            return type(exc).__name__, str(exc), type(exc.__cause__).__name__ if exc.__cause__ else None
        return "ok", None, None

    mine = CheckpointCorruptError("file 1 is damaged") if rank == 1 else None
    results = {
        "none": outcome(lambda: agree(None, _gather, "reading")),
        "derived": outcome(lambda: agree(mine, _gather, "reading")),
        "forced": outcome(lambda: agree(mine, _gather, "fetching", CheckpointIncompleteError)),
        "plain": outcome(lambda: agree(OSError("disk gone") if rank == 2 else None, _gather, "writing")),
        "message": outcome(lambda: agree("late" if rank != 0 else None, _gather, "replicating", StorageError)),
    }

    def fails():
        raise OSError("no such bucket")

    results["decided_ok"] = decided(lambda: rank * 10 + 7, 0, rank, _broadcast, "listing")
    results["decided_fails"] = outcome(lambda: decided(fails, 1, rank, _broadcast, "listing", StorageError))
    return results


def test_every_rank_gets_one_outcome_and_one_error_type():
    results = run_ranks(agreement_worker, 3, timeout=60)
    for rank, got in enumerate(results):
        assert got["none"] == ("ok", None, None)
        kind, text, cause = got["derived"]
        assert kind == "CheckpointCorruptError" and text == "reading: rank 1: file 1 is damaged"
        assert cause == ("CheckpointCorruptError" if rank == 1 else None)  # the failing rank's own error
        assert got["forced"][:2] == ("CheckpointIncompleteError", "fetching: rank 1: file 1 is damaged")
        assert got["plain"][:2] == ("CheckpointError", "writing: rank 2: OSError: disk gone")
        assert got["message"][:2] == ("StorageError", "replicating: rank 1: late; rank 2: late")
        assert got["decided_ok"] == 7
        assert got["decided_fails"][:2] == ("StorageError", "listing: OSError: no such bucket")
