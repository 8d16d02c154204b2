"""``DMuonSavePlanner``: torch's default save planner, plus the checks a dedicated tensor needs.

Dedicated tensors reach the planner as plain full tensors on the ranks that hold them and
absent elsewhere (``model.state_dict()`` and ``AppState`` both show them so), so DCP's own
machinery plans them correctly. What this planner adds:

* where it knows which keys are dedicated -- an ``AppState``'s :class:`DedicatedLayout` in the
  state it is given, or the models its caller names (``models=``) -- it refuses, before
  anything is written, an entry of the wrong shape under such a key (a 0-element copy of a
  placeholder would otherwise be saved as the weight), has the global owner write each
  dedicated tensor (HSDP replicas hold copies), and checks that the global plan contains
  exactly one whole write of it;
* whatever it knows, the global plan must not hold two chunks of one key at one offset with
  different sizes (a placeholder offered beside the weight);
* a chunk of a DTensor replicated over a mesh dimension (HSDP) is planned by one replica only,
  chosen on every rank alike (:func:`_written_by_another_replica`), instead of by every replica
  for the coordinator to de-duplicate;
* dmuon's description of the save (version, topology, owners, writers, aliases) goes into the
  metadata under ``format.layout.RESERVED_KEY``.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import math
import zlib
from collections import ChainMap, defaultdict
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, WriteItem

from .. import __version__, compat
from ..dedicated_state_dict import dedicated_value_problem
from ..topology import current_rank
from .app_state import collect_layout
from .errors import SaveRefusedError
from .format.layout import FORMAT_VERSION, MODEL_PREFIX, RESERVED_KEY
from .plan_cache import SavePlanCache


def merge_key_orders(orders: list[list[str]]) -> list[str]:
    """One key order that keeps every rank's own order (each rank lacks the dedicated keys
    held elsewhere): a topological merge, ties broken by first appearance."""
    successors: dict[str, set[str]] = defaultdict(set)
    indegree: dict[str, int] = defaultdict(int)
    first_seen: dict[str, int] = {}
    for order in orders:
        for key in order:
            first_seen.setdefault(key, len(first_seen))
        for before, after in itertools.pairwise(order):
            if after not in successors[before]:
                successors[before].add(after)
                indegree[after] += 1
    ready = [(first_seen[k], k) for k in first_seen if indegree[k] == 0]
    heapq.heapify(ready)
    merged = []
    while ready:
        _, key = heapq.heappop(ready)
        merged.append(key)
        for after in successors.get(key, ()):
            indegree[after] -= 1
            if indegree[after] == 0:
                heapq.heappush(ready, (first_seen[after], after))
    if len(merged) != len(first_seen):  # contradictory orders: keep what is left as first seen
        done = set(merged)
        merged += sorted((k for k in first_seen if k not in done), key=first_seen.__getitem__)
    return merged


def _written_by_another_replica(item: WriteItem, value: Any) -> bool:
    """Is ``item`` a chunk of a DTensor that another replica of this rank writes?

    A DTensor replicated over a mesh dimension (HSDP's replicate dimension) has the same chunk
    on every rank along it. torch's planner has each of them offer it and the coordinator
    de-duplicates: the gathered plans, and the coordinator's work, grow with the replicas
    (with 8-way shards on 16,384 ranks, 2,048 copies of every chunk). The mesh already says
    who holds the copies, so each rank decides alone, and every rank alike: along each
    replicated dimension the copy at coordinate ``crc32(key, offsets) % size`` writes it
    (chunks spread over the replicas). Plain tensors and objects are left to the coordinator:
    nothing guarantees that every rank holds them."""
    mesh, placements = getattr(value, "device_mesh", None), getattr(value, "placements", None)
    if not isinstance(value, torch.Tensor) or mesh is None or placements is None:  # (a DTensor, or one's stand-in)
        return False
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        return False
    for dim, placement in enumerate(placements):
        size = mesh.size(dim)
        if placement.is_replicate() and size > 1:
            key = f"{item.index.fqn}@{tuple(item.index.offset or ())}".encode()
            if coordinate[dim] != zlib.crc32(key) % size:
                return True
    return False


# A tensor held alike by several ranks, above this size, is written by one of them chosen by a
# hash of its key (the writes spread); below it, by the lowest holder (one file: see
# ``DMuonSavePlanner._plans_alike_key``).
SPREAD_ALIKE_BYTES = 1 << 20


def _chunk_key(item: WriteItem) -> tuple:
    return (item.index.fqn, tuple(item.index.offset or ()))


def _small_duplicates_to_lowest_rank(all_plans: list[SavePlan]) -> list[SavePlan]:
    """An object or a small whole tensor that several ranks offer (an ``extra`` entry, a state
    this planner was not told is held alike) is kept in the lowest of their plans; torch's
    de-duplication, left to it, spreads such items over the ranks' files, and every rank
    then reads one file per item at a load (``DMuonSavePlanner._plans_alike_key``)."""
    first: dict[MetadataIndex, int] = {}  # such an item's lowest offering rank
    offered_again = [False] * len(all_plans)  # (each item tested once: a first save plans N x keys)
    for rank, plan in enumerate(all_plans):
        for item in plan.items:
            if read_by_every_rank(item) and first.setdefault(item.index, rank) != rank:
                offered_again[rank] = True
    return [
        dataclasses.replace(plan, items=[item for item in plan.items if first.get(item.index, rank) == rank])
        if again
        else plan
        for rank, (plan, again) in enumerate(zip(all_plans, offered_again))
    ]


def read_by_every_rank(item: WriteItem) -> bool:
    """An object, or a whole tensor of at most :data:`SPREAD_ALIKE_BYTES`: what every rank of
    a job typically reads at a load (hyper-parameters, step counts, ``extra``). This planner
    has one rank write all of these (:func:`_small_duplicates_to_lowest_rank`), and the writer
    puts them at the head of its file (``writer.write_order``)."""
    data = item.tensor_data
    if data is None:
        return True  # an object
    if tuple(data.chunk.sizes) != tuple(data.size):
        return False
    return math.prod(data.size) * data.properties.dtype.itemsize <= SPREAD_ALIKE_BYTES


class DMuonSavePlanner(DefaultSavePlanner):
    """torch's default save planner, plus the checks of dedicated tensors (module docstring).

    Args:
        dedup_save_to_lowest_rank: as torch's: a tensor several ranks offer is written by the
            lowest of them (otherwise DCP spreads such writes over the ranks).
        plan_cache: a :class:`SavePlanCache` kept across saves (one per rank, each rank's seeing
            the same saves) lets a save whose layout did not change skip sending, merging and
            checking plans (``plan_cache.py``). torch's own ``enable_plan_caching`` is not
            offered: it reuses the previous save's storage data, where dmuon's writer names
            each save's files afresh.
        models: for a plain state dict, where in it a dmuon model's ``state_dict()`` lies:
            ``{"model": model}`` for ``{"model": model.state_dict(), ...}``, ``{"": model}``
            for ``model.state_dict()`` itself. Its dedicated keys are then checked as an
            ``AppState``'s are. An ``AppState`` brings its own layout and needs none.
    """

    def __init__(
        self,
        dedup_save_to_lowest_rank: bool = False,
        plan_cache: SavePlanCache | None = None,
        *,
        models: Mapping[str, nn.Module] | None = None,
    ) -> None:
        super().__init__(
            flatten_state_dict=True,
            flatten_sharded_tensors=True,
            dedup_save_to_lowest_rank=dedup_save_to_lowest_rank,
            enable_plan_caching=False,
        )
        self.plan_cache = plan_cache
        self.models = dict(models or {})

    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator: bool = False) -> None:
        layout, layout_keys = collect_layout(state_dict, self.models)
        super().set_up_planner(state_dict, storage_meta, is_coordinator)
        flat = compat.planner_flat_state(self)
        compat.set_planner_flat_state(self, {k: v for k, v in flat.items() if k not in layout_keys})
        mappings = compat.planner_mappings(self)  # (the plan carries them to the metadata)
        for key in layout_keys:
            mappings.pop(key, None)
        self.layout, self.topology, self.key_order = layout.entries, layout.topology, layout.order
        self.everywhere = layout.everywhere
        self.everywhere_prefixes = tuple((p, ranks) for p, ranks in layout.everywhere.items() if p.endswith("."))
        self.rank = current_rank()
        self._local_plan: SavePlan | None = None

    def _everywhere(self, key: str) -> bool:
        return key in self.everywhere or any(key.startswith(prefix) for prefix, _ in self.everywhere_prefixes)

    def _plans_alike_key(self, key: str, value: Any, world: int) -> bool:
        """Does this rank plan ``key``, which the ranks holding it hold alike? One of them does,
        chosen on every rank alike: the lowest holder for an object or a small tensor, a hash
        of the key for a large tensor (so that their writes spread over the holders).

        Every holder reads every such key at a load. Spread over the ranks' files, the small
        ones (step counts, hyper-parameters) made each rank open one file per key -- on object
        storage a request for the file's checksums and one per item, in every rank's load, so
        N x keys requests for the job. Kept in one file (at its head: the writer's order),
        they are two ranged reads per rank."""
        if key in self.everywhere:
            holders = self.everywhere[key]
        else:
            holders = next(ranks for prefix, ranks in self.everywhere_prefixes if key.startswith(prefix))
        if not (isinstance(value, torch.Tensor) and value.numel() * value.element_size() > SPREAD_ALIKE_BYTES):
            return (min(holders) if holders else 0) == self.rank
        choice = zlib.crc32(key.encode())
        return (holders[choice % len(holders)] if holders else choice % world) == self.rank

    def _local_problems(self, state: dict[str, Any]) -> list[str]:
        """Dedicated keys holding the wrong thing, or missing on the rank that must write them."""
        problems = []
        for key, value in state.items():
            entry = self.layout.get(key)
            problem = dedicated_value_problem(entry.shape, value) if entry is not None else None
            if problem is not None:
                problems.append(f"rank {self.rank}: {key!r} is {problem}")
        for key, entry in self.layout.items():
            if entry.writer == self.rank and key not in state:
                problems.append(f"rank {self.rank} must write dedicated tensor {key!r} but its state dict lacks it")
        return problems

    def create_local_plan(self) -> SavePlan:
        everything = compat.planner_flat_state(self)
        problems = self._local_problems(everything)
        if problems:
            raise SaveRefusedError(problems)
        # HSDP replicas hold copies of a dedicated weight: only its writer plans it; a key every
        # rank holds alike (an AppState says which), one rank plans
        world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
        mine = {
            k: v
            for k, v in everything.items()
            if (k not in self.layout or self.layout[k].writer == self.rank)
            and (world == 1 or not self._everywhere(k) or self._plans_alike_key(k, v, world))
        }
        self._held_everywhere = [k for k in everything if self._everywhere(k)]
        compat.set_planner_flat_state(self, mine)
        try:
            plan = super().create_local_plan()
        finally:
            compat.set_planner_flat_state(self, everything)
        items = [item for item in plan.items if not _written_by_another_replica(item, everything.get(item.index.fqn))]
        # torch's planner attaches the flattening of every key of this rank's dict; the metadata
        # needs those of the keys written, each from any rank that writes it: the coordinator
        # then gathers one copy of each, not one per rank
        written = {item.index.fqn for item in items}
        mappings = plan.planner_data
        if isinstance(mappings, dict):
            mappings = {key: path for key, path in mappings.items() if key in written}
        plan = self._local_plan = dataclasses.replace(plan, items=items, planner_data=mappings)
        return self.plan_cache.offer_local(plan) if self.plan_cache is not None else plan

    def _check(self, all_plans: list[SavePlan]) -> None:
        problems = []
        planned = {item.index.fqn for plan in all_plans for item in plan.items}
        for key in getattr(self, "_held_everywhere", ()):
            if key not in planned:  # (its rank is not in this save's group: refused, not lost)
                problems.append(
                    f"{key}: held alike by several ranks but planned by none (a process group that is "
                    "not the whole job? dmuon's planners save over the default group)"
                )
        writers: dict[str, list[tuple[int, WriteItem]]] = defaultdict(list)
        seen: dict[tuple, tuple[int, tuple]] = {}
        for rank, plan in enumerate(all_plans):
            for item in plan.items:
                if item.index.fqn in self.layout:
                    writers[item.index.fqn].append((rank, item))
                    continue
                if item.tensor_data is None:
                    continue
                key, sizes = _chunk_key(item), tuple(item.tensor_data.chunk.sizes)
                if key in seen and seen[key][1] != sizes:
                    problems.append(
                        f"{key[0]}: rank {seen[key][0]} saves a chunk of {seen[key][1]} and rank {rank} "
                        f"one of {sizes} at the same offset (an empty placeholder?)"
                    )
                seen.setdefault(key, (rank, sizes))
        for fqn, entry in self.layout.items():
            got = writers.get(fqn, [])
            ranks = [rank for rank, _ in got]
            if len(got) != 1:
                problems.append(f"{fqn}: written by ranks {ranks}, expected exactly one (rank {entry.writer})")
                continue
            rank, item = got[0]
            if item.tensor_data is None:
                problems.append(f"{fqn}: rank {rank} writes it as an object, not a tensor")
                continue
            chunk = item.tensor_data.chunk
            if rank != entry.writer or any(chunk.offsets) or tuple(chunk.sizes) != tuple(entry.shape):
                problems.append(
                    f"{fqn}: rank {rank} writes offsets {tuple(chunk.offsets)} sizes {tuple(chunk.sizes)}, "
                    f"expected rank {entry.writer} to write the whole {tuple(entry.shape)}"
                )
        if problems:
            raise SaveRefusedError(["invalid global save plan:"] + problems)

    def describe(self) -> dict[str, Any]:
        topology = self.topology if self.layout else None
        return {
            "format": FORMAT_VERSION,
            "dmuon_version": __version__,
            "torch_version": str(torch.__version__),
            "world_size": torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1,
            "topology": {"replicate": topology[0], "shard": topology[1]} if topology else None,
            "owners": {fqn: list(e.owner) for fqn, e in self.layout.items() if fqn.startswith(MODEL_PREFIX)},
            "writers": {fqn: e.writer for fqn, e in self.layout.items()},
            "aliases": {
                alias: fqn[len(MODEL_PREFIX) :]
                for fqn, e in self.layout.items()
                if fqn.startswith(MODEL_PREFIX)
                for alias in e.aliases
            },
        }

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        cache = self.plan_cache
        if cache is not None:
            reused = cache.reuse_global(all_plans)  # no rank's plan changed: all checked before
            if reused is not None:
                return reused
            all_plans = cache.fill_in(all_plans)
        self._check(all_plans)
        plans, metadata = super().create_global_plan(_small_duplicates_to_lowest_rank(all_plans))
        mappings = [p.planner_data for p in plans if p.planner_data]
        lookup = ChainMap(*mappings)
        # no rank's dict has every key: merge their orders, the model's own order first
        order = merge_key_orders([self.key_order] + [list(m) for m in mappings])
        planner_data = {key: lookup[key] for key in order if key in lookup}
        planner_data[RESERVED_KEY] = self.describe()
        metadata = dataclasses.replace(metadata, planner_data=planner_data)
        if cache is not None:
            return cache.remember_global(all_plans, plans, metadata), metadata
        return plans, metadata

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        if self.plan_cache is not None:
            if self._local_plan is None:
                raise RuntimeError("finish_plan before create_local_plan")
            new_plan = self.plan_cache.finish(self._local_plan, new_plan)
        return super().finish_plan(new_plan)


__all__ = ["DMuonSavePlanner", "merge_key_orders", "read_by_every_rank"]
