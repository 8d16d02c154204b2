"""Shard / replicate process groups and the rank arithmetic of dedicated parameters.

A dedicated parameter's owner is a slot ``(r, s)``. Every rank of shard column ``s`` holds its
master (it is the broadcast source for its own replica); only the rank at replica ``r``, the
*global owner*, runs the optimizer on it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

__all__ = ["Topology", "current_rank", "mesh_device", "resolve_topology"]


def current_rank() -> int:
    """This process's global rank; 0 without a process group (single-process tools)."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


@dataclass(frozen=True)
class Topology:
    """Where this rank stands in the data-parallel mesh, as dedicated parameters need it.

    ``shard_group`` is this rank's FSDP2 shard group (the broadcast and reduce of a dedicated
    weight run there); ``replicate_group`` its HSDP replica group (None on a 1-D mesh). A slot
    ``(r, s)`` is one cell of the replicate x shard grid; ``rank_table`` maps it to a global
    rank, identically on every rank.
    """

    shard_group: dist.ProcessGroup
    replicate_group: dist.ProcessGroup | None
    shard_size: int
    replicate_size: int
    shard_rank: int
    replicate_rank: int
    device: torch.device
    rank_table: tuple[tuple[int, ...], ...]  # rank_table[r][s] = global rank of slot (r, s)

    @property
    def world_size(self) -> int:
        """Data-parallel ranks that a gradient is averaged over."""
        return self.shard_size * self.replicate_size

    def holds_master(self, owner: tuple[int, int]) -> bool:
        return self.shard_rank == owner[1]

    def is_global_owner(self, owner: tuple[int, int]) -> bool:
        return (self.replicate_rank, self.shard_rank) == tuple(owner)

    def global_rank(self, slot: tuple[int, int]) -> int:
        return self.rank_table[slot[0]][slot[1]]


def mesh_device(mesh: DeviceMesh) -> torch.device:
    if mesh.device_type == "cpu":
        return torch.device("cpu")
    module = torch.get_device_module(mesh.device_type)
    return torch.device(mesh.device_type, module.current_device())


def resolve_topology(mesh: DeviceMesh, replicate_mesh: DeviceMesh | None = None) -> Topology:
    """Accept a 1-D shard mesh (+ optional 1-D replicate mesh) or a 2-D ("replicate", "shard") mesh."""
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"mesh must be a DeviceMesh, got {type(mesh).__name__}")
    if mesh.ndim == 2:
        if replicate_mesh is not None:
            raise ValueError("pass either a 2-D mesh or a 1-D mesh plus replicate_mesh, not both")
        names = tuple(mesh.mesh_dim_names or ())
        if names != ("replicate", "shard"):
            raise ValueError(f'a 2-D mesh must have mesh_dim_names ("replicate", "shard"), got {names or None}')
        shard_mesh, replicate_mesh = mesh["shard"], mesh["replicate"]
    elif mesh.ndim == 1:
        shard_mesh = mesh
    else:
        raise ValueError(f"mesh must be 1-D or 2-D, got {mesh.ndim}-D")
    if replicate_mesh is not None and replicate_mesh.ndim != 1:
        raise ValueError(f"replicate_mesh must be 1-D, got {replicate_mesh.ndim}-D")
    if replicate_mesh is not None and replicate_mesh.device_type != shard_mesh.device_type:
        raise ValueError("mesh and replicate_mesh must be on the same device type")
    shard_group = shard_mesh.get_group()
    replicate_group = replicate_mesh.get_group() if replicate_mesh is not None else None
    my_row = tuple(dist.get_global_rank(shard_group, i) for i in range(shard_mesh.size()))
    if replicate_group is None:
        rank_table: tuple[tuple[int, ...], ...] = (my_row,)
    else:
        assert replicate_mesh is not None
        rows: list = [None] * replicate_mesh.size()
        dist.all_gather_object(rows, my_row, group=replicate_group)
        rank_table = tuple(tuple(row) for row in rows)
    return Topology(
        shard_group=shard_group,
        replicate_group=replicate_group,
        shard_size=shard_mesh.size(),
        replicate_size=replicate_mesh.size() if replicate_mesh is not None else 1,
        shard_rank=shard_mesh.get_local_rank(),
        replicate_rank=replicate_mesh.get_local_rank() if replicate_mesh is not None else 0,
        device=mesh_device(shard_mesh),
        rank_table=rank_table,
    )
