"""The transport over a torch process group, and over a single process without one.

:class:`GroupTransport` runs the rounds of ``transport.py`` as torch's collectives over one
group (the default group for a checkpointer's save or load; an async checkpointer's own gloo
group; the tiers' two groups). Inside an operation (a save, a load), a collective that the
backend breaks because a rank stopped (gloo's ``Connection reset by peer``) is raised as
:class:`~.rank_failure.RankStoppedError` naming the ranks that did not answer a roll call and
the phase this rank was in; the roll call is keyed by the group and its own collective count,
the same on every rank of the group whatever thread runs it.

:func:`transport_over` picks one: a process group of more than one rank, or a single process.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from .errors import CheckpointError
from .rank_failure import RollCall, explain_failure
from .transport import Transport

__all__ = ["GroupTransport", "SingleProcess", "exchange_device", "transport_over"]


def exchange_device(group: Any) -> torch.device:
    """Where tensors a collective moves must live for the group's backend (NCCL: the current
    GPU; else the CPU)."""
    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class GroupTransport(Transport):
    """The rounds over ``group`` (None: the default group), every rank of it a member."""

    def __init__(self, group: Any = None, *, spans_operation: bool = True) -> None:
        """``spans_operation=False``: a group of some of the operation's ranks (its errors
        are not yet known to the others: ``Transport.spans_operation``)."""
        super().__init__()
        self.group = group
        self.spans_operation = spans_operation
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self._roll_call: RollCall | None = None

    def _job_rank(self, rank: int) -> int:
        if self.spans_operation or self.group is None:
            return rank
        return dist.get_global_rank(self.group, rank)

    def replicas(self, layout: Any) -> Transport:
        return GroupTransport(layout.mesh.get_group(layout.dim), spans_operation=False)

    @contextlib.contextmanager
    def _watching(self) -> Iterator[None]:
        self._roll_call = RollCall(self.group)
        try:
            yield
        finally:
            self._roll_call.close()
            self._roll_call = None

    def _call(self, collective: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        try:
            return collective(*args, **kwargs)
        except RuntimeError as exc:
            roll_call, phases = self._roll_call, self.phases
            if roll_call is None or phases is None or isinstance(exc, CheckpointError):
                raise
            explained = explain_failure(exc, roll_call, self.title, phases.now, self.consequence)
            if explained is None:
                raise
            raise explained from exc

    def _max(self, values: list[float], floating: bool) -> list[float]:
        dtype = torch.float64 if floating else torch.int64
        tensor = torch.tensor(values, dtype=dtype, device=exchange_device(self.group))
        self._call(dist.all_reduce, tensor, op=dist.ReduceOp.MAX, group=self.group)
        return tensor.tolist()

    def _gather(self, obj: Any) -> list[Any] | None:
        out: list[Any] | None = [None] * self.world if self.coordinator else None
        self._call(dist.gather_object, obj, out, group=self.group, group_dst=0)
        return out

    def _scatter(self, objs: list[Any] | None) -> Any:
        box: list[Any] = [None]
        self._call(dist.scatter_object_list, box, objs, group=self.group, group_src=0)
        return box[0]

    def _all_gather(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.world
        self._call(dist.all_gather_object, out, obj, group=self.group)
        return out

    def _broadcast(self, obj: Any, src: int) -> Any:
        box = [obj if self.rank == src else None]
        self._call(dist.broadcast_object_list, box, group=self.group, group_src=src)
        return box[0]

    def barrier(self) -> None:
        self._call(dist.barrier, group=self.group)


class SingleProcess(Transport):
    """One process and no process group: every round is this rank's own."""

    def _max(self, values: list[float], floating: bool) -> list[float]:
        return list(values)

    def _gather(self, obj: Any) -> list[Any] | None:
        return [obj]

    def _scatter(self, objs: list[Any] | None) -> Any:
        assert objs is not None
        return objs[0]

    def _all_gather(self, obj: Any) -> list[Any]:
        return [obj]

    def _broadcast(self, obj: Any, src: int) -> Any:
        return obj

    def barrier(self) -> None:
        pass


def transport_over(group: Any = None) -> Transport:
    """The transport of ``group`` (None: the default group), or of this process alone where
    there is no process group or it has one rank."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        return GroupTransport(group)
    return SingleProcess()
