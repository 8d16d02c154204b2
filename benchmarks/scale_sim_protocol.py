"""The scale simulator's engine: torch DCP's save and load protocols run in one process for N
synthetic ranks, through torch's planners, writers and readers as they are in the tree (dmuon's
own protocols, which its Checkpointer now drives instead of ``dcp.save``/``dcp.load``, are in
``scale_sim_dmuon.py`` and use the pieces here: :class:`SimulatedWorld`, :class:`Phase`,
:func:`dmuon_results`).

Every step ``torch.distributed.checkpoint.save``/``load`` (torch 2.13: ``_save_state_dict``,
``_load_state_dict``, ``_DistWrapper``) runs on a rank runs here for each synthetic rank in
turn, with ``torch.distributed`` answering ``is_initialized``/``get_rank``/``get_world_size`` for
that rank. Where DCP moves an object between ranks, it is pickled here (its size recorded as a
:class:`Call`) and unpickled on the receiving side, so the coordinator works on copies, as a
real one does. A ``broadcast_object_list`` that dmuon's code calls on its source rank is
recorded (``SimulatedWorld.calls``; the other ranks are given the same object by the caller);
any other ``torch.distributed`` collective it calls raises :class:`SimulatorGap`: a new
collective is never silently left uncounted.

What cannot run without tensor data, the writing itself, is replaced by the write results it
would return (:func:`dmuon_results`, :func:`torch_results`, mirroring ``writer.py`` and torch's
``FileSystemWriter``).
"""

from __future__ import annotations

import contextlib
import pickle
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from scale_sim_state import Call, pickled_size
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from dmuon import compat
from dmuon.dcp.format.checksums import WRITE_CHECKSUM
from dmuon.dcp.format.file_sums import encode_file_sums
from dmuon.dcp.format.manifest import FileStats, ItemChecksums, block_size_for
from dmuon.dcp.writer import FILE_STATS_KEY

# bytes around a tensor's data in a data file (torch.save framing); and a pickled object's size
TENSOR_HEAD, TENSOR_TAIL, OBJECT_BYTES = 128, 30, 400


class SimulatorGap(RuntimeError):
    """The code under test called a collective the simulator does not model."""


class SimulatedWorld:
    """``torch.distributed`` as seen by one synthetic rank at a time (see the module docstring)."""

    def __init__(self, world: int) -> None:
        self.world, self.rank = world, 0
        self.calls: list[Call] = []  # broadcasts the code under test made from the current rank

    def broadcast_object_list(self, object_list: list, src: int | None = None, group: Any = None, **kwargs: Any):
        if (src or 0) != self.rank:
            raise SimulatorGap("broadcast_object_list received on a rank the simulator does not drive")
        self.calls.append(Call("broadcast", [len(pickle.dumps(obj)) for obj in object_list]))

    @contextlib.contextmanager
    def installed(self) -> Iterator[SimulatedWorld]:
        names = {"is_initialized": lambda: True, "get_rank": lambda group=None: self.rank,
                 "get_world_size": lambda group=None: self.world}
        names["broadcast_object_list"] = self.broadcast_object_list
        for name in ("gather_object", "scatter_object_list", "all_gather_object",
                     "all_gather", "all_reduce", "broadcast", "barrier", "gather", "scatter", "new_group"):
            names[name] = _gap(name)
        saved = {name: getattr(dist, name) for name in names}
        for name, fn in names.items():
            setattr(dist, name, fn)
        try:
            yield self
        finally:
            for name, fn in saved.items():
                setattr(dist, name, fn)


def _gap(name: str) -> Callable[..., Any]:
    def called(*args: Any, **kwargs: Any) -> Any:
        raise SimulatorGap(f"the code under test called torch.distributed.{name}, which the scale simulator "
                           "does not model: add it to benchmarks/scale_sim_protocol.py")
    return called


@dataclass
class Phase:
    """One save or load of N ranks: its collectives and the coordinator's CPU seconds."""

    calls: list[Call] = field(default_factory=list)
    rank0_cpu: float = 0.0
    small_files: dict[str, int] = field(default_factory=dict)  # name -> bytes (written or read)
    extra: dict[str, float] = field(default_factory=dict)


def ship(objects: list[Any], kind: str, phase: Phase) -> list[Any]:
    """Objects through an object collective: their pickled sizes recorded, copies returned."""
    blobs = [pickle.dumps(obj) for obj in objects]
    phase.calls.append(Call(kind, [len(b) for b in blobs]))
    return [pickle.loads(b) for b in blobs]


class Timer:
    """CPU seconds of the coordinator's own work, summed into ``phase.rank0_cpu``."""

    def __init__(self, phase: Phase) -> None:
        self.phase = phase

    @contextlib.contextmanager
    def coordinator(self) -> Iterator[None]:
        start = time.process_time()
        try:
            yield
        finally:
            self.phase.rank0_cpu += time.process_time() - start


# ---------------------------------------------------------------------------------------------
# what a rank's write would return
# ---------------------------------------------------------------------------------------------
def _item_bytes(item) -> int:
    if item.type == WriteItemType.BYTE_IO:
        return OBJECT_BYTES
    sizes = item.tensor_data.chunk.sizes
    return int(torch.Size(sizes).numel()) * item.tensor_data.properties.dtype.itemsize


def dmuon_results(rank: int, plan: SavePlan) -> list[WriteResult]:
    """What ``DMuonStorageWriter.write_data`` returns for ``plan`` (manifest version 4): one
    result per item (its file, offset, length) and one ``FILE_STATS_KEY`` result with the
    file's ``FileStats(size, None, sums_at=...)``; the items' checksums go into the file's
    trailer (``format/file_sums.py``, built here with random 64-bit values for its size), not
    to the coordinator."""
    rng = random.Random(rank)
    name = plan.storage_data["file"]
    results, checksums, offset = [], {}, 0
    items = sorted(plan.items, key=lambda item: item.type != WriteItemType.BYTE_IO)
    for item in items:
        data = _item_bytes(item)
        if item.type == WriteItemType.BYTE_IO:
            stats = ItemChecksums.whole(data, rng.getrandbits(64))
        else:
            block = block_size_for(data)
            count = 2 + -(-data // block)
            stats = ItemChecksums(TENSOR_HEAD + data + TENSOR_TAIL, TENSOR_HEAD, block, TENSOR_TAIL,
                                  [rng.getrandbits(64) for _ in range(count)])
        checksums[offset] = stats
        results.append(WriteResult(index=item.index, size_in_bytes=stats.length,
                                   storage_data=compat.StorageInfo(name, offset, stats.length)))
        offset += stats.length
    if plan.items:
        trailer = encode_file_sums(plan.storage_data["save_id"], name, WRITE_CHECKSUM, checksums)
        results.append(WriteResult(index=MetadataIndex(f"{FILE_STATS_KEY}{name}"), size_in_bytes=0,
                                   storage_data=(name, FileStats(offset + len(trailer), None, sums_at=offset))))
    return results


def torch_results(plan: SavePlan) -> list[WriteResult]:
    """What torch's ``FileSystemWriter.write_data`` returns: one file per rank (its default)."""
    name = f"{plan.storage_data.prefix}0.distcp"
    results, offset = [], 0
    for item in plan.items:
        length = _item_bytes(item) + (0 if item.type == WriteItemType.BYTE_IO else 1100)
        results.append(WriteResult(index=item.index, size_in_bytes=length,
                                   storage_data=_StorageInfo(name, offset, length)))
        offset += length
    return results


# ---------------------------------------------------------------------------------------------
# the save protocol (torch 2.13 _save_state_dict with use_collectives=True)
# ---------------------------------------------------------------------------------------------
@dataclass
class SaveSide:
    """How one method saves: a fresh planner and writer per rank and save, the rank's state,
    what its write returns."""

    planner: Callable[[int], Any]
    writer: Callable[[int], Any]
    state: Callable[[int], dict]
    results: Callable[[int, SavePlan], list[WriteResult]]


def simulate_save(world: SimulatedWorld, side: SaveSide) -> tuple[Phase, Any]:
    """One save by every rank; returns the phase and the committed metadata."""
    phase, n = Phase(), world.world
    clock = Timer(phase)
    world.calls = []
    planners, writers, local = [], [], []
    for rank in range(n):  # local_step on every rank
        world.rank = rank
        planner, writer = side.planner(rank), side.writer(rank)
        planner.set_up_planner(state_dict=side.state(rank), storage_meta=writer.storage_meta(),
                               is_coordinator=rank == 0)
        writer.set_up_storage_writer(rank == 0, rank=rank, use_collectives=True)
        local.append(writer.prepare_local_plan(planner.create_local_plan()))
        planners.append(planner)
        writers.append(writer)
    world.rank = 0
    blobs = [pickle.dumps(plan) for plan in local]
    phase.calls.append(Call("gather", [len(b) for b in blobs]))
    del local
    with clock.coordinator():  # global_step on the coordinator, then the scatter's pickling
        gathered = [pickle.loads(b) for b in blobs]
        plans, metadata = planners[0].create_global_plan(gathered)
        plans = writers[0].prepare_global_plan(plans)
        outgoing = [pickle.dumps(plan) for plan in plans]
    del blobs, gathered, plans
    phase.calls.append(Call("scatter", [len(b) for b in outgoing]))
    results = []
    for rank in range(n):  # write_data on every rank
        world.rank = rank
        final = planners[rank].finish_plan(pickle.loads(outgoing[rank]))
        results.append(pickle.dumps(side.results(rank, final)))
    del outgoing
    world.rank = 0
    phase.calls.append(Call("gather", [len(b) for b in results]))
    with clock.coordinator():  # finish_checkpoint, then the broadcast's pickling
        all_results = [pickle.loads(b) for b in results]
        writers[0].finish(metadata=metadata, results=all_results)
        broadcast = pickle.dumps(metadata)
    phase.calls.append(Call("broadcast", [len(broadcast)]))
    phase.calls += world.calls
    return phase, metadata


# ---------------------------------------------------------------------------------------------
# the load protocol (torch 2.13 _load_state_dict)
# ---------------------------------------------------------------------------------------------
@dataclass
class LoadSide:
    """How one method loads: per rank a planner, a reader (its metadata already read), state."""

    planner: Callable[[int], Any]
    reader: Callable[[int], Any]
    state: Callable[[int], dict]
    exchange: Callable[[list[Any]], bool]  # do the final plans make every rank exchange reads?


def local_load_plan(world: SimulatedWorld, side: LoadSide, rank: int, metadata) -> tuple[Any, Any, Any, float]:
    """One rank's local_step of a load: (plan, planner, reader, CPU seconds of planning)."""
    world.rank = rank
    state = side.state(rank)
    start = time.process_time()
    planner, reader = side.planner(rank), side.reader(rank)
    planner.set_up_planner(state, metadata, rank == 0)
    reader.set_up_storage_reader(metadata, rank == 0)
    plan = reader.prepare_local_plan(planner.create_local_plan())
    return plan, planner, reader, time.process_time() - start


def simulate_load(world: SimulatedWorld, side: LoadSide, metadata) -> Phase:
    """One load by every rank (metadata read by each: counted by the caller)."""
    phase, n = Phase(), world.world
    clock = Timer(phase)
    blobs, cpu = [], []
    coordinator = None
    for rank in range(n):
        plan, planner, reader, seconds = local_load_plan(world, side, rank, metadata)
        cpu.append(seconds)
        blobs.append(pickle.dumps(plan))
        if rank == 0:
            coordinator = (planner, reader)
    world.rank = 0
    phase.calls.append(Call("gather", [len(b) for b in blobs]))
    with clock.coordinator():
        gathered = [pickle.loads(b) for b in blobs]
        plans = coordinator[0].create_global_plan(gathered)
        plans = coordinator[1].prepare_global_plan(plans)
        outgoing = [pickle.dumps(plan) for plan in plans]
    phase.calls.append(Call("scatter", [len(b) for b in outgoing]))
    if side.exchange(plans):  # cooperative restore: every rank agrees its reads succeeded
        phase.calls.append(Call("all_gather", [pickled_size(None)] * n))
    phase.calls.append(Call("all_gather", [pickled_size(None)] * n))  # DCP's "read" step
    phase.extra["rank_plan_cpu_max"] = max(cpu)
    phase.extra["rank_plan_cpu_mean"] = sum(cpu) / n
    return phase
