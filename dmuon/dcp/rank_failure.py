"""A rank that stops during a save or a load: the others name it, and the phase, instead of
raising the transport's ``Connection reset by peer``.

When a rank dies, the collective the others are in (DCP's gather of plans, of write results,
the commit's broadcast) fails with the backend's own error, which names a socket, not a rank;
and ranks blocked on a survivor (say, waiting for the coordinator's answer) learn of it only
later. So each rank taking part in a checkpoint operation keeps a :class:`RollCall`: a
thread, blocked on the job's rendezvous store (its own client, ``Store.clone()``: no request
while it waits), that answers a roll call even while the rank itself is stuck in a collective.
The first rank whose collective fails calls the roll; ranks that do not answer within
``DMUON_ROLL_CALL_S`` seconds (default 5) are the ones that stopped, and that verdict is kept in
the store so that every survivor, whenever it fails, reports the same ranks. Each raises
:class:`RankStoppedError` naming them and the phase it was in. Where every rank answers, the
failure was something else, and the original error is raised unchanged. A store gone with its
host (rank 0, in a job not started by torchrun) is said so.

Cost in the normal path, per rank and operation: a thread with its own store client, one
blocking wait, one key set and deleted again (the store keeps nothing of a successful
operation); the operation's key names come from its group's name and collective count, the
same on every rank of the group, whichever thread runs the operation (an async save's runs
on its writer thread, over its own group, while training runs collectives on another).

Nothing is committed in any of these cases: the commit needs every rank's write results, and
``.metadata`` is written last, by the coordinator, after they all arrived.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from typing import Any

import torch.distributed as dist

from .. import compat
from .errors import CheckpointError

__all__ = ["Phases", "RankStoppedError", "RollCall", "explain_failure"]

#: seconds a survivor waits for the other ranks' answers to a roll call
ROLL_CALL_ENV = "DMUON_ROLL_CALL_S"
_ROLL_CALL_DEFAULT_S = 5.0
_KEY_PREFIX = "dmuon/roll-call"


class RankStoppedError(CheckpointError):
    """One or more ranks stopped (died, or stopped answering) during a save or a load."""

    everywhere = True  # every survivor raises it, in whichever round it is

    def __init__(self, message: str, stopped: list[int] | None = None, phase: str = "") -> None:
        super().__init__(message)
        self.stopped = stopped or []
        self.phase = phase


class Phases:
    """Where this rank is in a save or a load, as its planner, writer and reader say."""

    def __init__(self, first: str) -> None:
        self.now = first

    def enter(self, phase: str) -> None:
        self.now = phase


_CALL, _DONE = b"call", b"done"
#: seconds :meth:`RollCall.close` waits for the answering thread to leave the store (it needs
#: two requests; a store that does not answer is not waited for longer)
_LEAVE_S = 2.0


class RollCall:
    """Answers a roll call for one checkpoint operation of this rank (see the module docstring)."""

    def __init__(self, group: Any = None) -> None:
        self.store = None
        if not dist.is_initialized() or dist.get_world_size(group) == 1:
            return
        try:
            self.store = compat.default_store()
            sequence = compat.collective_count(group)
            name = getattr(dist.group.WORLD if group is None else group, "group_name", "")
        except Exception:  # a torch or store without them: failures are raised as they come
            self.store = None
            return
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.base = f"{_KEY_PREFIX}/{name}/{sequence}"
        answering = self.store.clone()
        self._thread = threading.Thread(target=self._answer, args=(answering,), name="dmuon-roll-call", daemon=True)
        self._thread.start()

    def _answer(self, store) -> None:
        mine = f"{self.base}/call/{self.rank}"
        try:
            store.wait([mine])
            if store.get(mine) == _CALL:
                store.set(f"{self.base}/here/{self.rank}", b"1")
            else:  # the operation ended well: leave nothing behind in the store
                store.delete_key(mine)
        except Exception:  # the store's timeout, or the store gone: nothing to answer
            return

    def close(self) -> None:
        """The operation is over: release the answering thread, and wait until it has left the
        store. A daemon thread still inside a store call when the interpreter finalizes is ended
        from under pybind11's ``noexcept`` frames, and the process aborts ("terminate called
        without an active exception"): that was the abort seen at the end of jobs whose last
        async save the exit guard finished (docs/reliability.md, "Exit status")."""
        if self.store is not None:
            with contextlib.suppress(Exception):
                self.store.compare_set(f"{self.base}/call/{self.rank}", "", _DONE)
            self._thread.join(timeout=_LEAVE_S)

    def stopped(self, wait_s: float) -> list[int]:
        """Call the roll (or read the verdict of the rank that called it first): the ranks
        that did not answer within ``wait_s`` seconds."""
        assert self.store is not None
        store, base = self.store, self.base
        verdict = f"{base}/verdict"
        if not store.check([verdict]):
            store.set(f"{base}/here/{self.rank}", b"1")
            for other in range(self.world):
                if other != self.rank:
                    store.compare_set(f"{base}/call/{other}", "", _CALL)
            missing = set(range(self.world)) - {self.rank}
            deadline = time.monotonic() + wait_s
            while missing:
                missing = {other for other in missing if not store.check([f"{base}/here/{other}"])}
                if not missing or time.monotonic() > deadline:
                    break
                time.sleep(0.05)
            store.compare_set(verdict, "", ",".join(map(str, sorted(missing))).encode())
        text = store.get(verdict).decode()
        return [int(rank) for rank in text.split(",") if rank]


def _wait_s() -> float:
    try:
        return float(os.environ.get(ROLL_CALL_ENV, _ROLL_CALL_DEFAULT_S))
    except ValueError:
        return _ROLL_CALL_DEFAULT_S


def _ranks(stopped: list[int]) -> str:
    return ("rank " if len(stopped) == 1 else "ranks ") + ", ".join(map(str, stopped))


def explain_failure(
    exc: BaseException, roll_call: RollCall, what: str, phase: str, consequence: str
) -> RankStoppedError | None:
    """After ``exc`` ended a collective save or load: the error naming the ranks that stopped,
    or None when no rank did (``exc`` is then the real cause, raised as it is)."""
    if isinstance(exc, CheckpointError) or not isinstance(exc, RuntimeError) or roll_call.store is None:
        return None
    try:
        stopped = roll_call.stopped(_wait_s())
    except Exception as store_error:  # the store went with its host
        return RankStoppedError(
            f"{what}: stopped while this rank was {phase}: the job's rendezvous store is unreachable "
            f"({type(store_error).__name__}: {store_error}), so the rank hosting it (rank 0 unless "
            f"started by torchrun) stopped; {consequence}. The transport said: {exc}",
            phase=phase,
        )
    if not stopped:
        return None
    return RankStoppedError(
        f"{what}: {_ranks(stopped)} stopped while this rank was {phase}; {consequence}. The transport said: {exc}",
        stopped,
        phase,
    )
