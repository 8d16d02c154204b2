"""What a dmuon checkpoint contains, as a DCP state dict, without communication or copies.

Layout (after DCP flattening): ``model.<fqn>``, ``optim.state.<fqn>.<name>``,
``optim.param_groups.<group>.<hyper-parameter>``, ``extra.*``. FSDP2 parameters and their Adam
moments appear as DTensors; dedicated tensors as :class:`OwnedTensor` markers that the dmuon
planners turn into one write by one rank and reads only where the tensor is held.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..dedicated import DedicatedParam, get_registry, placeholder_record
from ..optim.muon import Muon
from ..state_dict import hyperparameters, restore_hyperparameters


@dataclass
class OwnedTensor:
    """A whole tensor that one rank writes and only some ranks hold.

    ``writer`` is the global rank that saves it; ``local`` is the full tensor on ranks that hold
    it (the writer, and on load every rank that needs it), else None.
    """

    shape: torch.Size
    dtype: torch.dtype
    writer: int
    local: torch.Tensor | None = None
    owner: tuple[int, int] = (0, 0)       # (replicate, shard) slot, recorded in the metadata
    topology: tuple[int, int] = (1, 1)    # (replicate, shard) sizes at save
    aliases: tuple[str, ...] = ()         # other names of a tied parameter (saved once)

    def __reduce__(self):
        # Reaching pickle means a planner other than dmuon's met the marker (it would write a
        # rank's None instead of the tensor): refuse loudly rather than lose the data.
        raise TypeError(
            "a dmuon OwnedTensor (dedicated parameter or its optimizer state) can only be saved "
            "or loaded with dmuon.dcp.DMuonSavePlanner / DMuonLoadPlanner"
        )


def _owned(rec: DedicatedParam, value: torch.Tensor | None, only_global_owner: bool) -> OwnedTensor:
    held = rec.is_global_owner if only_global_owner else rec.holds_master
    return OwnedTensor(
        shape=rec.shape,
        dtype=value.dtype if value is not None else rec.master_dtype,
        writer=rec.topo.global_rank(rec.owner),
        local=value if held else None,
        owner=rec.owner,
        topology=(rec.topo.replicate_size, rec.topo.shard_size),
    )


def model_state(model: nn.Module) -> dict[str, Any]:
    """``model.state_dict()`` with every dedicated entry replaced by an :class:`OwnedTensor`."""
    registry = get_registry(model)
    dedicated = registry.by_alias() if registry is not None else {}
    out: dict[str, Any] = {}
    for key, value in model.state_dict().items():
        rec = dedicated.get(key)
        if rec is None:
            out[key] = value
        elif key == rec.fqn:  # tied aliases are saved once, under the canonical name
            master = rec.master.detach() if rec.master is not None else None
            out[key] = _owned(rec, master, only_global_owner=False)
            out[key].aliases = tuple(a for a in rec.aliases if a != rec.fqn)
    return out


def optimizer_state(optimizer: Muon) -> dict[str, Any]:
    state: dict[str, dict[str, Any]] = {}
    for param in optimizer.group("adamw")["params"]:
        if id(param) not in optimizer.dedicated_of:
            state[optimizer.fqn_of[id(param)]] = dict(optimizer.state[param])
    registry = optimizer.registry
    for rec in registry or ():
        if not rec.trainable:
            continue
        names = ("momentum_buffer",) if rec.uses_muon else ("step", "exp_avg", "exp_avg_sq")
        mine = optimizer.state[rec.master] if rec.is_global_owner else {}
        entry = {}
        for name in names:
            value = mine.get(name)
            entry[name] = _owned(rec, value, only_global_owner=True)
            if name == "step":
                entry[name].shape, entry[name].dtype = torch.Size(()), torch.float32
        state[rec.fqn] = entry
    groups = {group.pop("name"): group for group in hyperparameters(optimizer)}
    return {"state": state, "param_groups": groups}


@dataclass
class StagedShard:
    """A CPU copy of one rank's DTensor shard, as ``async_save`` stages it.

    Not a DTensor: ``DTensor.from_local`` would move the copy back to the mesh's device (the
    GPU), undoing the staging. The dmuon save planner writes it like the shard it came from.
    """

    local: torch.Tensor
    global_shape: torch.Size
    offsets: tuple[int, ...]


def global_offsets(tensor) -> tuple[int, ...]:
    """Where a DTensor's local shard starts in the global tensor."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    _, offsets = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
    return tuple(offsets)


class AppState:
    """A torch ``Stateful`` bundling model, optimizer and user extras for ``dcp.save/load``.

    ``state_dict()`` is cheap (views and markers, no communication); after ``dcp.load`` has
    filled it in place, ``load_state_dict()`` finishes: hyper-parameters, stale full copies
    dropped, and the loaded extras kept in :attr:`loaded_extra`.
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
        out: dict[str, Any] = {"model": model_state(self.model)}
        if self.optimizer is not None:
            out["optim"] = optimizer_state(self.optimizer)
        if self.extra:
            out["extra"] = self.extra
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        registry = get_registry(self.model)
        if registry is not None:
            registry.reshard_all()  # full copies from before the load are stale
        if self.optimizer is not None and "optim" in state_dict:
            restore_hyperparameters(self.optimizer, state_dict["optim"].get("param_groups", {}))
        self.loaded_extra = state_dict.get("extra", {})


# ---------------------------------------------------------------------------------------------
# Placeholders reached through a plain model.state_dict(): the planners map them back to owners.
# ---------------------------------------------------------------------------------------------
def placeholder_owner(tensor: torch.Tensor) -> DedicatedParam | None:
    """The dedicated parameter whose 0-element placeholder ``tensor`` is, if any."""
    if not isinstance(tensor, torch.Tensor) or tensor.numel() != 0 or tensor.is_meta:
        return None
    return placeholder_record(tensor)


def owned_from_placeholder(rec: DedicatedParam) -> OwnedTensor:
    master = rec.master.detach() if rec.master is not None else None
    return _owned(rec, master, only_global_owner=False)

