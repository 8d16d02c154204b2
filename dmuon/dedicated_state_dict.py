"""``model.state_dict()`` / ``model.load_state_dict()`` for models with dedicated parameters.

``model.state_dict()`` shows each dedicated weight as its full master on the ranks that hold
it and leaves it out everywhere else (hooks on the root module), so that torch's DCP, with any
planner, writes it whole from a rank that has it: a 0-element placeholder under the same key
could otherwise win DCP's de-duplication and replace the weight with nothing.
``model.load_state_dict`` accepts exactly that, and also a full single-process state dict.
The DCP planners use :func:`dedicated_value_problem` to refuse a placeholder that reaches them
by another route under a key they know to be dedicated.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from . import compat, fsdp_patch
from .dedicated import DedicatedRegistry, get_registry
from .owner_transfer import from_global_owner
from .snapshot import wait_for_snapshots

__all__ = [
    "dedicated_value_problem",
    "install_state_dict_hooks",
    "raw_state_dict",
    "refuse_placeholder_save",
]


def raw_state_dict(model: nn.Module, *, keep_vars: bool = True) -> dict:
    """torch's own ``model.state_dict()``: dedicated entries are their 0-element placeholders.

    Same keys in the same order on every rank, which code that runs one collective per key
    needs; never hand this to DCP.
    """
    registry = get_registry(model)
    if registry is None:
        return model.state_dict(keep_vars=keep_vars)
    with registry.showing_placeholders():
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


def refuse_placeholder_save(fqn: str, obj) -> list:
    rec = getattr(obj, fsdp_patch.DEDICATED_ATTR, None)
    shape = tuple(rec.shape) if rec is not None else "?"
    raise ValueError(
        f"{fqn!r} is a dmuon dedicated parameter itself, a 0-element placeholder outside forward "
        f"(the weight, of shape {shape}, lives on its owner rank): saving it would lose the weight. "
        "Save model.state_dict() (it holds the full weight on the ranks that own it) or "
        "dmuon.dcp.AppState(model, optimizer)"
    )


def install_state_dict_hooks(model: nn.Module, registry: DedicatedRegistry) -> None:
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
        wait_for_snapshots(model)  # an async save still copying the masters this overwrites
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
