"""Dedicated parameters: one owner keeps the whole matrix, everyone else a 0-element placeholder.

The registered ``nn.Parameter`` object never changes, so the model, ``named_parameters()`` and
autograd all see one leaf per dedicated parameter. Its ``.data`` is swapped:

* outside forward/backward: a 0-element placeholder on every rank;
* pre-forward: the master (fp32, on the owner's shard column) is cast to the compute dtype and
  broadcast to the shard group, and becomes ``.data``;
* post-forward: dropped again (``reshard_after_forward=True``) and re-broadcast before the
  module's backward by a hook on its outputs;
* post-accumulate-grad: the full gradient is summed to the owner (shard group, then replicate
  group under HSDP), divided by the data-parallel size (gloo has no AVG), and accumulated into
  the master's ``.grad`` on the global owner; the full copy is dropped.

After ``optimizer.step()`` the global owner broadcasts its new master to the other replicas of
its shard column; :meth:`DedicatedParam.wait_replicate` drains that.

``model.state_dict()`` shows each dedicated weight as its full master on the ranks that hold
it and leaves it out everywhere else (hooks on the root module), so that torch's DCP, with any
planner, writes it whole from a rank that has it: a 0-element placeholder under the same key
could otherwise win DCP's de-duplication and replace the weight with nothing.
``model.load_state_dict`` accepts exactly that, and also a full single-process state dict.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import threading
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.utils._pytree import tree_flatten

from . import compat, fsdp_patch
from .ownership import assign_owners
from .topology import Topology, current_rank, resolve_topology

__all__ = [
    "REGISTRY_ATTR",
    "DedicatedParam",
    "DedicatedRegistry",
    "dedicate_params",
    "dedicated_value_problem",
    "find_dedicated",
    "from_global_owner",
    "get_registry",
    "live_registries",
    "raw_state_dict",
    "wait_all_replicate_broadcasts",
]

REGISTRY_ATTR = "_dmuon_registry"


class DedicatedParam:
    """Runtime record of one dedicated parameter (shared by all its tied aliases)."""

    def __init__(
        self,
        fqn: str,
        aliases: tuple[str, ...],
        param: nn.Parameter,
        owner: tuple[int, int],
        topo: Topology,
        compute_dtype: torch.dtype,
    ) -> None:
        self.fqn = fqn
        self.aliases = aliases
        self.param = param
        self.owner = owner
        self.topo = topo
        self.shape = param.shape
        self.compute_dtype = compute_dtype
        self.master_dtype = torch.promote_types(param.dtype, torch.float32)
        self.holds_master = topo.holds_master(owner)
        self.is_global_owner = topo.is_global_owner(owner)
        self.master: nn.Parameter | None = None
        if self.holds_master:
            value = param.detach().to(device=topo.device, dtype=self.master_dtype, copy=True)
            self.master = nn.Parameter(value, requires_grad=param.requires_grad)
        self._placeholder = torch.empty(0, dtype=compute_dtype, device=topo.device)
        self._unsharded = False
        self._replicate_work: dist.Work | None = None
        param.data = self._placeholder

    @property
    def held_master(self) -> nn.Parameter:
        """The fp32 master, on ranks that hold it (asking elsewhere is a programming error)."""
        if self.master is None:
            raise RuntimeError(f"this rank does not hold the master of {self.fqn}")
        return self.master

    @property
    def trainable(self) -> bool:
        return self.param.requires_grad

    @property
    def uses_muon(self) -> bool:
        """Matrices (and conv kernels, flattened) get Muon; vectors fall back to AdamW."""
        return len(self.shape) >= 2

    # -- forward / backward -------------------------------------------------------------
    def unshard(self) -> None:
        if self._unsharded:
            return
        self.wait_replicate()
        full = torch.empty(self.shape, dtype=self.compute_dtype, device=self.topo.device)
        if self.holds_master:
            full.copy_(self.held_master.detach())
        if self.topo.shard_size > 1:
            dist.broadcast(full, group=self.topo.shard_group, group_src=self.owner[1])
        self.param.data = full
        self._unsharded = True

    def reshard(self) -> None:
        if self._unsharded:
            self.param.data = self._placeholder
            self._unsharded = False

    def reduce_grad(self, param: torch.Tensor) -> None:
        """Post-accumulate-grad hook: mean-reduce the full gradient to the global owner."""
        grad, param.grad = param.grad, None
        if grad is not None:
            grad = grad.to(dtype=self.master_dtype).contiguous()
            topo = self.topo
            if topo.shard_size > 1:
                dist.reduce(grad, group=topo.shard_group, group_dst=self.owner[1])
            if self.holds_master and topo.replicate_size > 1:
                dist.reduce(grad, group=topo.replicate_group, group_dst=self.owner[0])
            if self.is_global_owner:
                grad.div_(topo.world_size)
                if self.held_master.grad is None:
                    self.held_master.grad = grad
                else:
                    self.held_master.grad.add_(grad)
        self.reshard()

    # -- after the optimizer step -----------------------------------------------------------
    def publish_to_replicas(self, async_op: bool) -> None:
        """Global owner sends its new master down its shard column (HSDP only)."""
        if not self.holds_master or self.topo.replicate_size == 1:
            return
        self.wait_replicate()
        work = dist.broadcast(
            self.held_master.data,
            group=self.topo.replicate_group,
            group_src=self.owner[0],
            async_op=True,
        )
        if async_op:
            self._replicate_work = work
        else:
            work.wait()

    def wait_replicate(self) -> None:
        work, self._replicate_work = self._replicate_work, None
        if work is not None:
            work.wait()


@dataclass(eq=False)
class DedicatedRegistry:
    """Everything dmuon attached to one model; lives on the root module."""

    topo: Topology
    reshard_after_forward: bool
    records: dict[str, DedicatedParam] = field(default_factory=dict)
    handles: list = field(default_factory=list)
    # per thread: > 0 while :func:`raw_state_dict` wants torch's own state dict (placeholders)
    _raw: threading.local = field(default_factory=threading.local)
    _aliases: dict | None = None

    def __iter__(self) -> Iterator[DedicatedParam]:
        return iter(self.records.values())

    def owners(self) -> dict[str, tuple[int, int]]:
        return {fqn: rec.owner for fqn, rec in self.records.items()}

    def by_alias(self) -> dict[str, DedicatedParam]:
        """Every name of every dedicated parameter (tied aliases included) -> its record."""
        if self._aliases is None:
            self._aliases = {alias: rec for rec in self for alias in rec.aliases}
        return self._aliases

    def wait_all(self) -> None:
        for rec in self:
            rec.wait_replicate()

    def reshard_all(self) -> None:
        for rec in self:
            rec.reshard()

    @property
    def raw(self) -> bool:
        return getattr(self._raw, "depth", 0) > 0


# Every model dedicate_params set up that is still alive (weak: a model that is deleted drops
# out). DCP planners see only state dicts, not models: this is how they learn which keys are
# dedicated weights, to refuse a 0-element copy of one. Read it with :func:`live_registries`.
_LIVE_REGISTRIES: weakref.WeakSet[DedicatedRegistry] = weakref.WeakSet()


def live_registries() -> list[DedicatedRegistry]:
    """The registries of all live models with dedicated parameters in this process."""
    return list(_LIVE_REGISTRIES)


def get_registry(model: nn.Module) -> DedicatedRegistry | None:
    return getattr(model, REGISTRY_ATTR, None)


def wait_all_replicate_broadcasts(model: nn.Module) -> None:
    """Block until every pending post-step HSDP broadcast of ``model`` has landed."""
    registry = get_registry(model)
    if registry is not None:
        registry.wait_all()


def _tied_groups(model: nn.Module) -> dict[int, list[str]]:
    groups: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(param), []).append(name)
    return groups


def _check_same_everywhere(topo: Topology, selected: list[tuple[str, tuple[int, ...]]]) -> None:
    """Owner maps are computed locally; a rank with another model would silently disagree."""
    digest = hashlib.sha256(repr(selected).encode()).digest()[:8]
    mine = torch.tensor(list(digest), dtype=torch.int64, device=topo.device)
    for group in (topo.shard_group, topo.replicate_group):
        if group is None or dist.get_world_size(group) == 1:
            continue
        lo, hi = mine.clone(), mine.clone()
        dist.all_reduce(lo, op=dist.ReduceOp.MIN, group=group)
        dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=group)
        if not torch.equal(lo, hi):
            raise RuntimeError(
                f"dedicate_params: rank {dist.get_rank()} selected different parameters or shapes "
                f"than its peers ({len(selected)} selected here); every rank must build the same "
                "model and use the same predicate"
            )


def _install_module_hooks(module: nn.Module, recs: list[DedicatedParam], registry: DedicatedRegistry):
    def unshard_all() -> None:
        for rec in recs:
            rec.unshard()

    def pre_forward(_module, _args):
        unshard_all()

    def pre_backward(grad):
        unshard_all()
        return grad

    def post_forward(_module, _args, output):
        grad_enabled = torch.is_grad_enabled()
        if registry.reshard_after_forward or not grad_enabled:
            for rec in recs:
                rec.reshard()
        if grad_enabled and registry.reshard_after_forward:
            for tensor in tree_flatten(output)[0]:
                if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
                    tensor.register_hook(pre_backward)
        return output

    registry.handles.append(module.register_forward_pre_hook(pre_forward))
    registry.handles.append(module.register_forward_hook(post_forward))


def dedicate_params(
    model: nn.Module,
    mesh: DeviceMesh,
    predicate: Callable[[str, nn.Parameter], bool],
    *,
    replicate_mesh: DeviceMesh | None = None,
    reshard_after_forward: bool = True,
    param_dtype: torch.dtype | None = None,
) -> dict[str, tuple[int, int]]:
    """Give each parameter selected by ``predicate(fqn, param)`` one owner rank.

    Must run before ``fully_shard``; FSDP2 then leaves these parameters alone. Returns the owner
    map ``{fqn: (replicate_rank, shard_rank)}``, identical on every rank.
    """
    if get_registry(model) is not None:
        raise RuntimeError("dedicate_params was already called on this model")
    fsdp_patch.install()
    topo = resolve_topology(mesh, replicate_mesh)
    tied = _tied_groups(model)
    selected: list[tuple[str, nn.Parameter]] = []
    for fqn, param in model.named_parameters():
        if not predicate(fqn, param):
            continue
        if isinstance(param, torch.distributed.tensor.DTensor):
            raise RuntimeError(
                f"dedicate_params: {fqn!r} is already a DTensor; call dedicate_params before fully_shard"
            )
        selected.append((fqn, param))
    _check_same_everywhere(topo, [(fqn, tuple(p.shape)) for fqn, p in selected])
    owners = assign_owners(
        [(fqn, p.numel() * p.element_size()) for fqn, p in selected],
        topo.replicate_size,
        topo.shard_size,
    )
    registry = DedicatedRegistry(topo=topo, reshard_after_forward=reshard_after_forward)
    for fqn, param in selected:
        rec = DedicatedParam(
            fqn,
            tuple(tied[id(param)]),
            param,
            owners[fqn],
            topo,
            param_dtype or param.dtype,
        )
        setattr(param, fsdp_patch.DEDICATED_ATTR, rec)
        # DCP's checkpointable protocol: a plain planner handed this parameter itself (say,
        # dict(model.named_parameters())) asks it for its write items; refuse before writing.
        param.__create_write_items__ = _refuse_placeholder_save  # type: ignore[attr-defined]
        registry.handles.append(param.register_post_accumulate_grad_hook(rec.reduce_grad))
        registry.records[fqn] = rec
    _sync_replicas_at_start(registry)

    by_module: dict[nn.Module, list[DedicatedParam]] = {}
    for module in model.modules():
        for held in module._parameters.values():
            found = getattr(held, fsdp_patch.DEDICATED_ATTR, None) if held is not None else None
            if found is not None and found.fqn in registry.records:
                by_module.setdefault(module, []).append(found)
    for module, recs in by_module.items():
        _install_module_hooks(module, recs, registry)
    _install_state_dict_hooks(model, registry)
    setattr(model, REGISTRY_ATTR, registry)
    _LIVE_REGISTRIES.add(registry)
    return owners


def _sync_replicas_at_start(registry: DedicatedRegistry) -> None:
    """Every replica starts from the global owner's initial values, whatever each rank's seed."""
    for rec in registry:
        rec.publish_to_replicas(async_op=False)


# ---------------------------------------------------------------------------------------------
# Moving a tensor only the global owner has
# ---------------------------------------------------------------------------------------------
def from_global_owner(
    rec: DedicatedParam,
    value: torch.Tensor | None,
    rank0_only: bool,
    shape: tuple[int, ...] | None = None,
    dtype: torch.dtype | None = None,
) -> torch.Tensor | None:
    """Collective: ``value`` (given on the global owner) to global rank 0, or to every rank.

    ``shape`` / ``dtype`` default to the master's; optimizer step counters pass ``()``.
    """
    shape = tuple(rec.shape) if shape is None else shape
    dtype = rec.master_dtype if dtype is None else dtype
    src = rec.topo.global_rank(rec.owner)
    me = current_rank()
    if me == src:
        if value is None:
            raise ValueError(f"the global owner of {rec.fqn} must pass its value")
        value = value.to(rec.topo.device)  # a CPU step counter must travel on the device
    if rank0_only:
        if me == src:
            assert value is not None
            if me != 0:
                dist.send(value.contiguous(), dst=0)
            return value if me == 0 else None
        if me == 0:
            buf = torch.empty(shape, dtype=dtype, device=rec.topo.device)
            dist.recv(buf, src=src)
            return buf
        return None
    buf = value if value is not None and me == src else torch.empty(shape, dtype=dtype, device=rec.topo.device)
    dist.broadcast(buf, src=src)
    return buf


# ---------------------------------------------------------------------------------------------
# model.state_dict() / model.load_state_dict()
# ---------------------------------------------------------------------------------------------
@contextlib.contextmanager
def _raw_mode(registry: DedicatedRegistry | None) -> Iterator[None]:
    if registry is None:
        yield
        return
    registry._raw.depth = getattr(registry._raw, "depth", 0) + 1
    try:
        yield
    finally:
        registry._raw.depth -= 1


def raw_state_dict(model: nn.Module, *, keep_vars: bool = True) -> dict:
    """torch's own ``model.state_dict()``: dedicated entries are their 0-element placeholders.

    Same keys in the same order on every rank, which code that runs one collective per key
    needs; never hand this to DCP.
    """
    with _raw_mode(get_registry(model)):
        return model.state_dict(keep_vars=keep_vars)


def dedicated_value_problem(shape: tuple[int, ...], value) -> str | None:
    """Why ``value`` cannot stand for a dedicated tensor of ``shape`` in a state dict, or None."""
    shape = tuple(shape)
    if isinstance(value, torch.distributed.tensor.DTensor):
        return (
            f"a DTensor, but it is a dmuon dedicated tensor (one owner rank holds it whole); "
            f"pass a plain tensor of shape {shape}"
        )
    if not isinstance(value, torch.Tensor):
        return f"a {type(value).__name__}, not a tensor of shape {shape}"
    if tuple(value.shape) == shape:
        return None
    if value.numel() == 0 and math.prod(shape) != 0:
        return (
            f"an empty tensor of shape {tuple(value.shape)} where the dmuon dedicated tensor has "
            f"shape {shape}: a copy of a rank's placeholder, not the weight. Take the state "
            "dict from model.state_dict() (it holds the full weight on the ranks that own it), "
            "dmuon.get_model_state_dict(model) or dmuon.dcp.AppState(model, optimizer)"
        )
    return f"shape {tuple(value.shape)}, but the dmuon dedicated tensor has shape {shape}"


def find_dedicated(key: str) -> tuple[DedicatedParam, str | None] | None:
    """The dedicated parameter a flattened state-dict key stands for, in any live model.

    ``(rec, None)`` for the weight itself (``<prefix>.<fqn>``), ``(rec, name)`` for optimizer
    state (``<prefix>.state.<fqn>.<name>``). Matched on the key's dotted suffix.
    """
    parts = key.split(".")
    for registry in _LIVE_REGISTRIES:
        aliases = registry.by_alias()
        for start in range(len(parts)):
            rec = aliases.get(".".join(parts[start:]))
            if rec is not None:
                return rec, None
            if start > 0 and parts[start - 1] == "state" and len(parts) - start >= 2:
                rec = aliases.get(".".join(parts[start:-1]))
                if rec is not None:
                    return rec, parts[-1]
    return None


def _refuse_placeholder_save(fqn: str, obj) -> list:
    rec = getattr(obj, fsdp_patch.DEDICATED_ATTR, None)
    shape = tuple(rec.shape) if rec is not None else "?"
    raise ValueError(
        f"{fqn!r} is a dmuon dedicated parameter itself, a 0-element placeholder outside forward "
        f"(the weight, of shape {shape}, lives on its owner rank): saving it would lose the weight. "
        "Save model.state_dict() (it holds the full weight on the ranks that own it) or "
        "dmuon.dcp.AppState(model, optimizer)"
    )


def _install_state_dict_hooks(model: nn.Module, registry: DedicatedRegistry) -> None:
    """Hooks on the root module that make ``state_dict``/``load_state_dict`` dedicated-aware.

    state_dict: each dedicated entry becomes the master on ranks that hold it (every rank of
    the owner's shard column) and is removed elsewhere. Under torch's ``get_model_state_dict(
    full_state_dict=True)`` it is instead sent from its owner to the ranks torch returns to.

    load_state_dict: a dedicated entry is validated on every rank and copied into the master
    where it is held; on other ranks its absence is not an error (state_dict never gave it).
    """

    def on_state_dict(module, state_dict, prefix, local_metadata) -> None:
        if registry.raw:
            return
        request = compat.state_dict_request("model")
        for rec in registry:
            keys = [prefix + alias for alias in rec.aliases if prefix + alias in state_dict]
            if not keys:
                continue
            rec.wait_replicate()
            keep_vars = isinstance(state_dict[keys[0]], nn.Parameter)
            if request is not None and request.full_state_dict:
                master = rec.held_master.detach() if rec.is_global_owner else None
                value = from_global_owner(rec, master, rank0_only=request.cpu_offload)
            elif rec.holds_master:
                value = rec.master if keep_vars else rec.held_master.detach()
            else:
                value = None
            for key in keys:
                if value is None:
                    del state_dict[key]
                else:
                    state_dict[key] = value

    excused: set[str] = set()

    def on_load(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs) -> None:
        excused.clear()
        for rec in registry:
            rec.wait_replicate()
            for alias in rec.aliases:
                key = prefix + alias
                if key not in state_dict:
                    if not rec.holds_master:
                        excused.add(key)  # this rank's state_dict() never had it
                    continue
                value = state_dict.pop(key)
                excused.add(key)
                problem = dedicated_value_problem(rec.shape, value)
                if problem is not None:
                    error_msgs.append(f"size mismatch for {key}: the state dict holds {problem}.")
                elif rec.holds_master:
                    with torch.no_grad():
                        rec.held_master.copy_(value.detach())
            rec.reshard()  # a full copy from before the load is stale

    def after_load(module, incompatible_keys) -> None:
        incompatible_keys.missing_keys[:] = [k for k in incompatible_keys.missing_keys if k not in excused]
        excused.clear()

    registry.handles.append(model.register_state_dict_post_hook(on_state_dict))
    registry.handles.append(model.register_load_state_dict_pre_hook(on_load))
    registry.handles.append(model.register_load_state_dict_post_hook(after_load))
