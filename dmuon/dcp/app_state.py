"""What a dmuon checkpoint contains, as a DCP state dict, without communication or copies.

Layout (after DCP flattening, see ``format.py``): ``model.<fqn>``, ``optim.state.<fqn>.<name>``,
``optim.param_groups.<group>.<hyper-parameter>``, ``extra.*``. FSDP2 parameters and their Adam
moments appear as DTensors. A dedicated tensor appears as a plain full tensor on the ranks
that hold it (its weight on every rank of the owner's shard column, its optimizer state on the
global owner) and nowhere else, exactly as ``model.state_dict()`` shows it: any DCP planner
then writes it whole. Next to the sections, under ``format.RESERVED_KEY``, a
:class:`DedicatedLayout` tells dmuon's planners on *every* rank which keys are dedicated, their
shapes and dtypes, and which rank writes each.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .. import compat
from ..dedicated import DedicatedParam, get_registry
from ..dedicated_state_dict import raw_state_dict
from ..optim.muon import Muon
from ..optim.state_fields import state_field_spec, state_fields
from ..state_dict import hyperparameters, restore_hyperparameters
from .format.layout import EXTRA_SECTION, MODEL_SECTION, OPTIM_SECTION, RESERVED_KEY

__all__ = ["AppState", "DedicatedEntry", "DedicatedLayout", "collect_layout", "model_state", "optimizer_state"]


@dataclass(frozen=True)
class DedicatedEntry:
    """One dedicated tensor of a state dict: what every rank should expect under its key."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    writer: int  # global rank that saves it (the global owner)
    owner: tuple[int, int]  # (replicate, shard) slot
    aliases: tuple[str, ...] = ()  # other names of a tied parameter (saved once)


@dataclass
class DedicatedLayout:
    """The dedicated tensors of the dict this sits in, keyed relative to that dict.

    DCP's default planners cannot save it (they would write each rank's dedicated tensors
    without the checks dmuon's planners make): they fail at planning, before anything is
    written, with a message that names the planner to use.
    """

    entries: dict[str, DedicatedEntry] = field(default_factory=dict)
    topology: tuple[int, int] = (1, 1)  # (replicate, shard) sizes at save
    order: list[str] = field(default_factory=list)  # the model section's keys, in model order
    # keys (and key prefixes, ending in ".") that several ranks hold alike, by construction,
    # with those ranks (None: every rank): the step counts of AdamW's sharded parameters (the
    # ranks of the parameter's mesh: one pipeline stage's), the optimizer's hyper-parameters.
    # One of them writes each (the save planner), instead of all offering it to the coordinator.
    everywhere: dict[str, tuple[int, ...] | None] = field(default_factory=dict)

    def refuse_plain_planner(self, fqn: str, obj: Any) -> list:
        """DCP's checkpointable protocol (``compat.CREATE_WRITE_ITEMS``): a planner other than
        dmuon's asks the layout for its write items; refuse before anything is written."""
        raise TypeError(
            f"{fqn!r} is dmuon's description of the dedicated tensors of an AppState: save it with "
            "planner=dmuon.dcp.DMuonSavePlanner() (and load with DMuonLoadPlanner()), or save "
            "model.state_dict() instead, which any planner writes correctly"
        )


setattr(DedicatedLayout, compat.CREATE_WRITE_ITEMS, DedicatedLayout.refuse_plain_planner)


def _entry(rec: DedicatedParam, shape, dtype: torch.dtype, aliases: tuple[str, ...] = ()) -> DedicatedEntry:
    return DedicatedEntry(tuple(shape), dtype, rec.topo.global_rank(rec.owner), rec.owner, aliases)


def collect_layout(
    state_dict: Mapping, models: Mapping[str, nn.Module] | None = None
) -> tuple[DedicatedLayout, set[str]]:
    """What a planner knows of the dedicated tensors of ``state_dict``, keyed as DCP flattens it.

    Two sources, both given, never searched for: the :class:`DedicatedLayout` entries an
    ``AppState`` put into the dict, and ``models``, the caller's word that under a key of the
    dict (``""``: the dict itself) lies that model's ``state_dict()``, where every tied alias of
    a dedicated weight is a key of its own. Also returns the flattened keys of the layout
    entries, which are descriptions, not state.

    Read before torch's planners flatten the dict: their set-up replaces objects they do not
    know (with None, on load).
    """
    layout = DedicatedLayout()
    found: set[str] = set()

    def visit(mapping: Mapping, prefix: str) -> None:
        for key, value in mapping.items():
            if isinstance(value, DedicatedLayout):
                found.add(f"{prefix}{key}")
                layout.entries.update({prefix + rel: entry for rel, entry in value.entries.items()})
                layout.order += [prefix + rel for rel in value.order]
                layout.everywhere.update({prefix + rel: ranks for rel, ranks in value.everywhere.items()})
                layout.topology = value.topology
            elif isinstance(value, Mapping):
                visit(value, f"{prefix}{key}.")

    visit(state_dict, "")
    for where, model in (models or {}).items():
        registry = get_registry(model)
        prefix = f"{where}." if where else ""
        for rec in registry or ():
            layout.entries.update({prefix + alias: _entry(rec, rec.shape, rec.master_dtype) for alias in rec.aliases})
            layout.topology = (rec.topo.replicate_size, rec.topo.shard_size)
    return layout, found


def model_state(model: nn.Module, layout: DedicatedLayout) -> dict[str, Any]:
    """What ``model.state_dict()`` shows, with tied dedicated aliases dropped (saved once).

    Records the full key order in the layout: no single rank's dict has every key.
    """
    registry = get_registry(model)
    dedicated = registry.by_alias() if registry is not None else {}
    out: dict[str, Any] = {}
    for key, value in raw_state_dict(model, keep_vars=False).items():
        rec = dedicated.get(key)
        if rec is not None and key != rec.fqn:
            continue
        layout.order.append(f"{MODEL_SECTION}.{key}")
        if rec is None:
            out[key] = value
        elif rec.holds_master:
            out[key] = rec.held_master.detach()
    for rec in registry or ():
        aliases = tuple(a for a in rec.aliases if a != rec.fqn)
        layout.entries[f"{MODEL_SECTION}.{rec.fqn}"] = _entry(rec, rec.shape, rec.master_dtype, aliases)
        layout.topology = (rec.topo.replicate_size, rec.topo.shard_size)
    return out


def optimizer_state(optimizer: Muon, layout: DedicatedLayout) -> dict[str, Any]:
    plain = dict(optimizer.plain_params())
    state: dict[str, dict[str, Any]] = {fqn: dict(optimizer.state[p]) for fqn, p in plain.items()}
    for rec in optimizer.registry or ():
        if not rec.trainable:
            continue
        if rec.is_global_owner:
            state[rec.fqn] = dict(optimizer.state[rec.param])
        for name, kind in state_fields(rec).items():
            shape, dtype = state_field_spec(kind, rec)
            layout.entries[f"{OPTIM_SECTION}.state.{rec.fqn}.{name}"] = _entry(rec, shape, dtype)
    meshes: dict[int, tuple[int, ...]] = {}  # one tuple of ranks per mesh, shared by its keys
    for fqn, param in plain.items():
        mesh = getattr(param, "device_mesh", None)
        holders = meshes.setdefault(id(mesh), tuple(mesh.mesh.flatten().tolist())) if mesh is not None else None
        for name, value in state[fqn].items():
            if not _sharded(value):
                layout.everywhere[f"{OPTIM_SECTION}.state.{fqn}.{name}"] = holders
    layout.everywhere[f"{OPTIM_SECTION}.param_groups."] = None
    groups = {group.pop("name"): group for group in hyperparameters(optimizer)}
    return {"state": state, "param_groups": groups}


def _sharded(value: Any) -> bool:
    """A DTensor (or its stand-in): each rank holds its own part, never the same as another's."""
    return getattr(value, "placements", None) is not None


class AppState:
    """A torch ``Stateful`` bundling model, optimizer and user extras for ``dcp.save/load``.

    ``state_dict()`` is cheap (views, no communication); after ``dcp.load`` has filled it in
    place, ``load_state_dict()`` finishes: hyper-parameters, stale full copies dropped, and
    the loaded extras kept in :attr:`loaded_extra`. Save and load it with dmuon's planners.
    """

    def __init__(self, model: nn.Module, optimizer: Muon | None = None, extra: dict | None = None) -> None:
        if optimizer is not None and not isinstance(optimizer, Muon):
            raise TypeError(f"AppState expects a dmuon.Muon optimizer, got {type(optimizer).__name__}")
        self.model = model
        self.optimizer = optimizer
        self.extra = dict(extra) if extra is not None else {}
        self.loaded_extra: dict = {}

    def _drain(self) -> None:
        registry = get_registry(self.model)
        if registry is not None:
            registry.wait_all()

    def state_dict(self) -> dict[str, Any]:
        self._drain()
        layout = DedicatedLayout()
        out: dict[str, Any] = {MODEL_SECTION: model_state(self.model, layout)}
        if self.optimizer is not None:
            out[OPTIM_SECTION] = optimizer_state(self.optimizer, layout)
        if self.extra:
            out[EXTRA_SECTION] = self.extra
        if layout.entries:
            out[RESERVED_KEY] = layout
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        registry = get_registry(self.model)
        if registry is not None:
            registry.reshard_all()  # full copies from before the load are stale
        if self.optimizer is not None and OPTIM_SECTION in state_dict:
            restore_hyperparameters(self.optimizer, state_dict[OPTIM_SECTION].get("param_groups", {}))
        self.loaded_extra = state_dict.get(EXTRA_SECTION, {})
