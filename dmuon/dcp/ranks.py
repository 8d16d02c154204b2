"""The few collectives a save or a load needs, and how a failure on some ranks reaches all.

:class:`Ranks` wraps them over one process group (the checkpointer's), with a stand-in for a
single process without one. The save and load protocols (``save_protocol.py``,
``load_protocol.py``) succeed with all-reduces of a few integers; only a path where some rank
failed gathers every rank's error, raised on every rank as torch's ``CheckpointException``,
as ``dcp.save``/``dcp.load`` would.
"""

from __future__ import annotations

import traceback
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from .cooperative import exchange_device

__all__ = ["Ranks", "raise_failures", "wrapped"]


class Ranks:
    """The few collectives a save or a load needs, over ``group`` (default: the default group),
    and a stand-in for one process without a process group."""

    def __init__(self, group: Any = None) -> None:
        self.group = group
        self.distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank(group) if self.distributed else 0
        self.world = dist.get_world_size(group) if self.distributed else 1
        self.coordinator = self.rank == 0

    def max(self, values: list[int]) -> list[int]:
        """Element-wise maximum over the ranks (one all-reduce of ``len(values)`` integers)."""
        if self.world == 1:
            return list(values)
        tensor = torch.tensor(values, dtype=torch.int64, device=exchange_device(self.group))
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self.group)
        return [int(v) for v in tensor.tolist()]

    def gather(self, obj: Any) -> list[Any] | None:
        """Every rank's ``obj`` on the coordinator (None elsewhere)."""
        if self.world == 1:
            return [obj]
        out: list[Any] | None = [None] * self.world if self.coordinator else None
        dist.gather_object(obj, out, group=self.group, group_dst=0)
        return out

    def scatter(self, objs: list[Any] | None) -> Any:
        """Rank ``r`` gets the coordinator's ``objs[r]``."""
        if self.world == 1:
            assert objs is not None
            return objs[0]
        box: list[Any] = [None]
        dist.scatter_object_list(box, objs, group=self.group, group_src=0)
        return box[0]

    def settle(self, mine: BaseException | None, what: str) -> None:
        """Collective: return on every rank if no rank failed (one all-reduce of one integer);
        else raise every rank's failure on every rank (:meth:`raise_everyones`)."""
        if self.max([mine is not None])[0]:
            self.raise_everyones(mine, what)

    def raise_everyones(self, mine: BaseException | None, what: str) -> None:
        """Collective, on a path where some rank failed: raise every rank's failure on every
        rank (as torch's ``CheckpointException``, as ``dcp.save`` would)."""
        mine_wrapped: Any = wrapped(mine)
        everyone: list[Any] = [mine_wrapped] if self.world == 1 else [None] * self.world
        if self.world > 1:
            dist.all_gather_object(everyone, mine_wrapped, group=self.group)
        raise_failures({rank: failure for rank, failure in enumerate(everyone) if failure is not None}, what)


def wrapped(exc: BaseException | None) -> tuple | None:
    """A rank's failure as torch's ``CheckpointException`` carries it (picklable)."""
    return None if exc is None else (exc, traceback.extract_tb(exc.__traceback__))


def raise_failures(failures: dict[int, tuple], what: str) -> None:
    """Raise torch's ``CheckpointException`` of ``failures`` (rank: wrapped), if any; dmuon's
    doors turn it into a :class:`~.errors.CheckpointError` (``operation.run_checkpoint_op``)."""
    if failures:
        raise CheckpointException(what, failures)
