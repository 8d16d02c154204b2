"""The flat-dict checkpoint API: full tensors keyed by FQN, loadable on any topology.

``get_*`` are collectives: every rank calls them in the same order. With ``rank0_only=True``
tensors travel to global rank 0 one at a time (FSDP2 shards by ``gather`` in rank 0's shard
group, dedicated tensors point-to-point from their global owner), so other ranks never hold
more than one tensor beyond their own shards. ``set_*`` take the full dict on every rank and
copy out the part each rank holds, without any communication.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from .dedicated import DedicatedRegistry, get_registry
from .dedicated_state_dict import raw_state_dict
from .model_parts import mesh_smaller_than_job
from .optim.muon import Muon
from .optim.state_fields import ADAMW_GROUP, MUON_GROUP, apply_hyperparameters, state_field_shape, state_fields
from .owner_transfer import from_global_owner
from .snapshot import wait_for_snapshots
from .topology import current_rank as _rank

__all__ = [
    "StateDictError",
    "check_fits",
    "expected_shapes",
    "get_model_state_dict",
    "get_optimizer_state_dict",
    "hyperparameters",
    "local_row_range",
    "restore_hyperparameters",
    "set_model_state_dict",
    "set_optimizer_state_dict",
    "tied_sources",
    "write_full_state",
]


# ---------------------------------------------------------------------------------------------
# collecting full tensors
# ---------------------------------------------------------------------------------------------
def _single_shard_dim(tensor: DTensor) -> int | None:
    """Mesh dim of the only Shard(0) placement when all others are Replicate (FSDP2 / HSDP)."""
    shard_dims = [i for i, p in enumerate(tensor.placements) if isinstance(p, Shard)]
    if len(shard_dims) != 1 or cast(Shard, tensor.placements[shard_dims[0]]).dim != 0:
        return None
    if not all(isinstance(p, (Shard, Replicate)) for p in tensor.placements):
        return None
    return shard_dims[0]


def _gather_dtensor_to_rank0(tensor: DTensor) -> torch.Tensor | None:
    """Full value on global rank 0 only; rows padded to equal chunks for ``dist.gather``."""
    mesh = tensor.device_mesh
    dim = _single_shard_dim(tensor)
    if dim is None:
        full = tensor.full_tensor()
        return full if _rank() == 0 else None
    where0 = (mesh.mesh == 0).nonzero()
    if where0.numel() == 0:  # a data-parallel slice of TP rank > 0: TP rank 0's slice holds it too
        return None
    coord0 = where0[0].tolist()
    mine = mesh.get_coordinate()
    assert mine is not None  # every rank of an FSDP2 mesh has a coordinate
    if any(mine[i] != coord0[i] for i in range(mesh.ndim) if i != dim):
        return None  # another replica: rank 0's own replica has every shard
    group, k = mesh.get_group(dim), mesh.size(dim)
    rows = tensor.shape[0]
    chunk = -(-rows // k) if rows else 0
    local = tensor.to_local()
    padded = local.new_zeros((chunk, *tensor.shape[1:]))
    padded[: local.shape[0]].copy_(local)
    is_dst = _rank() == 0
    bucket = [torch.empty_like(padded) for _ in range(k)] if is_dst else None
    dist.gather(padded, gather_list=bucket, group=group, group_dst=coord0[dim])
    return torch.cat(bucket)[:rows] if bucket is not None else None


def _full_tensor(tensor: torch.Tensor, rank0_only: bool) -> torch.Tensor | None:
    if isinstance(tensor, DTensor):
        return _gather_dtensor_to_rank0(tensor) if rank0_only else tensor.full_tensor()
    return tensor if (not rank0_only or _rank() == 0) else None


def _copy_out(tensor: torch.Tensor, cpu_offload: bool) -> torch.Tensor:
    # Always a copy: the result must not alias live parameters or optimizer state.
    return tensor.detach().to("cpu" if cpu_offload else tensor.device, copy=True)


def _registry(model: nn.Module) -> DedicatedRegistry | None:
    registry = get_registry(model)
    if registry is not None:
        registry.wait_all()  # pending HSDP broadcasts must not leak stale masters
    return registry


def _require_whole_job(model: nn.Module, what: str) -> None:
    """The gathers run one collective per key over the whole job; ranks of a smaller mesh (a
    pipeline stage) would wait on each other forever: refuse before the first one."""
    size = mesh_smaller_than_job(model)
    if size is not None:
        raise StateDictError(
            f"{what} gathers every tensor over the whole job ({dist.get_world_size()} ranks), but this model lives "
            f"on a mesh of {size} of them (a pipeline stage, dmuon.ModelParts): use dmuon.dcp.save / load, which "
            "write and read one checkpoint for all stages"
        )


# ---------------------------------------------------------------------------------------------
# model
# ---------------------------------------------------------------------------------------------
def get_model_state_dict(
    model: nn.Module, *, cpu_offload: bool = True, rank0_only: bool = True
) -> dict[str, torch.Tensor]:
    """Full ``{fqn: tensor}`` with the keys of the unwrapped model's ``state_dict()``.

    Collective. With ``rank0_only`` (default) ranks other than 0 return ``{}``.
    """
    _require_whole_job(model, "get_model_state_dict")
    registry = _registry(model)
    dedicated = registry.by_alias() if registry is not None else {}
    out: dict[str, torch.Tensor] = {}
    for key, value in raw_state_dict(model).items():
        rec = dedicated.get(key)
        if rec is not None:
            master = rec.held_master.detach() if rec.is_global_owner else None
            full = from_global_owner(rec, master, rank0_only)
        else:
            full = _full_tensor(value.detach() if isinstance(value, torch.Tensor) else value, rank0_only)
        full = None if full is None else _copy_out(full, cpu_offload)
        if full is not None:
            out[key] = full
    return out


def expected_shapes(model: nn.Module) -> dict[str, tuple[int, ...]]:
    """Global shape of every key of the unwrapped model's ``state_dict()``."""
    registry = get_registry(model)
    dedicated = registry.by_alias() if registry is not None else {}
    return {
        key: tuple(dedicated[key].shape if key in dedicated else value.shape)
        for key, value in raw_state_dict(model).items()
    }


class StateDictError(RuntimeError):
    """Raised before anything is written when a state dict does not fit the model."""


def _tied_groups(model: nn.Module) -> list[list[str]]:
    """The state-dict keys of each tensor that has more than one name (tied weights).

    A dedicated parameter's names are the aliases dmuon's registry recorded for it; any other
    keys are tied when the model holds one object under them (FSDP2 keeps a shared parameter
    shared). Placeholders are left out of the identity test: what a 0-element tensor is shared
    with says nothing about the weights.
    """
    registry = get_registry(model)
    dedicated = registry.by_alias() if registry is not None else {}
    by_object: dict[int, list[str]] = {}
    for key, value in raw_state_dict(model).items():
        if key not in dedicated:
            by_object.setdefault(id(value), []).append(key)
    groups = [list(rec.aliases) for rec in registry or () if len(rec.aliases) > 1]
    return groups + [keys for keys in by_object.values() if len(keys) > 1]


def tied_sources(model: nn.Module, present: Iterable[str]) -> dict[str, str]:
    """``{absent key: present key}`` for each key of a tied tensor that ``present`` lacks while
    it holds another name of the same tensor.

    HuggingFace's ``save_pretrained`` writes a tied weight once (``lm_head.weight`` is left out
    when ``tie_word_embeddings`` is set), and dmuon saves a tied dedicated weight once, under
    its first name: loading the present name fills the tensor every name shares, so the absent
    one is not missing. The present key is the first of the group the source holds, whichever
    it is (a file may hold the alias and not the first name).
    """
    have = set(present)
    sources: dict[str, str] = {}
    for keys in _tied_groups(model):
        found = next((key for key in keys if key in have), None)
        if found is not None:
            sources.update({key: found for key in keys if key not in have})
    return sources


def check_fits(model: nn.Module, shapes: Mapping[str, tuple[int, ...]], *, strict: bool, what: str) -> None:
    """Raise one :class:`StateDictError` listing every missing, unexpected or misshapen key.

    A key of a tied tensor is not missing when another of its names is there
    (:func:`tied_sources`); one whose tensor no present key names is.
    """
    expected = expected_shapes(model)
    tied = tied_sources(model, shapes) if strict else {}
    missing = [k for k in expected if k not in shapes and k not in tied] if strict else []
    unexpected = [k for k in shapes if k not in expected] if strict else []
    wrong = {k: (tuple(shapes[k]), v) for k, v in expected.items() if k in shapes and tuple(shapes[k]) != v}
    if not (missing or unexpected or wrong):
        return
    parts = [f"{what}: the state dict does not fit the model (nothing was loaded):"]
    if missing:
        parts.append(f"  missing keys ({len(missing)}): {', '.join(sorted(missing))}")
    if unexpected:
        parts.append(f"  unexpected keys ({len(unexpected)}): {', '.join(sorted(unexpected))}")
    for key, (got, want) in sorted(wrong.items()):
        parts.append(f"  wrong shape for {key}: checkpoint has {got}, model expects {want}")
    raise StateDictError("\n".join(parts))


def local_row_range(tensor: DTensor) -> tuple[int, int] | None:
    """Rows ``[start, stop)`` of the global tensor held here, for FSDP2 / HSDP Shard(0) layouts."""
    dim = _single_shard_dim(tensor)
    if dim is None:
        return None
    k = tensor.device_mesh.size(dim)
    coordinate = tensor.device_mesh.get_coordinate()
    if coordinate is None:
        return None
    index = coordinate[dim]
    rows = tensor.shape[0]
    chunk = -(-rows // k) if rows else 0
    start = min(index * chunk, rows)
    stop = min(start + chunk, rows)
    if tensor.to_local().shape[0] != stop - start:
        return None  # not torch.chunk semantics: let the caller slice generically
    return start, stop


Fetch = Callable[[str, "tuple[int, int] | None"], torch.Tensor]


def write_full_state(model: nn.Module, keys: Iterable[str], fetch: Fetch) -> None:
    """Copy full tensors into the model, each rank only its part.

    ``fetch(key, rows)`` returns rows ``[start, stop)`` of the full tensor, or all of it when
    ``rows`` is None; it is only called for what this rank holds, so a reader behind it can
    read just those bytes. A tied tensor is written through whichever of its names ``keys``
    holds (all its names share it).
    """
    registry = _registry(model)
    dedicated = registry.by_alias() if registry is not None else {}
    wanted = set(keys)
    with torch.no_grad():
        for key, target in raw_state_dict(model).items():
            if key not in wanted:
                continue
            rec = dedicated.get(key)
            if rec is not None:
                if rec.holds_master:
                    rec.held_master.copy_(fetch(key, None))
            elif isinstance(target, DTensor) and (rows := local_row_range(target)) is not None:
                target.to_local().copy_(fetch(key, rows))
            else:
                _copy_into(target, fetch(key, None))
    if registry is not None:
        registry.reshard_all()  # drop full copies that predate the load


def _copy_into(target: torch.Tensor, full: torch.Tensor) -> None:
    """Copy this rank's part of ``full`` into ``target`` (a DTensor shard or a plain tensor)."""
    full = full.detach()
    if isinstance(target, DTensor):
        local = distribute_tensor(
            full.to(device=target.device, dtype=target.dtype),
            target.device_mesh,
            target.placements,
            src_data_rank=None,  # every rank has the full value: slice locally, no communication
        ).to_local()
        target.to_local().copy_(local)
    else:
        target.copy_(full)


def set_model_state_dict(model: nn.Module, state_dict: Mapping[str, torch.Tensor], *, strict: bool = True) -> None:
    """Load a full flat dict (ours, a plain ``model.state_dict()``, or HuggingFace weights).

    Every problem is collected and raised in one :class:`StateDictError` before any tensor is
    written. With ``strict=False`` missing and unexpected keys are skipped; wrong shapes never are.
    """
    wait_for_snapshots(model)  # an async save still copying this state
    _registry(model)  # drain before validating: nothing may race the writes below
    check_fits(model, {k: tuple(v.shape) for k, v in state_dict.items()}, strict=strict, what="set_model_state_dict")

    def fetch(key: str, rows: tuple[int, int] | None) -> torch.Tensor:
        value = state_dict[key]
        return value if rows is None else value[rows[0] : rows[1]]

    write_full_state(model, state_dict.keys(), fetch)


# ---------------------------------------------------------------------------------------------
# optimizer
# ---------------------------------------------------------------------------------------------
def _check_optimizer(model: nn.Module, optimizer: Any) -> Muon:
    if not isinstance(optimizer, Muon):
        raise TypeError(f"expected a dmuon.Muon optimizer, got {type(optimizer).__name__}")
    if optimizer.model is not model:
        raise ValueError("the optimizer was built for a different model")
    return optimizer


def hyperparameters(optimizer: Muon) -> list[dict[str, Any]]:
    return [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]


def restore_hyperparameters(optimizer: Muon, groups: Mapping[str, dict[str, Any]]) -> None:
    """Apply saved hyper-parameters to the optimizer's groups, matched by group name."""
    for group in optimizer.param_groups:
        saved = groups.get(group["name"])
        if saved:
            apply_hyperparameters(group, saved)


def get_optimizer_state_dict(
    model: nn.Module, optimizer: Muon, *, cpu_offload: bool = True, rank0_only: bool = True
) -> dict[str, Any]:
    """``{"fsdp2": {fqn: {step, exp_avg, exp_avg_sq}}, "dedicated": {fqn: {...}}, "param_groups"}``."""
    optimizer = _check_optimizer(model, optimizer)
    _require_whole_job(model, "get_optimizer_state_dict")
    registry = _registry(model)
    keep = not rank0_only or _rank() == 0
    fsdp2: dict[str, dict[str, torch.Tensor]] = {}
    for fqn, param in optimizer.plain_params():
        entry = {}
        for name, value in optimizer.state[param].items():
            full = _full_tensor(value, rank0_only)
            full = None if full is None else _copy_out(full, cpu_offload)
            if full is not None:
                entry[name] = full
        if keep:
            fsdp2[fqn] = entry
    dedicated: dict[str, dict[str, torch.Tensor]] = {}
    for rec in registry or ():
        if not rec.trainable:
            continue
        gathered = optimizer.gather_dedicated_state(rec, rank0_only)
        entry = {name: _copy_out(full, cpu_offload) for name, full in gathered.items()}
        if keep:
            dedicated[rec.fqn] = entry
    if not keep:
        return {}
    return {"fsdp2": fsdp2, "dedicated": dedicated, "param_groups": hyperparameters(optimizer)}


def set_optimizer_state_dict(model: nn.Module, optimizer: Muon, state_dict: Mapping[str, Any]) -> None:
    """Restore momentum buffers, Adam moments, step counters and hyper-parameters.

    Takes the full dict on every rank; works whatever topology wrote it.
    """
    wait_for_snapshots(model)
    optimizer = _check_optimizer(model, optimizer)
    registry = _registry(model)
    for section in ("fsdp2", "dedicated"):
        if section not in state_dict:
            raise StateDictError(f"set_optimizer_state_dict: the state dict has no {section!r} section")
    problems: list[str] = []
    # a matrix dedicated in one job is a sharded (TP) one in another: either section will do
    entries = {**state_dict["dedicated"], **state_dict["fsdp2"]}
    fsdp_params = list(optimizer.plain_params())
    for fqn, param in fsdp_params:
        shapes = {name: tuple(t.shape) for name, t in optimizer.state[param].items()}
        _check_entry(problems, "fsdp2", fqn, entries.get(fqn), shapes)
    dedicated_recs = [rec for rec in registry or () if rec.trainable]
    for rec in dedicated_recs:
        shapes = {name: state_field_shape(kind, rec.shape) for name, kind in state_fields(rec).items()}
        _check_entry(problems, "dedicated", rec.fqn, entries.get(rec.fqn), shapes)
    known = {fqn for fqn, _ in fsdp_params} | {rec.fqn for rec in dedicated_recs}
    problems += [f"  unexpected entry {k}" for k in entries if k not in known]
    groups = {g.get("name"): g for g in state_dict.get("param_groups", [])}
    problems += [f"  unknown param group {name!r}" for name in groups if name not in (MUON_GROUP, ADAMW_GROUP)]
    if problems:
        raise StateDictError(
            "set_optimizer_state_dict: the state dict does not fit the optimizer:\n" + "\n".join(problems)
        )
    with torch.no_grad():
        for fqn, param in fsdp_params:
            for name, target in optimizer.state[param].items():
                _copy_into(target, entries[fqn][name])
        for rec in dedicated_recs:
            if rec.is_global_owner:
                for name, target in optimizer.state[rec.param].items():
                    _copy_into(target, entries[rec.fqn][name])
    restore_hyperparameters(optimizer, groups)


def _check_entry(problems: list[str], section: str, fqn: str, entry, shapes: Mapping[str, tuple]):
    if entry is None:
        problems.append(f"  missing {section} entry {fqn}")
        return
    for name, shape in shapes.items():
        if name not in entry:
            problems.append(f"  {section} entry {fqn} lacks {name!r}")
        elif tuple(entry[name].shape) != shape:
            problems.append(f"  {section} {fqn}.{name}: shape {tuple(entry[name].shape)}, expected {shape}")
