"""Moving a tensor only the global owner of a dedicated parameter has, to rank 0 or to all.

The flat state-dict API (``state_dict.py``), the optimizer's state gathering and torch's
``get_model_state_dict(full_state_dict=True)`` (``dedicated_state_dict.py``) all need a
dedicated weight or its optimizer state where only its global owner keeps it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .dedicated import DedicatedParam
from .topology import Topology, current_rank

__all__ = ["from_global_owner"]


def from_global_owner(
    rec: DedicatedParam,
    value: torch.Tensor | None,
    rank0_only: bool,
    shape: tuple[int, ...] | None = None,
    dtype: torch.dtype | None = None,
) -> torch.Tensor | None:
    """Collective over the ranks of ``rec``'s mesh: ``value`` (given on the global owner) to
    global rank 0, or to every rank of the mesh.

    The mesh may be smaller than the job (a pipeline stage): then only its ranks call this, and
    with ``rank0_only`` a mesh without global rank 0 hands the value to no one, as torch's
    full state dict does with the tensors of that mesh.
    ``shape`` / ``dtype`` default to the master's; optimizer step counters pass ``()``.
    """
    shape = tuple(rec.shape) if shape is None else shape
    dtype = rec.master_dtype if dtype is None else dtype
    topo = rec.topo
    src = topo.global_rank(rec.owner)
    me = current_rank()
    if me == src:
        if value is None:
            raise ValueError(f"the global owner of {rec.fqn} must pass its value")
        value = value.to(topo.device)  # a CPU step counter must travel on the device
    if rank0_only:
        if me == src:
            assert value is not None
            if me != 0 and _holds_rank_zero(topo):
                dist.send(value.contiguous(), dst=0)
            return value if me == 0 else None
        if me == 0:
            buf = torch.empty(shape, dtype=dtype, device=topo.device)
            dist.recv(buf, src=src)
            return buf
        return None
    buf = value if value is not None and me == src else torch.empty(shape, dtype=dtype, device=topo.device)
    if topo.world_size == dist.get_world_size():
        dist.broadcast(buf, src=src)
        return buf
    # A mesh smaller than the job has no group of all its ranks (creating one would need every
    # rank of the job): the owner's replica column first, then each replica row from its rank
    # of that column.
    column = rec.owner[1]
    if topo.replicate_group is not None and topo.shard_rank == column:
        dist.broadcast(buf, src=src, group=topo.replicate_group)
    dist.broadcast(buf, src=topo.global_rank((topo.replicate_rank, column)), group=topo.shard_group)
    return buf


def _holds_rank_zero(topo: Topology) -> bool:
    return any(0 in row for row in topo.rank_table)
