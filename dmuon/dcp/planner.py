"""DCP planners that write each dedicated tensor once, whole, from a rank that holds it.

Dedicated tensors reach the planners as plain full tensors on the ranks that hold them and
absent elsewhere (``model.state_dict()`` and ``AppState`` both show them so), so DCP's own
machinery plans them correctly. What dmuon's planners add:

* they know which keys are dedicated -- from an ``AppState``'s :class:`DedicatedLayout`, or
  for any other state dict from the live models' registries -- and refuse, before anything
  is written, an entry of the wrong shape under such a key (a 0-element copy of a placeholder
  would otherwise be saved as the weight);
* with a layout, the global owner writes each dedicated tensor (HSDP replicas hold copies) and
  the global plan must contain exactly one whole write of it;
* the load planner checks every key's shape and dtype against the checkpoint on every rank and
  reports all mismatches at once, before any tensor is written (DCP casts dtypes silently).
"""

from __future__ import annotations

import dataclasses
import heapq
import io
import itertools
import logging
from collections import ChainMap, defaultdict
from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import (
    DefaultLoadPlanner,
    DefaultSavePlanner,
    create_default_local_load_plan,
)
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, ReadItem, SavePlan, WriteItem

from .. import __version__, compat
from ..dedicated_state_dict import dedicated_value_problem, find_dedicated
from ..optim.muon import SCALAR_DTYPE, STATE_FIELDS, state_field_shape
from ..topology import current_rank
from .app_state import DedicatedEntry, DedicatedLayout
from .errors import CheckpointMismatchError, SaveRefusedError
from .format.layout import FORMAT_VERSION, MODEL_PREFIX, MODEL_SECTION, OPTIM_SECTION, RESERVED_KEY
from .plan_cache import SavePlanCache

log = logging.getLogger(__name__)


def _find_layouts(state_dict: Mapping, prefix: str = "") -> dict[str, DedicatedLayout]:
    """The :class:`DedicatedLayout` entries of a nested state dict, by their flattened key.

    Looked up before torch's planners flatten the dict: their set-up replaces objects they do
    not know (with None, on load).
    """
    found: dict[str, DedicatedLayout] = {}
    for key, value in state_dict.items():
        if isinstance(value, DedicatedLayout):
            found[f"{prefix}{key}"] = value
        elif isinstance(value, Mapping):
            found.update(_find_layouts(value, f"{prefix}{key}."))
    return found


def _take_layouts(flat: dict[str, Any], layouts: dict[str, DedicatedLayout]) -> tuple[dict[str, Any], DedicatedLayout]:
    """Drop the layout entries from a flattened state dict; one layout with absolute keys."""
    layout = DedicatedLayout()
    for key, value in layouts.items():
        prefix = key[: -len(RESERVED_KEY)]
        layout.entries.update({prefix + rel: entry for rel, entry in value.entries.items()})
        layout.order += [prefix + rel for rel in value.order]
        layout.topology = value.topology
    return {k: v for k, v in flat.items() if k not in layouts}, layout


def expected_dedicated(
    key: str, layout: dict[str, DedicatedEntry]
) -> tuple[tuple[int, ...], torch.dtype | None] | None:
    """(shape, dtype or None) a dedicated key must have; None if ``key`` is not dedicated."""
    entry = layout.get(key)
    if entry is not None:
        return entry.shape, entry.dtype
    found = find_dedicated(key)
    if found is None:
        return None
    rec, state_name = found
    if state_name is None:
        return tuple(rec.shape), None
    kinds = {name: kind for fields in STATE_FIELDS.values() for name, kind in fields.items()}
    kind = kinds.get(state_name)
    if kind is None:
        return None
    return state_field_shape(kind, rec.shape), (SCALAR_DTYPE if kind == "scalar" else None)


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


def _chunk_key(item: WriteItem) -> tuple:
    return (item.index.fqn, tuple(item.index.offset or ()))


class DMuonSavePlanner(DefaultSavePlanner):
    """torch's default save planner, plus: wrong entries under dedicated keys are refused
    before anything is written; with an ``AppState`` layout, each dedicated tensor is written
    by its global owner, exactly once, whole; dmuon's description of the save goes into the
    metadata.

    ``plan_cache``: a :class:`SavePlanCache` kept across saves (one per rank, each rank's seeing
    the same saves) lets a save whose layout did not change skip sending, merging and checking
    plans (``plan_cache.py``). torch's own ``enable_plan_caching`` is not offered: it reuses the
    previous save's storage data, where dmuon's writer names each save's files afresh."""

    def __init__(self, dedup_save_to_lowest_rank: bool = False, plan_cache: SavePlanCache | None = None) -> None:
        super().__init__(
            flatten_state_dict=True,
            flatten_sharded_tensors=True,
            dedup_save_to_lowest_rank=dedup_save_to_lowest_rank,
            enable_plan_caching=False,
        )
        self.plan_cache = plan_cache

    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator: bool = False) -> None:
        layouts = _find_layouts(state_dict)
        super().set_up_planner(state_dict, storage_meta, is_coordinator)
        flat, layout = _take_layouts(compat.planner_flat_state(self), layouts)
        compat.set_planner_flat_state(self, flat)
        mappings = compat.planner_mappings(self)  # (the plan carries them to the metadata)
        for key in layouts:
            mappings.pop(key, None)
        self.layout, self.topology, self.key_order = layout.entries, layout.topology, layout.order
        self.rank = current_rank()
        self._local_plan: SavePlan | None = None

    def _local_problems(self, state: dict[str, Any]) -> list[str]:
        """Dedicated keys holding the wrong thing, or missing on the rank that must write them."""
        problems = []
        for key, value in state.items():
            expected = expected_dedicated(key, self.layout)
            if expected is None:
                continue
            problem = dedicated_value_problem(expected[0], value)
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
        # HSDP replicas hold copies of a dedicated weight: only its writer plans it
        mine = {k: v for k, v in everything.items() if k not in self.layout or self.layout[k].writer == self.rank}
        compat.set_planner_flat_state(self, mine)
        try:
            plan = self._local_plan = super().create_local_plan()
        finally:
            compat.set_planner_flat_state(self, everything)
        return self.plan_cache.offer_local(plan) if self.plan_cache is not None else plan

    def _check(self, all_plans: list[SavePlan]) -> None:
        problems = []
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
        plans, metadata = super().create_global_plan(all_plans)
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


def _tensor_spec(value) -> tuple[tuple[int, ...], torch.dtype] | None:
    """(global shape, dtype) of a tensor (DTensor and ShardedTensor included), else None."""
    if isinstance(value, torch.Tensor):
        return tuple(value.shape), value.dtype
    return None


def _describe_dtype(dtype) -> str:
    return str(dtype).replace("torch.", "")


class DMuonLoadPlanner(DefaultLoadPlanner):
    """torch's default load planner, plus: every key's shape and dtype is checked against the
    checkpoint on every rank and all problems are reported at once, before any tensor is
    written; non-tensor entries load with ``weights_only=True``. ``allow_partial_load=True``
    skips (and logs) what does not fit instead."""

    def __init__(self, allow_partial_load: bool = False) -> None:
        super().__init__(flatten_state_dict=True, flatten_sharded_tensors=True, allow_partial_load=allow_partial_load)
        self.partial = allow_partial_load
        self.skipped: list[str] = []

    def set_up_planner(self, state_dict, metadata: Metadata | None = None, is_coordinator: bool = False) -> None:
        layouts = _find_layouts(state_dict)
        super().set_up_planner(state_dict, metadata, is_coordinator)
        self.checkpoint = metadata
        regular, layout_ = _take_layouts(compat.planner_flat_state(self), layouts)
        layout = layout_.entries
        # What every key should look like (for validation on every rank), and what this rank reads.
        self.expected: dict[str, tuple[tuple, torch.dtype] | None] = {}
        state = {}
        self.refused: dict[str, str] = {}
        for fqn, value in regular.items():
            dedicated = expected_dedicated(fqn, layout)
            problem = dedicated_value_problem(dedicated[0], value) if dedicated is not None else None
            if problem is not None:
                self.refused[fqn] = f"{fqn}: the state dict being loaded into holds {problem}"
            else:
                self.expected[fqn] = _tensor_spec(value)
            state[fqn] = value
        compat.set_planner_flat_state(self, state)
        for fqn, entry in layout.items():
            # held here or not, every rank checks it: all ranks then report the same problems
            self.expected[fqn] = (tuple(entry.shape), entry.dtype)

    def _problems(self) -> dict[str, str]:
        problems: dict[str, str] = dict(self.refused)
        assert self.checkpoint is not None
        stored = self.checkpoint.state_dict_metadata
        for fqn, want in self.expected.items():
            md = stored.get(fqn)
            if md is None:
                problems[fqn] = f"{fqn}: missing from the checkpoint"
            elif want is None:
                if not isinstance(md, BytesStorageMetadata):
                    problems[fqn] = f"{fqn}: the checkpoint holds a tensor, the state dict an object"
            elif not isinstance(md, TensorStorageMetadata):
                problems[fqn] = f"{fqn}: the checkpoint holds an object, the state dict a tensor"
            else:
                shape, dtype = want
                if tuple(md.size) != shape:
                    problems[fqn] = f"{fqn}: shape {tuple(md.size)} in the checkpoint, {shape} in the model"
                    if md.size.numel() == 0 and expected_dedicated(fqn, {}) is not None:
                        problems[fqn] += (
                            " (the checkpoint holds an empty tensor for a dmuon dedicated weight: the "
                            "save that wrote it lost the weight, so this checkpoint cannot restore it)"
                        )
                elif md.properties.dtype != dtype:
                    problems[fqn] = (
                        f"{fqn}: dtype {_describe_dtype(md.properties.dtype)} in the checkpoint, "
                        f"{_describe_dtype(dtype)} in the model"
                    )
        sections = self._checked_sections()
        for fqn, md in stored.items():
            if fqn in self.expected or not fqn.startswith(sections):
                continue
            dedicated = expected_dedicated(fqn, {})
            if dedicated is None:
                problems[fqn] = f"{fqn}: in the checkpoint but not in the model/optimizer being loaded"
            elif isinstance(md, TensorStorageMetadata) and tuple(md.size) != dedicated[0]:
                # held by another rank here; every rank reports it all the same
                problems[fqn] = (
                    f"{fqn}: shape {tuple(md.size)} in the checkpoint, {dedicated[0]} in the "
                    "model (a dmuon dedicated weight held by another rank)"
                )
        return problems

    def _checked_sections(self) -> tuple[str, ...]:
        """Prefixes (``model.``, ``app.optim.``...) where the checkpoint must hold nothing extra.

        A checkpoint with more layers than the model is a wrong model, not a partial load;
        user ``extra`` entries and sections not being loaded at all are never checked.
        """
        sections = set()
        for fqn in self.expected:
            parts = fqn.split(".")
            for i, part in enumerate(parts[:-1]):
                if part in (MODEL_SECTION, OPTIM_SECTION):
                    sections.add(".".join(parts[: i + 1]) + ".")
                    break
        return tuple(sorted(sections))

    def create_local_plan(self) -> LoadPlan:
        if self.checkpoint is None:
            raise RuntimeError("DMuonLoadPlanner needs the checkpoint metadata")
        problems = self._problems()
        if problems and not self.partial:
            raise CheckpointMismatchError(list(problems.values()))
        state = compat.planner_flat_state(self)
        if problems:
            self.skipped = sorted(problems)
            log.warning("partial load: skipping %d entries:\n  %s", len(problems), "\n  ".join(problems.values()))
            for fqn in problems:
                state.pop(fqn, None)
        return create_default_local_load_plan(state, self.checkpoint, strict=True)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        # Non-tensor entries: plain data only, never arbitrary objects.
        obj = torch.load(value, weights_only=True)
        path = compat.planner_mappings(self)[read_item.dest_index.fqn]
        compat.set_element(compat.planner_nested_state(self), path, obj)


__all__ = ["DMuonLoadPlanner", "DMuonSavePlanner", "merge_key_orders"]
