"""``dedicate_params``: turn a model's selected parameters into dedicated ones.

Checks that every rank selected the same parameters, assigns owners (``ownership.py``), builds
a :class:`~dmuon.dedicated.DedicatedParam` per parameter, and installs the hooks that move it:
forward/backward hooks on the modules that hold one (gathered onto each ``fully_shard``
module later, see ``dedicated.py``), a post-accumulate-grad hook per parameter, and the
``state_dict`` hooks of ``dedicated_state_dict.py`` on the root module.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from . import compat, fsdp_patch
from .dedicated import DedicatedParam, DedicatedRegistry, get_registry, register
from .dedicated_state_dict import install_state_dict_hooks, refuse_placeholder_save
from .ownership import assign_owners
from .topology import Topology, resolve_topology

__all__ = ["dedicate_params"]


def _tied_groups(model: nn.Module) -> dict[int, list[str]]:
    groups: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(param), []).append(compat.state_dict_name(name))
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


def dedicate_params(
    model: nn.Module,
    mesh: DeviceMesh,
    predicate: Callable[[str, nn.Parameter], bool],
    *,
    replicate_mesh: DeviceMesh | None = None,
    reshard_after_forward: bool = True,
    param_dtype: torch.dtype | None = None,
    expert_stacks: Callable[[str, nn.Parameter], bool] | None = None,
    sharded_matrices: Callable[[str, nn.Parameter], bool] | None = None,
) -> dict[str, tuple[int, int]]:
    """Give each parameter selected by ``predicate(fqn, param)`` one owner rank.

    Muon needs a weight matrix whole; FSDP2 would split it over the ranks. A *dedicated*
    parameter is instead kept whole, in fp32, by one owner (under HSDP by every rank of the
    owner's shard column), while every other rank holds a 0-element placeholder; forward
    broadcasts it from the owner, backward reduces its gradient there. Must run before
    ``fully_shard``, on every rank with the same model: FSDP2 then leaves these parameters alone
    (``fsdp_patch.py``), and the ranks check that they selected the same parameters.

    Args:
        model: the model before any ``fully_shard`` (activation checkpointing and
            ``torch.compile`` may already be applied), with memory or on the meta device
            (``deferred_init.py``: ``to_empty`` then gives the owners their full weights and
            the others nothing, and the initialisation that follows lands in the owners'
            masters). Its ``state_dict()`` becomes dedicated-aware (the full weight on the
            ranks that hold it, absent elsewhere). Parameters are named as ``state_dict``
            names them.
        mesh: the 1-D shard mesh FSDP2 uses, or a 2-D mesh with dim names
            ``("replicate", "shard")`` for HSDP.
        predicate: ``(fqn, param) -> bool``, which parameters to dedicate (typically 2-D
            weights: Muon updates matrices; a dedicated vector is updated with AdamW).
        replicate_mesh: the 1-D replicate mesh of HSDP, when ``mesh`` is the 1-D shard mesh.
        reshard_after_forward: drop the full weight on non-owners after forward and broadcast
            it again before backward (the memory-saving default), or keep it until backward.
        param_dtype: the dtype forward and backward compute in (the master stays fp32);
            the parameter's own dtype by default.
        expert_stacks: ``(fqn, param) -> bool``, which 3-D parameters are stacks of matrices,
            one per expert (``[experts, rows, cols]``, torchtitan's ``GroupedExperts``). Each
            expert is then updated by Muon exactly as a 2-D matrix of its own, on the one rank
            that holds it: the stack stays a normal parameter for ``fully_shard`` and expert
            parallelism, whose ``Shard(0)`` gives each rank whole experts (``optim/
            expert_stacks.py``). A stack matched here is not dedicated even if ``predicate``
            matches it too. Without it, a dedicated parameter of three or more dimensions is
            one matrix, flattened to ``[rows, -1]`` (the convolution convention), as before;
            one that holds a module's experts (its module's ``num_experts`` is its first
            dimension) is refused rather than silently flattened.
        sharded_matrices: ``(fqn, param) -> bool``, which 2-D matrices stay as tensor
            parallelism and ``fully_shard`` lay them out (DTensors, before or after this call)
            and are updated by Muon whole: each matrix is assembled on one home rank of its
            mesh, orthogonalised there, and the update sent back to the pieces, two
            collectives per step for all of them (``optim/sharded_matrices.py``). Name here
            every matrix a tensor-parallel plan shards (``ColwiseParallel``,
            ``RowwiseParallel``): a dedicated parameter cannot be TP-sharded. A matrix matched
            here is not dedicated even if ``predicate`` matches it too.

    Returns:
        The owner map ``{fqn: (replicate_rank, shard_rank)}``, identical on every rank: sizes
        are balanced over all owner slots, one layer's parameters spread over different owners.
    """
    if get_registry(model) is not None:
        raise RuntimeError("dedicate_params was already called on this model")
    compat.require_all("tree_flatten")
    fsdp_patch.install()
    topo = resolve_topology(mesh, replicate_mesh)
    tied = _tied_groups(model)
    selected: list[tuple[str, nn.Parameter]] = []
    stacks: list[tuple[str, tuple[int, ...]]] = []
    locations = _locations(model)
    matrices: list[tuple[str, tuple[int, ...]]] = []
    # (argument, its selector, what it selects, the rank that must have, what that rank means)
    kinds = (
        ("sharded_matrices", sharded_matrices, matrices, 2, "a matrix is 2-D"),
        ("expert_stacks", expert_stacks, stacks, 3, "an expert stack is [experts, rows, cols]"),
    )
    for name, param in model.named_parameters():
        fqn = compat.state_dict_name(name)
        kind = next((k for k in kinds if k[1] is not None and k[1](fqn, param)), None)
        if kind is not None:
            which, _, chosen, ndim, meaning = kind
            if param.ndim != ndim:
                raise ValueError(
                    f"dedicate_params: {fqn!r} was selected by {which} with shape {tuple(param.shape)}; {meaning}"
                )
            chosen.append((fqn, tuple(param.shape)))
        elif predicate(fqn, param):
            _refuse_unnamed_stack(fqn, param, locations[id(param)][0][0])
            selected.append((fqn, param))
    for fqn, param in selected:
        if isinstance(param, torch.distributed.tensor.DTensor):
            raise RuntimeError(
                f"dedicate_params: {fqn!r} is already a DTensor; call dedicate_params before fully_shard "
                "(a matrix tensor parallelism shards is named in sharded_matrices= instead)"
            )
    _check_same_everywhere(topo, [(fqn, tuple(p.shape)) for fqn, p in selected] + stacks + matrices)
    on_meta = _on_meta(selected)
    owners = assign_owners(
        [(fqn, p.numel() * p.element_size()) for fqn, p in selected],
        topo.replicate_size,
        topo.shard_size,
    )
    registry = DedicatedRegistry(
        topo=topo,
        reshard_after_forward=reshard_after_forward,
        stack_fqns=frozenset(fqn for fqn, _ in stacks),
        matrix_fqns=frozenset(fqn for fqn, _ in matrices),
    )

    def bind(param: nn.Parameter, rec: DedicatedParam) -> None:
        setattr(param, fsdp_patch.DEDICATED_ATTR, rec)
        # DCP's checkpointable protocol (compat.py): a plain planner handed this parameter itself
        # (say, dict(model.named_parameters())) asks it for its write items; refuse before writing.
        setattr(param, compat.CREATE_WRITE_ITEMS, refuse_placeholder_save)
        registry.handles.append(param.register_post_accumulate_grad_hook(rec.reduce_grad))

    for fqn, param in selected:
        rec = DedicatedParam(
            fqn,
            tuple(tied[id(param)]),
            param,
            owners[fqn],
            topo,
            param_dtype or param.dtype,
            locations[id(param)],
            bind,
        )
        registry.records[fqn] = rec
        rec.registry = registry
    if not on_meta:
        registry.materialize()  # every replica starts from the global owner's initial values

    by_module: dict[nn.Module, list[DedicatedParam]] = {}
    for module in model.modules():
        for _, held in module.named_parameters(recurse=False, remove_duplicate=False):
            found = getattr(held, fsdp_patch.DEDICATED_ATTR, None)
            if found is not None and found.fqn in registry.records:
                by_module.setdefault(module, []).append(found)
    for module, recs in by_module.items():
        registry.add_site(module, recs)
    install_state_dict_hooks(model, registry)
    register(model, registry)
    return owners


def _refuse_unnamed_stack(fqn: str, param: nn.Parameter, module: nn.Module) -> None:
    """A dedicated parameter that holds its module's experts would be flattened into one matrix
    (a different optimizer than Muon per expert): ask which one is meant."""
    experts = getattr(module, "num_experts", None)
    if param.ndim == 3 and isinstance(experts, int) and param.shape[0] == experts:
        raise ValueError(
            f"dedicate_params: {fqn!r} of shape {tuple(param.shape)} holds {experts} experts' matrices; "
            "name it in expert_stacks= to update each expert as its own matrix (Muon per expert), or leave "
            "it out of the predicate"
        )


def _locations(model: nn.Module) -> dict[int, list[tuple[nn.Module, str]]]:
    """id(parameter) -> every (module, name) that registers it, tied aliases included, in
    ``named_parameters`` order (a meta-built parameter is found there again after to_empty)."""
    found: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is not None:
                found.setdefault(id(param), []).append((module, name))
    return found


def _on_meta(selected: list[tuple[str, nn.Parameter]]) -> bool:
    """All selected parameters on the meta device, or none: a mix has no sound order of init."""
    meta = [fqn for fqn, p in selected if p.is_meta]
    if meta and len(meta) != len(selected):
        real = next(fqn for fqn, p in selected if not p.is_meta)
        raise RuntimeError(
            f"dedicate_params: {meta[0]!r} is on the meta device but {real!r} is not; build the "
            "whole model on meta (then model.to_empty and initialise) or the whole model with memory"
        )
    return bool(meta)
