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

The forward/backward hooks that move a group of dedicated parameters live on one module, a
:class:`HookSite`: first the module that holds them; when ``fully_shard`` wraps an ancestor,
the sites below it are gathered onto that module (``fsdp_patch.py`` calls
:meth:`DedicatedRegistry.gather_hooks`), so that dedicated weights move at the same
granularity as FSDP2's own parameters. The hooks never run inside a ``torch.compile`` graph
(dynamo skips them, as it skips FSDP2's): they run eagerly at the compiled module's boundary,
and a block compiled with ``fullgraph=True`` stays one graph.

This module holds the per-parameter record, the hook sites and the per-model registry;
``dedicate.py`` sets them up on a model, ``dedicated_state_dict.py`` makes ``state_dict()``
aware of them.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from . import compat, deferred_init
from .topology import Topology

__all__ = [
    "REGISTRY_ATTR",
    "DedicatedParam",
    "DedicatedRegistry",
    "HookSite",
    "get_registry",
    "register",
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
        locations: list[tuple[nn.Module, str]],
        bind: Callable[[nn.Parameter, DedicatedParam], None],
    ) -> None:
        self.fqn = fqn
        self.aliases = aliases
        self.owner = owner
        self.topo = topo
        self.shape = param.shape
        self.compute_dtype = compute_dtype
        self.master_dtype = torch.promote_types(param.dtype, torch.float32)
        self.holds_master = topo.holds_master(owner)
        self.is_global_owner = topo.is_global_owner(owner)
        self._master: nn.Parameter | None = None
        self._placeholder = torch.empty(0, dtype=compute_dtype, device=topo.device)
        self._unsharded = False
        self._replicate_work: dist.Work | None = None
        self._replicas_synced = False
        self.registry: DedicatedRegistry | None = None  # set when registered
        self._param = param
        self._bind = bind
        # meta-device build (deferred_init.py): where the module keeps the parameter, until
        # to_empty's replacement is adopted; the master's version if adopted unwritten
        self._locations: list[tuple[nn.Module, str]] | None = None
        self._unwritten_version: int | None = None
        self.built_on_meta = param.is_meta
        if param.is_meta:
            self._locations = locations
            param.data = deferred_init.stand_in(param, self.holds_master)
        else:
            if self.holds_master:
                value = param.detach().to(device=topo.device, dtype=self.master_dtype, copy=True)
                self._master = nn.Parameter(value, requires_grad=param.requires_grad)
            param.data = self._placeholder
        bind(param, self)

    @property
    def param(self) -> nn.Parameter:
        """The module's parameter (after ``to_empty``: the new object, once adopted)."""
        self.adopt_if_materialised()
        return self._param

    @property
    def master(self) -> nn.Parameter | None:
        """The fp32 master on the ranks that hold it, None elsewhere."""
        self.require_materialised()
        return self._master

    def adopt_if_materialised(self) -> None:
        """Local: take over what ``to_empty`` made of a meta-built parameter, where it has run."""
        if self._locations is not None:
            self._adopt()

    def require_materialised(self) -> None:
        if self._locations is not None and not self._adopt():
            raise deferred_init.still_meta_error(self.fqn)

    def _adopt(self) -> bool:
        """Take over the parameter ``to_empty`` made (False while the model is still on meta)."""
        assert self._locations is not None
        fresh = deferred_init.materialised(self.fqn, self._locations)
        if fresh is None:
            return False
        if self.holds_master:
            self._master, self._unwritten_version = deferred_init.adopted_master(
                self.fqn, fresh, tuple(self.shape), self.master_dtype, self.topo.device
            )
        fresh.data = self._placeholder
        self._bind(fresh, self)
        self._param = fresh
        self._locations = None
        return True

    def materialize(self) -> None:
        """Collective (the replicate group of the owner's column, under HSDP): adopt a
        meta-built parameter, and give every replica the global owner's initial values."""
        self.require_materialised()
        if self._replicas_synced:
            return
        self._replicas_synced = True
        if not self.holds_master or self.topo.replicate_size == 1:
            return
        unwritten = (
            deferred_init.shared_flag(self._unwritten_now(), self.topo.replicate_group, self.owner[0], self.topo.device)
            if self.built_on_meta
            else False
        )
        self.publish_to_replicas(async_op=False)
        if self.built_on_meta:  # the replicas' masters are now the global owner's, written or not
            self._unwritten_version = self.held_master._version if unwritten else None

    def _unwritten_now(self) -> bool:
        return self._unwritten_version is not None and self.held_master._version == self._unwritten_version

    def _check_written_once(self) -> None:
        """At the first forward of a meta-built parameter: refuse an owner's master that nothing
        initialised or loaded (every rank of the shard group raises, no rank waits)."""
        if self._unwritten_version is None and not self.built_on_meta:
            return
        self.built_on_meta = False
        unwritten = self.holds_master and self._unwritten_now()
        deferred_init.check_written(self.fqn, unwritten, self.topo.shard_group, self.owner[1], self.topo.device)
        self._unwritten_version = None

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
        self.materialize()
        self._check_written_once()
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
        elif work is not None:  # always, with async_op=True (torch 2.14's stubs say Work | None)
            work.wait()

    def wait_replicate(self) -> None:
        work, self._replicate_work = self._replicate_work, None
        if work is not None:
            work.wait()


def _eager_only(hook):
    """Dynamo runs ``hook`` eagerly instead of tracing it (collectives, ``.data`` swaps)."""
    return torch.compiler.disable(hook, recursive=True)


class HookSite:
    """The hooks that unshard and reshard some dedicated parameters around one module's calls.

    Pre-forward: unshard (broadcast from the owner). Post-forward: reshard when
    ``reshard_after_forward`` (or without grad), and a hook on the outputs unshards again
    before this module's backward. ``fsdp_unit``: the site of a ``fully_shard`` module, which
    an outer ``fully_shard`` leaves where it is (as FSDP2 leaves inner units' parameters).
    """

    def __init__(
        self, module: nn.Module, recs: list[DedicatedParam], reshard_after_forward: bool, fsdp_unit: bool = False
    ) -> None:
        self.module = module
        self.recs = recs
        self.fsdp_unit = fsdp_unit

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
            if reshard_after_forward or not grad_enabled:
                for rec in recs:
                    rec.reshard()
            if grad_enabled and reshard_after_forward:
                for tensor in compat.tree_flatten(output)[0]:
                    if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
                        tensor.register_hook(eager_pre_backward)
            return output

        eager_pre_backward = _eager_only(pre_backward)
        self._handles = [
            module.register_forward_pre_hook(_eager_only(pre_forward)),
            module.register_forward_hook(_eager_only(post_forward)),
        ]

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


@dataclass(eq=False)
class DedicatedRegistry:
    """Everything dmuon attached to one model; lives on the root module."""

    topo: Topology
    reshard_after_forward: bool
    #: not dedicated, but updated by Muon: expert stacks (``expert_stacks=``), per expert, and
    #: sharded matrices (``sharded_matrices=``), whole on a home rank; named as ``state_dict`` does
    stack_fqns: frozenset[str] = frozenset()
    matrix_fqns: frozenset[str] = frozenset()
    records: dict[str, DedicatedParam] = field(default_factory=dict)
    handles: list = field(default_factory=list)
    sites: list[HookSite] = field(default_factory=list)
    # per thread: > 0 while :func:`raw_state_dict` wants torch's own state dict (placeholders)
    _raw: threading.local = field(default_factory=threading.local)
    _aliases: dict | None = None

    def __iter__(self) -> Iterator[DedicatedParam]:
        return iter(self.records.values())

    def by_alias(self) -> dict[str, DedicatedParam]:
        """Every name of every dedicated parameter (tied aliases included) -> its record."""
        if self._aliases is None:
            self._aliases = {alias: rec for rec in self for alias in rec.aliases}
        return self._aliases

    def add_site(self, module: nn.Module, recs: list[DedicatedParam], fsdp_unit: bool = False) -> None:
        self.sites.append(HookSite(module, recs, self.reshard_after_forward, fsdp_unit))

    def gather_hooks(self, module: nn.Module) -> None:
        """Move the hooks of the dedicated parameters under ``module`` onto ``module``
        (``fully_shard(module)`` is being applied: FSDP2 moves its parameters there too),
        except those an inner ``fully_shard`` module already holds."""
        below = {id(m) for m in module.modules()}
        gathered = [site for site in self.sites if id(site.module) in below and not site.fsdp_unit]
        if not gathered:
            return
        for site in gathered:
            site.remove()
        self.sites = [site for site in self.sites if site not in gathered]
        self.add_site(module, [rec for site in gathered for rec in site.recs], fsdp_unit=True)

    def materialize(self) -> None:
        """Collective: every dedicated parameter adopted and its replicas in step
        (:meth:`DedicatedParam.materialize`); raises while the model is still on meta."""
        for rec in self:
            rec.materialize()

    def adopt_materialised(self) -> None:
        """Local: take over what ``to_empty`` made of meta-built parameters, where it has run."""
        for rec in self:
            rec.adopt_if_materialised()

    def wait_all(self) -> None:
        for rec in self:
            rec.wait_replicate()

    def reshard_all(self) -> None:
        for rec in self:
            rec.reshard()

    @property
    def raw(self) -> bool:
        """True (in this thread) inside :meth:`showing_placeholders`."""
        return getattr(self._raw, "depth", 0) > 0

    @contextlib.contextmanager
    def showing_placeholders(self) -> Iterator[None]:
        """Inside, ``model.state_dict()`` is torch's own: placeholders, no hooks' changes."""
        self._raw.depth = getattr(self._raw, "depth", 0) + 1
        try:
            yield
        finally:
            self._raw.depth -= 1


def register(model: nn.Module, registry: DedicatedRegistry) -> None:
    """Attach ``registry`` to its model: everything that needs it (the optimizer, state dicts,
    ``AppState``, the planners given the model) finds it there, and nowhere else."""
    setattr(model, REGISTRY_ATTR, registry)


def get_registry(model: nn.Module) -> DedicatedRegistry | None:
    """The model's registry, with any meta-built parameter that ``to_empty`` has given memory
    adopted first: whoever asks then sees the parameters the module holds now."""
    registry = getattr(model, REGISTRY_ATTR, None)
    if registry is not None:
        registry.adopt_materialised()
    return registry


def wait_all_replicate_broadcasts(model: nn.Module) -> None:
    """Block until every pending post-step HSDP broadcast of ``model`` has landed."""
    registry = get_registry(model)
    if registry is not None:
        registry.wait_all()
