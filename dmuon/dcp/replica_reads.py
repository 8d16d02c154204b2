"""Cooperative reads under HSDP, found by the replicas themselves: no plan goes to a
coordinator, and what a rank sends or receives does not grow with the job.

Under HSDP every distributed tensor a rank loads lies on one mesh, replicated along one of its
dimensions (:func:`replica_layout`). The ranks along it -- a replica group of R ranks, and R
grows with the job (N / the shard degree) -- read the same regions of every such tensor: the
same shard coordinate, the same chunks. They also hold the same dedicated weights (whole, on
the rank of the owner's shard column in each replica), but not the same optimizer state for
them: that lives on the weight's one global owner. So a group finds which of its reads all of
its members make without sending those reads to one another:

1. a read into a distributed tensor is made by every member alike; a read into a plain tensor
   (a whole tensor, however many stored chunks it takes) is made by every member that holds
   that key. One all-reduce over the group, of one number per checkpoint key (the minimum:
   does every member hold it as a plain tensor), says which plain keys all members hold;
2. the reads all members make, in file order, are the shared list; one all-reduce of a digest
   of it (its maximum and minimum) checks that every member drew the same list (else that
   group shares nothing: each member reads for itself);
3. every member assigns readers over that list by the coordinator's rule
   (``cooperative.ReaderRule``: bytes balanced, neighbours in a file left with one reader
   within ``cooperative.STICKY_BYTES``), with a heap of the members' loads: O(reads x log R)
   work, the same on every member.

Reads that not every member makes are made by those that need them. Per member: two
all-reduces over its group, of 8 bytes per checkpoint key and of 2 numbers, whatever R; on a
local path across machines, an all-gather of each member's machine (a number each), so that
members of one machine read a region themselves (their page cache serves the second read) and
only other machines receive it.
"""

from __future__ import annotations

import hashlib
import zlib
from dataclasses import dataclass
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadPlan
from torch.distributed.tensor import Replicate

from .cooperative import (
    RankShare,
    ReaderRule,
    ReadRequest,
    Transfer,
    read_requests,
    stored_dtypes,
    with_share,
    writers_of,
)
from .transport import Transport, same

__all__ = ["IRREGULAR", "NO_REPLICAS", "ReplicaLayout", "replica_layout", "share_among_replicas"]


@dataclass(frozen=True)
class ReplicaLayout:
    """Where a rank's identical copies are: the one dimension of the one device mesh along
    which every distributed tensor it loads is replicated (HSDP's replicate dimension)."""

    mesh: Any  # torch's DeviceMesh (or what stands for one: the scale simulator's)
    dim: int

    @property
    def signature(self) -> int:
        """The same number on every rank of a job that found the same layout (positive)."""
        sizes = tuple(self.mesh.size(dim) for dim in range(self.mesh.ndim))
        text = repr((sizes, tuple(self.mesh.mesh_dim_names or ()), self.dim))
        return zlib.crc32(text.encode()) + 1


#: what :func:`replica_layout` says when no two ranks hold the same tensors (an FSDP2 1-D mesh)
NO_REPLICAS = 0
#: ... and when the tensors are on several meshes, or none: only the coordinator can tell
IRREGULAR = -1


def _distributed(value: Any) -> bool:
    """A DTensor, or what stands for one in the scale simulator: a mesh and placements."""
    return getattr(value, "placements", None) is not None and getattr(value, "device_mesh", None) is not None


def replica_layout(state: dict[str, Any]) -> ReplicaLayout | int:
    """The layout of this rank's (flattened) load destinations: a :class:`ReplicaLayout`,
    :data:`NO_REPLICAS` or :data:`IRREGULAR`."""
    mesh = None
    replicated: list[bool] | None = None
    for value in state.values():
        if not _distributed(value):
            continue
        value_mesh = value.device_mesh
        if mesh is None:
            mesh, replicated = value_mesh, [True] * value_mesh.ndim
        elif value_mesh is not mesh and value_mesh != mesh:
            return IRREGULAR
        assert replicated is not None
        for dim, placement in enumerate(value.placements):
            replicated[dim] = replicated[dim] and isinstance(placement, Replicate)
    if mesh is None or replicated is None:
        return IRREGULAR
    dims = [dim for dim, whole in enumerate(replicated) if whole and mesh.size(dim) > 1]
    if not dims:
        return NO_REPLICAS
    return ReplicaLayout(mesh, dims[0]) if len(dims) == 1 else IRREGULAR


@dataclass(frozen=True)
class _Agreed:
    """Step 2 (module docstring): the shared list's digest and the member's machine, if the
    same on every member of the group."""

    digest: int | None = same()
    machine: int | None = same()


def share_among_replicas(
    plan: LoadPlan,
    state: dict[str, Any],
    layout: ReplicaLayout,
    metadata: Metadata,
    node: int | None,
    transport: Transport,
) -> LoadPlan:
    """Collective over ``layout``'s replica group: ``plan`` with this rank's share of the reads
    every member of the group makes (module docstring). ``state``: the flattened destinations
    the plan reads into; ``node``: this rank's machine, where members of one machine each read
    for themselves (a local path); None: share between every pair. ``transport``: the load's
    (it knows how to reach the replicas)."""
    replicas = transport.replicas(layout)
    keys = {fqn: number for number, fqn in enumerate(metadata.state_dict_metadata)}
    reads = read_requests(plan, stored_dtypes(metadata), metadata.storage_data)
    destinations = {position: item.dest_index.fqn for position, item in enumerate(plan.items)}
    plain = [False] * len(keys)
    for region, _, _, _, position in reads:
        if not _distributed(state.get(destinations[position])):
            plain[keys[region[0]]] = True
    held_by_all = replicas.all_marked(plain)
    shared = sorted(
        (read for read in reads if _distributed(state.get(destinations[read[4]])) or held_by_all[keys[read[0][0]]]),
        key=lambda read: (read[2], read[3], read[0]),
    )
    agreed = replicas.reduce(
        _Agreed(_digest(shared), 0 if node is None else node), None, "sharing reads among replicas"
    )
    if agreed.digest is None or not shared or (node is not None and agreed.machine is not None):
        return plan  # (lists that differ; nothing shared; or one machine, whose page cache serves)
    machines = list(range(replicas.world)) if node is None else replicas.share(node)
    members = {replicas.job_rank(member): member for member in range(replicas.world)}
    share = _assigned(shared, replicas.rank, machines, writers_of((read[2] for read in shared), members))
    share.replicas = replicas
    return with_share(plan, share)


def _digest(shared: list[ReadRequest]) -> int:
    text = repr([read[0] for read in shared]).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "big") >> 1


def _assigned(shared: list[ReadRequest], me: int, machines: list[Any], writers: dict[str, int]) -> RankShare:
    """Member ``me``'s sends and receives, by the coordinator's rule (``ReaderRule``) over
    ``shared`` (the same list on every member, in file order); ``machines``: each member's;
    ``writers``: the member that wrote each file, where one did."""
    mates_of: dict[Any, list[int]] = {}
    for member, machine in enumerate(machines):
        mates_of.setdefault(machine, []).append(member)
    rule = ReaderRule([0] * len(machines), writers, [(file, nbytes, None) for _, nbytes, file, _, _ in shared])
    share = RankShare()
    for tag, (_, nbytes, file, _, position) in enumerate(shared):
        source = rule.pick(file, None, nbytes)
        mates = mates_of[machines[source]]  # (the reader's machine reads it, from its page cache)
        for member in mates:
            rule.charge(member, nbytes)
        if me == source:
            others = tuple(m for m in range(len(machines)) if machines[m] != machines[source])
            if others:
                share.sends[position] = Transfer(tag, source, others)
        elif machines[me] != machines[source]:
            share.receives[position] = Transfer(tag, source, ())
    return share
