"""N ranks of a job's checkpoint code in one process: dmuon's own rounds over a simulated
:class:`Transport`, torch's ``dcp.save``/``dcp.load`` over simulated object collectives.

Every synthetic rank runs dmuon's code as it is in the tree (``run_save``, ``run_load``,
``open_once``: whatever a :class:`Checkpointer` runs) in a greenlet of its own, over a
:class:`SimulatedTransport`, a dmuon ``Transport`` whose primitives hand each collective to the
:class:`SimulatedWorld`. The world runs the ranks one at a time, in rank order, each until it
reaches a collective (or ends); once every rank is at the same collective, it combines what
they offered as torch's collectives would (an all-reduce's maximum; objects pickled by their
senders and unpickled by their receivers), records what moved (:class:`Call`: the pickled size
of each rank's object, an all-reduce's tensor bytes), and resumes them. Ranks running one at
a time, the CPU seconds between a rank's switches are its own: each rank's CPU is measured,
pickling and unpickling included, for the rank that does it.

An object that many ranks receive (a broadcast, an all-gather) is unpickled once and the copy
shared by its receivers, each charged the unpickling's CPU seconds: what it costs each of them,
without N copies of a large listing in this process's memory.

``torch.distributed`` answers ``is_initialized``/``get_rank``/``get_world_size`` for the rank
running (dmuon's planners ask), and its object collectives and barrier (torch's DCP protocol,
``_DistWrapper``, uses those alone) are collectives of the world too; any other collective
raises :class:`SimulatorGap`, so none is ever left uncounted. Nothing of either protocol is
written here: the decisions (steady or not, gather or not) are the code's own, on every rank.
"""

from __future__ import annotations

import contextlib
import pickle
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist
from greenlet import greenlet
from scale_sim_state import Call

from dmuon.dcp.transport import Transport


class SimulatorGap(RuntimeError):
    """The code under test called a collective the simulator does not model, or the ranks did
    not all reach the same collective (a real job would hang there)."""


@dataclass
class _Request:
    """What a rank asks of the world at a collective."""

    kind: str  # all_reduce, gather, scatter, all_gather, broadcast, barrier
    payload: Any = None
    src: int = 0
    group: tuple[int, ...] | None = None  # the ranks of a replica group (all_reduce, all_gather)


@dataclass
class Outcome:
    """One rank's run: what it returned, or raised; its CPU seconds."""

    value: Any = None
    error: BaseException | None = None
    cpu: float = 0.0


@dataclass
class Phase:
    """One operation of N ranks: its collectives, each rank's CPU seconds, files touched."""

    calls: list[Call] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)
    small_files: dict[str, int] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)


class SimulatedWorld:
    """The N ranks of one simulated job (see the module docstring)."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.rank = 0  # the rank running now
        self.calls: list[Call] = []
        self._cpu: list[float] = [0.0] * world

    # -- running ranks ---------------------------------------------------------------------------
    def run(self, body: Callable[[int, SimulatedTransport], Any]) -> list[Outcome]:
        """``body(rank, transport)`` on every rank, as SPMD code runs; every rank's outcome (the
        collectives it made are in :attr:`calls`)."""
        self._cpu = [0.0] * self.world
        self.calls = []
        outcomes = [Outcome() for _ in range(self.world)]

        def start(rank: int) -> Callable[[], Any]:
            def main(*_: Any) -> None:  # (the first switch's answer: None)
                try:
                    outcomes[rank].value = body(rank, SimulatedTransport(self, rank))
                except Exception as exc:  # (a failure every rank raises alike is an outcome)
                    outcomes[rank].error = exc

            return main

        ranks = [greenlet(start(rank)) for rank in range(self.world)]
        answers: list[Any] = [None] * self.world
        with self.installed():
            while True:
                requests: list[_Request | None] = []
                for rank, runner in enumerate(ranks):
                    if runner.dead:
                        requests.append(None)
                        continue
                    self.rank = rank
                    began = time.process_time()
                    asked = runner.switch(answers[rank])
                    self._cpu[rank] += time.process_time() - began
                    requests.append(None if runner.dead else asked)
                if all(request is None for request in requests):
                    break
                answers = self._combine(requests)
        for rank, outcome in enumerate(outcomes):
            outcome.cpu = self._cpu[rank]
        return outcomes

    def _combine(self, requests: list[_Request | None]) -> list[Any]:
        kinds = {request.kind if request is not None else "(ended)" for request in requests}
        if len(kinds) != 1:
            raise SimulatorGap(f"the ranks are in different collectives: {sorted(kinds)}")
        kind = kinds.pop()
        groups = {request.group for request in requests if request is not None}
        if groups != {None}:
            return self._combine_in_groups(kind, requests)
        offered = [request.payload for request in requests if request is not None]
        if kind == "all_reduce":
            self.calls.append(Call("all_reduce", [8 * len(offered[0])]))
            top = [max(values) for values in zip(*offered, strict=True)]
            return [list(top) for _ in range(self.world)]
        if kind == "barrier":
            return [None] * self.world
        if kind in ("gather", "all_gather"):
            blobs = [self._pickled(rank, obj) for rank, obj in enumerate(offered)]
            self.calls.append(Call(kind, [len(blob) for blob in blobs]))
            if kind == "gather":  # the coordinator unpickles each
                return [[self._unpickled(0, blob) for blob in blobs]] + [None] * (self.world - 1)
            shared = [self._unpickled_by_all(blob) for blob in blobs]
            return [shared] * self.world
        if kind == "scatter":
            blobs = [self._pickled(0, obj) for obj in offered[0]]
            self.calls.append(Call("scatter", [len(blob) for blob in blobs]))
            return [self._unpickled(rank, blob) for rank, blob in enumerate(blobs)]
        if kind == "broadcast":
            src = requests[0].src if requests[0] is not None else 0
            blob = self._pickled(src, offered[src])
            self.calls.append(Call("broadcast", [len(blob)]))
            copy = self._unpickled_by_all(blob, but=src)
            return [offered[src] if rank == src else copy for rank in range(self.world)]
        raise SimulatorGap(f"no such collective: {kind}")

    def _combine_in_groups(self, kind: str, requests: list[_Request | None]) -> list[Any]:
        """A collective every rank runs within its own group (a cooperative load's replicas):
        the groups must cover the world, each rank in one."""
        groups = sorted({request.group for request in requests if request is not None and request.group is not None})
        if None in {request.group for request in requests if request is not None} or sorted(
            rank for group in groups for rank in group
        ) != list(range(self.world)):
            raise SimulatorGap(f"a {kind} in groups that do not split the world: {groups[:4]}...")
        answers: list[Any] = [None] * self.world
        if kind == "all_reduce":
            self.calls.append(Call("all_reduce", [8 * len(requests[0].payload)]))  # type: ignore[union-attr]
            for group in groups:
                top = [max(values) for values in zip(*(requests[rank].payload for rank in group), strict=True)]  # type: ignore[union-attr]
                for rank in group:
                    answers[rank] = list(top)
            return answers
        if kind == "all_gather":
            blobs = [self._pickled(rank, request.payload) for rank, request in enumerate(requests)]  # type: ignore[union-attr]
            self.calls.append(Call("all_gather", [len(blob) for blob in blobs], groups=list(groups)))
            for group in groups:
                shared = [self._unpickled_by(blobs[rank], group) for rank in group]
                for rank in group:
                    answers[rank] = shared
            return answers
        raise SimulatorGap(f"no {kind} within groups is modelled")

    def _unpickled_by(self, blob: bytes, ranks: tuple[int, ...]) -> Any:
        """One copy for ``ranks``, each charged its unpickling."""
        began = time.process_time()
        obj = pickle.loads(blob)
        spent = time.process_time() - began
        for rank in ranks:
            self._cpu[rank] += spent
        return obj

    def _pickled(self, rank: int, obj: Any) -> bytes:
        began = time.process_time()
        blob = pickle.dumps(obj)
        self._cpu[rank] += time.process_time() - began
        return blob

    def _unpickled(self, rank: int, blob: bytes) -> Any:
        began = time.process_time()
        obj = pickle.loads(blob)
        self._cpu[rank] += time.process_time() - began
        return obj

    def _unpickled_by_all(self, blob: bytes, but: int = -1) -> Any:
        """One copy for every receiver, each charged its unpickling (module docstring)."""
        began = time.process_time()
        obj = pickle.loads(blob)
        spent = time.process_time() - began
        for rank in range(self.world):
            if rank != but:
                self._cpu[rank] += spent
        return obj

    # -- what a rank's code sees -----------------------------------------------------------------
    def charge(self, seconds: float) -> None:
        """On a rank: CPU seconds it would have spent on work done once for all (a shared copy)."""
        self._cpu[self.rank] += seconds

    @contextlib.contextmanager
    def untimed(self) -> Iterator[None]:
        """On a rank: work of the simulation itself (building its synthetic state), not counted
        in the rank's CPU seconds."""
        began = time.process_time()
        try:
            yield
        finally:
            self._cpu[self.rank] -= time.process_time() - began

    def ask(self, request: _Request) -> Any:
        """Called on a rank's greenlet: wait for the collective's outcome."""
        parent = greenlet.getcurrent().parent
        assert parent is not None
        return parent.switch(request)

    @contextlib.contextmanager
    def installed(self) -> Iterator[SimulatedWorld]:
        """``torch.distributed`` as the running rank sees it."""
        names: dict[str, Any] = {"is_initialized": lambda: True, "get_rank": lambda group=None: self.rank,
                                 "get_world_size": lambda group=None: self.world,
                                 "get_backend": lambda group=None: "gloo"}
        for name in ("all_gather", "all_reduce", "broadcast", "gather", "scatter", "new_group"):
            names[name] = _gap(name)
        names.update(self._object_collectives())
        saved = {name: getattr(dist, name) for name in names}
        for name, fn in names.items():
            setattr(dist, name, fn)
        try:
            yield self
        finally:
            for name, fn in saved.items():
                setattr(dist, name, fn)


    def _object_collectives(self) -> dict[str, Callable[..., Any]]:
        """torch's object collectives (what torch's DCP calls), as collectives of the world."""

        def gather_object(obj: Any, object_gather_list: list | None = None, *args: Any, **kwargs: Any) -> None:
            everyone = self.ask(_Request("gather", obj))
            if object_gather_list is not None:
                object_gather_list[:] = everyone

        def scatter_object_list(
            scatter_object_output_list: list, scatter_object_input_list: list | None = None, *args: Any, **kwargs: Any
        ) -> None:
            scatter_object_output_list[0] = self.ask(_Request("scatter", scatter_object_input_list))

        def all_gather_object(object_list: list, obj: Any, *args: Any, **kwargs: Any) -> None:
            object_list[:] = self.ask(_Request("all_gather", obj))

        def broadcast_object_list(object_list: list, src: int | None = None, *args: Any, **kwargs: Any) -> None:
            source = kwargs.get("group_src", src) or 0
            (obj,) = object_list  # (torch's DCP broadcasts one object at a time)
            object_list[:] = [self.ask(_Request("broadcast", obj, source))]

        def barrier(*args: Any, **kwargs: Any) -> None:
            self.ask(_Request("barrier"))

        return {"gather_object": gather_object, "scatter_object_list": scatter_object_list,
                "all_gather_object": all_gather_object, "broadcast_object_list": broadcast_object_list,
                "barrier": barrier}


def _gap(name: str) -> Callable[..., Any]:
    def called(*args: Any, **kwargs: Any) -> Any:
        raise SimulatorGap(f"the code under test called torch.distributed.{name} directly, which the scale "
                           "simulator does not model (dmuon's rounds go through a Transport)")
    return called


class SimulatedTransport(Transport):
    """One synthetic rank's transport: each primitive is a collective of the world."""

    def __init__(self, world: SimulatedWorld, rank: int) -> None:
        super().__init__()
        self.sim, self.rank, self.world = world, rank, world.world

    def _max(self, values: list[float], floating: bool) -> list[float]:
        return self.sim.ask(_Request("all_reduce", list(values)))

    def _gather(self, obj: Any) -> list[Any] | None:
        return self.sim.ask(_Request("gather", obj))

    def _scatter(self, objs: list[Any] | None) -> Any:
        return self.sim.ask(_Request("scatter", objs))

    def _all_gather(self, obj: Any) -> list[Any]:
        return self.sim.ask(_Request("all_gather", obj))

    def _broadcast(self, obj: Any, src: int) -> Any:
        return self.sim.ask(_Request("broadcast", obj, src))

    def barrier(self) -> None:
        self.sim.ask(_Request("barrier"))

    def replicas(self, layout: Any) -> Transport:
        """The ranks along the replicate dimension of the stand-ins' mesh (``StubMesh``:
        global rank = replica x shards + shard)."""
        if layout.dim != 0:
            raise SimulatorGap(f"replicas along mesh dimension {layout.dim}: only the first is modelled")
        replica, shard = layout.mesh.get_coordinate()
        replicas, shards = layout.mesh.size(0), layout.mesh.size(1)
        return SimulatedReplicas(self.sim, tuple(r * shards + shard for r in range(replicas)), replica)


class SimulatedReplicas(Transport):
    """One synthetic rank's transport over its replica group (``Transport.replicas``)."""

    spans_operation = False

    def __init__(self, world: SimulatedWorld, members: tuple[int, ...], rank: int) -> None:
        super().__init__()
        self.sim, self.members, self.rank, self.world = world, members, rank, len(members)

    def _job_rank(self, rank: int) -> int:
        return self.members[rank]

    def _max(self, values: list[float], floating: bool) -> list[float]:
        return self.sim.ask(_Request("all_reduce", list(values), group=self.members))

    def _all_gather(self, obj: Any) -> list[Any]:
        return self.sim.ask(_Request("all_gather", obj, group=self.members))
