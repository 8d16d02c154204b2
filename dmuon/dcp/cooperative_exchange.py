"""The exchange of a cooperative load (``cooperative.py`` decides who reads what): each rank
reads its own regions and those it was given to send, then the shared regions go point to
point from their reader to the ranks that need them.

Failures stay loud: before any exchange every rank of the group that exchanges reports whether
its reads succeeded (one all-reduce of one number; their errors gathered only when one failed),
so a corrupt or missing file on the reading rank fails the load on every rank, instead of
leaving the others waiting for bytes that will never come.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.planner import LoadPlan

from .cooperative import RankShare, Transfer
from .errors import CheckpointError
from .group_transport import GroupTransport, exchange_device
from .transport import Attempt

__all__ = ["exchange", "read_shared"]


def read_shared(
    plan: LoadPlan,
    share: RankShare,
    planner: Any,
    read_items: Callable[..., None],
    dtypes: dict[str, torch.dtype],
    transport: GroupTransport,
) -> None:
    """This rank's part of a cooperative load: read every item not received from another rank
    (``read_items(items, planner, keep)``, verifying as usual), agree that every rank's reads
    succeeded, then send and receive the shared regions and commit what arrived."""
    group = transport.group if transport.group is not None else dist.group.WORLD
    received = {id(plan.items[position]) for position in share.receives}
    keep: dict[int, Any] = {id(plan.items[position]): None for position in share.sends}
    with Attempt() as reading:
        read_items([item for item in plan.items if id(item) not in received], planner, keep)
    transport.settle(reading, "reading (cooperative load: nothing was exchanged)")
    device = exchange_device(group)
    sends = []
    for position, transfer in share.sends.items():
        item = plan.items[position]
        target = keep[id(item)]
        if target is None:  # pragma: no cover - every sent item is a tensor read above
            raise CheckpointError(f"cooperative load: {item.storage_index.fqn} was not read on its reading rank")
        stored = dtypes[item.storage_index.fqn]
        sends.append((transfer, target.to(device=device, dtype=stored).contiguous()))
    receives, landing = [], []
    for position, transfer in share.receives.items():
        item = plan.items[position]
        target = planner.resolve_tensor(item).detach()
        stored = dtypes[item.storage_index.fqn]
        if tuple(target.size()) != tuple(item.lengths):
            raise CheckpointError(
                f"{item.storage_index.fqn}: stored region has shape {tuple(item.lengths)}, "
                f"expected {tuple(target.size())}"
            )
        direct = target.is_contiguous() and target.device == device and target.dtype == stored
        buffer = target if direct else torch.empty(tuple(item.lengths), dtype=stored, device=device)
        receives.append((transfer, buffer))
        landing.append((item, target, buffer))
    exchange(sends, receives, group)
    for item, target, buffer in landing:
        if buffer is not target:
            target.copy_(buffer)
        planner.commit_tensor(item, target)


def exchange(sends: list[tuple[Transfer, torch.Tensor]], receives: list[tuple[Transfer, torch.Tensor]], group: Any):
    """Send each region this rank read to the ranks that need it, receive the regions others
    read for it; returns when every one has arrived. Tensors are on :func:`exchange_device`,
    contiguous, in the stored dtype; both sides post their operations in ``tag`` order."""
    ops = []
    for transfer, tensor in sorted(sends, key=lambda pair: pair[0].tag):
        for target in transfer.targets:
            ops.append(dist.P2POp(dist.isend, tensor, dist.get_global_rank(group, target), group, transfer.tag))
    for transfer, tensor in sorted(receives, key=lambda pair: pair[0].tag):
        ops.append(dist.P2POp(dist.irecv, tensor, dist.get_global_rank(group, transfer.source), group, transfer.tag))
    if not ops:
        return
    for work in dist.batch_isend_irecv(ops):
        work.wait()
