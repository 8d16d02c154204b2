"""DCP planners that write each dedicated tensor once, from its owner, and read it where held.

``DMuonSavePlanner`` never lets a dedicated entry reach DCP's replica de-duplication (which
keeps one of several same-key items without comparing shapes, so an empty placeholder can
silently replace the real tensor) and checks in the global plan that each dedicated key has
exactly one writer covering its whole extent. ``DMuonLoadPlanner`` checks every key's shape and
dtype against the checkpoint and reports all mismatches at once, before any tensor is written;
it reads a dedicated tensor only on ranks that hold it in the *loading* topology.
"""
from __future__ import annotations

import dataclasses
import io
import logging
from collections import ChainMap, defaultdict
from typing import Any

import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint._dedup_save_plans import dedup_save_plans
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import (
    create_default_global_save_plan,
    create_default_local_load_plan,
    create_default_local_save_plan,
)
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.utils import find_state_dict_object

from .. import __version__
from ..topology import current_rank
from .errors import CheckpointMismatchError
from .state import OwnedTensor, StagedShard, owned_from_placeholder, placeholder_owner

log = logging.getLogger(__name__)

RESERVED_KEY = "__dmuon__"
FORMAT_VERSION = 1


def _split_owned(flat: dict[str, Any]) -> tuple[dict[str, Any], dict[str, OwnedTensor]]:
    """Separate dedicated entries (markers, or placeholders of a plain ``model.state_dict()``)."""
    regular: dict[str, Any] = {}
    owned: dict[str, OwnedTensor] = {}
    for fqn, value in flat.items():
        if isinstance(value, OwnedTensor):
            owned[fqn] = value
        elif (rec := placeholder_owner(value)) is not None:
            owned[fqn] = owned_from_placeholder(rec)
        else:
            regular[fqn] = value
    return regular, owned


def _staged_write_item(fqn: str, shard: StagedShard) -> WriteItem:
    """The write item DCP would make for the DTensor shard this staged copy came from."""
    return WriteItem(
        index=MetadataIndex(fqn, torch.Size(shard.offsets)),
        type=WriteItemType.SHARD,
        tensor_data=TensorWriteData(
            chunk=ChunkStorageMetadata(offsets=torch.Size(shard.offsets), sizes=shard.local.size()),
            properties=TensorProperties.create_from_tensor(shard.local),
            size=torch.Size(shard.global_shape),
        ),
    )


def _chunk_key(item: WriteItem) -> tuple:
    return (item.index.fqn, tuple(item.index.offset or ()))


class DMuonSavePlanner(SavePlanner):
    def __init__(self, dedup_save_to_lowest_rank: bool = False) -> None:
        self.dedup_save_to_lowest_rank = dedup_save_to_lowest_rank

    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator: bool = False) -> None:
        flat, self.mappings = flatten_state_dict(state_dict)
        self.state_dict, self.owned = _split_owned(flat)
        self.is_coordinator = is_coordinator
        self.rank = current_rank()

    def create_local_plan(self) -> SavePlan:
        mine: dict[str, torch.Tensor] = {}
        for fqn, entry in self.owned.items():
            if entry.writer != self.rank:
                continue
            if entry.local is None or tuple(entry.local.shape) != tuple(entry.shape):
                got = None if entry.local is None else tuple(entry.local.shape)
                raise RuntimeError(
                    f"rank {self.rank} is the writer of {fqn!r} but holds {got} instead of "
                    f"shape {tuple(entry.shape)}"
                )
            mine[fqn] = entry.local
        regular = {k: v for k, v in self.state_dict.items() if not isinstance(v, StagedShard)}
        plan = create_default_local_save_plan(regular, self.is_coordinator)
        owned_plan = create_default_local_save_plan(mine, self.is_coordinator)
        staged = [_staged_write_item(fqn, v) for fqn, v in self.state_dict.items() if isinstance(v, StagedShard)]
        plan = dataclasses.replace(plan, items=plan.items + owned_plan.items + staged, planner_data=self.mappings)
        self.plan = plan
        return plan

    def _check(self, all_plans: list[SavePlan]) -> None:
        problems = []
        writers: dict[str, list[tuple[int, WriteItem]]] = defaultdict(list)
        seen: dict[tuple, tuple[int, tuple]] = {}
        for rank, plan in enumerate(all_plans):
            for item in plan.items:
                if item.index.fqn in self.owned:
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
        for fqn, entry in self.owned.items():
            got = writers.get(fqn, [])
            ranks = [rank for rank, _ in got]
            if len(got) != 1:
                problems.append(f"{fqn}: written by ranks {ranks}, expected exactly one (rank {entry.writer})")
                continue
            rank, item = got[0]
            chunk = item.tensor_data.chunk
            if rank != entry.writer or any(chunk.offsets) or tuple(chunk.sizes) != tuple(entry.shape):
                problems.append(
                    f"{fqn}: rank {rank} writes offsets {tuple(chunk.offsets)} sizes {tuple(chunk.sizes)}, "
                    f"expected rank {entry.writer} to write the whole {tuple(entry.shape)}"
                )
        if problems:
            raise RuntimeError("DMuonSavePlanner: invalid global plan:\n  " + "\n  ".join(problems))

    def describe(self) -> dict[str, Any]:
        topology = next(iter(self.owned.values())).topology if self.owned else None
        return {
            "format": FORMAT_VERSION,
            "dmuon_version": __version__,
            "torch_version": str(torch.__version__),
            "world_size": torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1,
            "topology": {"replicate": topology[0], "shard": topology[1]} if topology else None,
            "owners": {fqn: list(e.owner) for fqn, e in self.owned.items() if fqn.startswith("model.")},
            "writers": {fqn: e.writer for fqn, e in self.owned.items()},
            "aliases": {alias: fqn[len("model."):] for fqn, e in self.owned.items()
                        if fqn.startswith("model.") for alias in e.aliases},
        }

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        self._check(all_plans)
        deduped = dedup_save_plans(all_plans, self.dedup_save_to_lowest_rank)
        global_plan, metadata = create_default_global_save_plan(deduped)
        planner_data = dict(ChainMap(*[p.planner_data for p in global_plan if p.planner_data]))
        planner_data[RESERVED_KEY] = self.describe()
        metadata = dataclasses.replace(metadata, planner_data=planner_data)
        self.global_plan, self.metadata = global_plan, metadata
        return global_plan, metadata

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        self.plan = new_plan
        return new_plan

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor | io.BytesIO:
        fqn = write_item.index.fqn
        if fqn in self.owned:
            return self.owned[fqn].local.detach()
        obj = self.state_dict.get(fqn)
        if isinstance(obj, StagedShard):
            return obj.local
        obj = find_state_dict_object(self.state_dict, write_item.index)
        if write_item.type == WriteItemType.BYTE_IO:
            buffer = io.BytesIO()
            torch.save(obj, buffer)
            return buffer
        return obj.detach() if isinstance(obj, torch.Tensor) else obj


def _describe_dtype(dtype) -> str:
    return str(dtype).replace("torch.", "")


class DMuonLoadPlanner(LoadPlanner):
    """Validates everything up front; ``allow_partial_load=True`` skips (and logs) what does not fit."""

    def __init__(self, allow_partial_load: bool = False) -> None:
        self.allow_partial_load = allow_partial_load
        self.skipped: list[str] = []

    def set_up_planner(self, state_dict, metadata: Metadata | None = None, is_coordinator: bool = False) -> None:
        self.original_state_dict = state_dict
        flat, self.mappings = flatten_state_dict(state_dict)
        regular, owned = _split_owned(flat)
        self.metadata = metadata
        self.is_coordinator = is_coordinator
        # What every key should look like (for validation on every rank), and what this rank reads.
        self.expected: dict[str, tuple[tuple, torch.dtype] | None] = {}
        self.state_dict: dict[str, Any] = {}
        for fqn, value in regular.items():
            if isinstance(value, torch.Tensor):
                self.expected[fqn] = (tuple(value.shape), value.dtype)
            else:
                self.expected[fqn] = None
            self.state_dict[fqn] = value
        for fqn, entry in owned.items():
            self.expected[fqn] = (tuple(entry.shape), entry.dtype)
            if entry.local is not None:
                self.state_dict[fqn] = entry.local

    def _problems(self) -> dict[str, str]:
        problems: dict[str, str] = {}
        stored = self.metadata.state_dict_metadata
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
                elif md.properties.dtype != dtype:
                    problems[fqn] = (
                        f"{fqn}: dtype {_describe_dtype(md.properties.dtype)} in the checkpoint, "
                        f"{_describe_dtype(dtype)} in the model"
                    )
        sections = self._checked_sections()
        for fqn in stored:
            if fqn not in self.expected and fqn.startswith(sections):
                problems[fqn] = f"{fqn}: in the checkpoint but not in the model/optimizer being loaded"
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
                if part in ("model", "optim"):
                    sections.add(".".join(parts[: i + 1]) + ".")
                    break
        return tuple(sorted(sections))

    def create_local_plan(self) -> LoadPlan:
        if self.metadata is None:
            raise RuntimeError("DMuonLoadPlanner needs the checkpoint metadata")
        problems = self._problems()
        if problems and not self.allow_partial_load:
            raise CheckpointMismatchError(list(problems.values()))
        if problems:
            self.skipped = sorted(problems)
            log.warning("partial load: skipping %d entries:\n  %s", len(problems), "\n  ".join(problems.values()))
            for fqn in problems:
                self.state_dict.pop(fqn, None)
        return create_default_local_load_plan(self.state_dict, self.metadata, strict=True)

    def create_global_plan(self, global_plan: list[LoadPlan]) -> list[LoadPlan]:
        return global_plan

    def finish_plan(self, central_plan: LoadPlan) -> LoadPlan:
        return central_plan

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        # Non-tensor entries: plain data only, never arbitrary objects.
        obj = torch.load(value, weights_only=True)
        set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        tensor = find_state_dict_object(self.state_dict, read_item.dest_index)
        return narrow_tensor_by_index(tensor, read_item.dest_offsets, read_item.lengths)

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        pass


__all__ = ["CheckpointMismatchError", "DMuonLoadPlanner", "DMuonSavePlanner", "RESERVED_KEY"]
