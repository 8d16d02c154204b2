"""Dedicated parameters of a model built on the meta device.

A model too large for one rank is built under ``torch.device("meta")``, parallelised, then
given memory with ``model.to_empty(device=...)`` and initialised in place (torchtitan's
``init_weights``, ``reset_parameters``). ``dedicate_params`` on such a model cannot copy a
master out of a meta tensor, so it defers: until ``to_empty`` each dedicated parameter keeps a
meta *stand-in*, of its full shape on the ranks that will hold its master and with 0 rows
everywhere else. ``to_empty`` therefore gives the holders the full tensor, which the user's
initialisation writes into, and every other rank 0 bytes; no rank ever allocates a weight it
does not hold.

``to_empty`` replaces each meta ``Parameter`` with a new object (meta and real tensors cannot
share one ``.data``), and unties tied weights on the way. So the record finds its parameter again
where the module keeps it (:func:`materialised`), re-ties every alias to it and, on a holder,
*adopts* its values as the fp32 master (``dedicated.py``). Adoption happens at the first use
that needs the master: ``dmuon.Muon(...)``, a forward, a state dict or a checkpoint.

An initialisation run *after* adoption would write into the 0-element placeholder and be lost.
That cannot be seen when it happens, but its result can: a master adopted from memory nothing
had written since ``to_empty`` (its version counter never moved) and still unwritten at the
first forward (no init, no checkpoint load) is refused there, on every rank
(:func:`check_written`), instead of training from uninitialised memory.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

__all__ = [
    "MetaDeviceError",
    "adopted_master",
    "check_written",
    "materialised",
    "shared_flag",
    "stand_in",
    "still_meta_error",
]


class MetaDeviceError(RuntimeError):
    """A dedicated parameter built on the meta device was used before it could be."""


def stand_in(param: nn.Parameter, holds_master: bool) -> torch.Tensor:
    """What the module holds from ``dedicate_params`` until ``to_empty``: the full meta shape
    where the master will live, 0 rows elsewhere (the trailing dims kept, so that fan-in based
    initialisers such as ``nn.Linear.reset_parameters`` still compute their bounds)."""
    if holds_master:
        return param.data
    rest = tuple(param.shape[1:])
    return torch.empty((0, *rest), dtype=param.dtype, device="meta")


def materialised(fqn: str, locations: list[tuple[nn.Module, str]]) -> nn.Parameter | None:
    """The parameter ``to_empty`` put where ``fqn`` lives, or None while it is still on meta.

    Every alias location is pointed at that one parameter again: ``to_empty`` converts each
    module's entry separately, so tied weights come out as unrelated parameters unless the user
    ties them again (HF's ``tie_weights()``). Untied, the first name's parameter is kept, or the
    first one an initialisation wrote if nothing wrote the first.
    """
    found = [module._parameters.get(name) for module, name in locations]
    first = found[0]
    if first is None:
        raise MetaDeviceError(
            f"dedicated parameter {fqn!r} is no longer registered on its module; a model given to "
            "dmuon.dedicate_params must keep its parameters (assign new values in place)"
        )
    if first.is_meta:
        for (module, name), held in zip(locations[1:], found[1:]):
            if held is not None and not held.is_meta:
                raise MetaDeviceError(
                    f"dedicated parameter {fqn!r} is still on the meta device but its tied alias "
                    f"{name!r} of {type(module).__name__} is not: materialise the whole model with "
                    "model.to_empty(device=...)"
                )
        return None
    chosen = first
    if first._version == 0:  # to_empty untied them and the init wrote only another alias
        chosen = next((p for p in found if p is not None and p._version > 0), first)
    for module, name in locations:
        if module._parameters.get(name) is not chosen:
            module._parameters[name] = chosen
    return chosen


def still_meta_error(fqn: str) -> MetaDeviceError:
    return MetaDeviceError(
        f"dedicated parameter {fqn!r} is still on the meta device: give the model memory with "
        "model.to_empty(device=...) and initialise its weights (or load a checkpoint) before "
        "the first forward, dmuon.Muon(...) or a state-dict call"
    )


def adopted_master(
    fqn: str, fresh: nn.Parameter, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
) -> tuple[nn.Parameter, int | None]:
    """The fp32 master made of what ``to_empty`` gave a holder (no copy when it is fp32 on the
    right device already), and its version counter if nothing had written it (else None)."""
    if tuple(fresh.shape) != shape:
        raise MetaDeviceError(
            f"dedicated parameter {fqn!r} was materialised with shape {tuple(fresh.shape)}; "
            f"dmuon.dedicate_params saw {shape}"
        )
    if fresh._version == 0:  # nothing wrote it since to_empty: no values worth keeping
        value = torch.empty(shape, dtype=dtype, device=device)
        return nn.Parameter(value, requires_grad=fresh.requires_grad), value._version
    value = fresh.detach().to(device=device, dtype=dtype)
    return nn.Parameter(value, requires_grad=fresh.requires_grad), None


def shared_flag(mine: bool, group: dist.ProcessGroup | None, group_src: int, device: torch.device) -> bool:
    """Collective over ``group``: ``group_src``'s flag, on every rank of it."""
    flag = torch.tensor([1 if mine else 0], dtype=torch.int32, device=device)
    if group is not None and dist.get_world_size(group) > 1:
        dist.broadcast(flag, group=group, group_src=group_src)
    return bool(flag.item())


def check_written(fqn: str, unwritten: bool, group: dist.ProcessGroup | None, group_src: int, device) -> None:
    """Collective over ``group``: every rank raises if the master on ``group_src`` was adopted
    from memory nothing wrote and has not been written since (``unwritten`` there)."""
    if shared_flag(unwritten, group, group_src, device):
        raise MetaDeviceError(
            f"dedicated parameter {fqn!r} holds memory nothing has written since model.to_empty(): "
            "initialise the weights (init_weights, reset_parameters) or load a checkpoint before "
            "the first forward. An initialisation run after dmuon.Muon(...), a state-dict call or a "
            "checkpoint call writes into the 0-element placeholder instead of the owner's master"
        )
