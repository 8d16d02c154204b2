"""Every rank agrees, or every rank raises: the same outcome and the same error type everywhere.

A collective step that can fail on some ranks only (a read, an upload, a file received from a
peer) must not leave the others waiting in the next collective, nor let each rank raise its
own story. Two shapes:

* :func:`agree`: each rank hands in what went wrong there (or None); all of them learn every
  rank's problem in one all-gather and raise one error naming each failed rank and its cause;
* :func:`decided`: one rank does the work (reads a commit, decides whether to start); every
  rank gets its result, or every rank raises its failure.

The error's type is the caller's ``error`` when given (the callers' contracts: a failed fetch
is a :class:`CheckpointIncompleteError`), else the first failed rank's when that is a dmuon
checkpoint error (a corrupt file stays a :class:`CheckpointCorruptError` on every rank, so
callers that fall back past a corrupt step do so everywhere), else :class:`CheckpointError`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch.distributed as dist

from .errors import CheckpointError

__all__ = ["agree", "broadcast_over", "decided", "gather_over"]

T = TypeVar("T")

#: what a rank reports: (its exception type, or None for a plain message; the message)
Problem = tuple[type | None, str]


def _problem(mine: BaseException | str | None) -> Problem | None:
    if mine is None:
        return None
    if isinstance(mine, BaseException):
        return type(mine), (str(mine) if isinstance(mine, CheckpointError) else f"{type(mine).__name__}: {mine}")
    return None, mine


def _error(kind: type | None, error: type[Exception] | None, text: str) -> Exception:
    if error is not None:
        return error(text)
    if isinstance(kind, type) and issubclass(kind, CheckpointError):
        try:
            return kind(text)
        except TypeError:  # a constructor that wants more than a message
            pass
    return CheckpointError(text)


def agree(
    mine: BaseException | str | None,
    gather: Callable[[Any], list[Any]],
    what: str,
    error: type[Exception] | None = None,
) -> None:
    """Collective over the ranks ``gather`` (an all-gather of a picklable object) reaches:
    return on every rank if no rank had a problem; else raise on every rank one error,
    ``"<what>: rank <r>: <problem>; ..."``, of one type (module docstring). This rank's own
    exception, if any, is the raised error's cause."""
    everyone = gather(_problem(mine))
    failed: dict[int, Problem] = {rank: entry for rank, entry in enumerate(everyone) if entry is not None}
    if not failed:
        return
    kind = failed[min(failed)][0]
    detail = "; ".join(f"rank {rank}: {message}" for rank, (_, message) in sorted(failed.items()))
    raise _error(kind, error, f"{what}: {detail}") from (mine if isinstance(mine, BaseException) else None)


def decided(
    work: Callable[[], T],
    on: int,
    me: int,
    broadcast: Callable[[Any, int], Any],
    what: str,
    error: type[Exception] | None = None,
) -> T:
    """Collective: rank ``on`` runs ``work``; every rank returns its result (picklable), or
    every rank raises one error, ``"<what>: <problem>"`` (its type as for :func:`agree`)."""
    outcome: tuple[bool, Any] | None = None
    failure: Exception | None = None
    if me == on:
        try:
            outcome = (True, work())
        except Exception as exc:
            failure = exc
            outcome = (False, _problem(exc))
    done, value = broadcast(outcome, on)
    if done:
        return value
    kind, message = value
    raise _error(kind, error, f"{what}: {message}") from failure


def gather_over(group: Any = None) -> Callable[[Any], list[Any]]:
    """The all-gather of a picklable object over ``group`` (default: the default group), as
    :func:`agree` takes it."""

    def gather(obj: Any) -> list[Any]:
        everyone: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(everyone, obj, group=group)
        return everyone

    return gather


def broadcast_over(group: Any = None) -> Callable[[Any, int], Any]:
    """The broadcast of a picklable object from a group rank over ``group`` (default: the
    default group), as :func:`decided` takes it."""

    def broadcast(obj: Any, src: int) -> Any:
        box = [obj]
        dist.broadcast_object_list(box, group=group, group_src=src)
        return box[0]

    return broadcast
