"""Muon on stacks of matrices (MoE experts): every expert orthogonalised whole, once per job.

An expert stack is a 3-D parameter ``[experts, rows, cols]`` holding one matrix per expert.
Muon must orthogonalise each expert's matrix on its own; flattening the stack to one
``[experts, rows * cols]`` matrix (the convolution convention) is a different optimizer.

A stack is not a dedicated parameter: it stays whatever FSDP2 and expert parallelism made it
(a DTensor), so that forward, backward and every checkpoint door treat it as torch does. Its
*owners* follow from that layout (:class:`StackPlan`):

* mesh dimensions that shard the expert dimension (FSDP2's ``Shard(0)``, EP's ``Shard(0)``,
  their ``_StridedShard(0)`` composition) give each rank whole experts of its own: the rank
  holding an expert owns it, no communication;
* a mesh dimension that cuts the matrices (``Shard(1)`` or ``Shard(2)``: torchtitan shards
  experts so when there are fewer experts than ranks) is undone for the update: each expert is
  given a home among the ranks along it, balanced by Newton-Schulz cost over every stack that
  shares that dimension, and the pieces travel there and back in one ``all_to_all`` each way;
* a replicated mesh dimension (HSDP's replicas) holds the same experts on every replica: each
  replica orthogonalises a balanced share of them and one ``all_gather`` gives every replica
  the rest, instead of every replica computing everything.

Every expert's Newton-Schulz then runs on exactly one rank of the job, batched: all the
experts a rank owns that share a shape go through one call (:func:`orthogonalize_stacks`).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Replicate, Shard

from .. import compat
from .homes import mesh_key, newton_schulz_cost, spread_homes
from .newton_schulz import orthogonalize

__all__ = ["StackLayoutError", "StackPlan", "muon_scale", "orthogonalize_stacks", "plan_stacks"]


class StackLayoutError(NotImplementedError):
    """An expert stack laid out in a way the update does not handle; names the parameter."""


def muon_scale(rows: int, cols: int) -> float:
    """The update's scale for one ``rows x cols`` matrix: the rule every Muon update uses."""
    return 0.2 * math.sqrt(max(rows, cols))


def _chunk_sizes(total: int, parts: int) -> list[int]:
    """How ``torch.chunk`` (and so FSDP2 and DTensor's ``Shard``) cut ``total`` into ``parts``."""
    step = -(-total // parts) if total else 0
    return [max(0, min(step, total - i * step)) for i in range(parts)]


@dataclass(frozen=True)
class StackPlan:
    """Where one stack's experts are orthogonalised, from this rank's point of view.

    ``split_dim``: the mesh dimension cutting the matrices (``tensor_dim`` 1 or 2), with each
    local expert's home along it (``split_homes``) and every member's piece size
    (``piece_sizes``). ``replica_dim``: the replicated mesh dimension, with the replica that
    orthogonalises each expert this rank holds whole (``replica_homes``).
    """

    fqn: str
    shape: tuple[int, int, int]  # global [experts, rows, cols]
    local_experts: int
    split_dim: int | None = None
    tensor_dim: int = 1
    split_homes: tuple[int, ...] = ()
    piece_sizes: tuple[int, ...] = ()
    split_group: dist.ProcessGroup | None = None
    split_rank: int = 0
    replica_dim: int | None = None
    replica_homes: tuple[int, ...] = ()
    replica_group: dist.ProcessGroup | None = None
    replica_rank: int = 0

    @property
    def matrix(self) -> tuple[int, int]:
        return self.shape[1], self.shape[2]

    def held_whole(self) -> int:
        """Experts this rank holds whole after the split dimension is undone."""
        if self.split_dim is None:
            return self.local_experts
        return sum(1 for home in self.split_homes if home == self.split_rank)

    def mine(self) -> list[int]:
        """Indices (into the experts held whole) this rank orthogonalises."""
        if self.replica_dim is None:
            return list(range(self.held_whole()))
        return [i for i, home in enumerate(self.replica_homes) if home == self.replica_rank]


def _classify(fqn: str, param: DTensor) -> tuple[int | None, int, int | None]:
    """(split mesh dim, its tensor dim, replicated mesh dim) of a stack, or a refusal."""
    split: list[tuple[int, int]] = []
    replicated: list[int] = []
    mesh = param.device_mesh
    for dim, placement in enumerate(param.placements):
        if mesh.size(dim) == 1:
            continue
        if isinstance(placement, Replicate):
            replicated.append(dim)
        elif compat.is_strided_shard(placement):
            strided_dim = placement.dim  # type: ignore[attr-defined]
            if strided_dim != 0:
                raise StackLayoutError(f"expert stack {fqn!r}: a strided shard of dim {strided_dim} is not handled")
        elif isinstance(placement, Shard):
            if placement.dim not in (0, 1, 2):
                raise StackLayoutError(f"expert stack {fqn!r}: sharded on dim {placement.dim}")
            if placement.dim != 0:
                split.append((dim, placement.dim))
        else:
            raise StackLayoutError(
                f"expert stack {fqn!r} has placement {placement} on mesh dim {dim}: Muon needs each expert's "
                "gradient reduced (Shard or Replicate), not a partial sum"
            )
    if len(split) > 1 or len(replicated) > 1:
        raise StackLayoutError(
            f"expert stack {fqn!r} has placements {tuple(param.placements)}: at most one mesh dim may cut the "
            "matrices and at most one may replicate them (flatten the others into one)"
        )
    split_dim, tensor_dim = split[0] if split else (None, 1)
    return split_dim, tensor_dim, replicated[0] if replicated else None


def plan_stacks(stacks: Sequence[tuple[str, torch.Tensor]]) -> dict[str, StackPlan]:
    """Plans for every stack of a model, in a rank-independent order (the model's).

    Local: every rank computes the same homes from the same layouts, so the balance of one
    mesh dimension carries across all the stacks that share it.
    """
    split_loads: dict[tuple, list[int]] = {}
    replica_loads: dict[tuple, list[int]] = {}
    plans: dict[str, StackPlan] = {}
    for fqn, param in stacks:
        if param.ndim != 3:
            raise StackLayoutError(
                f"expert stack {fqn!r} has shape {tuple(param.shape)}; a stack is [experts, rows, cols]"
            )
        shape = (int(param.shape[0]), int(param.shape[1]), int(param.shape[2]))
        if not isinstance(param, DTensor):
            plans[fqn] = StackPlan(fqn, shape, shape[0])
            continue
        local = param.to_local()
        split_dim, tensor_dim, replica_dim = _classify(fqn, param)
        mesh = param.device_mesh
        coordinate = mesh.get_coordinate()
        assert coordinate is not None  # a rank holding a DTensor parameter is in its mesh
        cost = newton_schulz_cost(shape[1], shape[2])
        plan = StackPlan(fqn, shape, int(local.shape[0]))
        fields: dict = {}
        if split_dim is not None:
            members = mesh.size(split_dim)
            loads = split_loads.setdefault((mesh_key(mesh), split_dim), [0] * members)
            sizes = _chunk_sizes(shape[tensor_dim], members)
            if int(local.shape[tensor_dim]) != sizes[coordinate[split_dim]]:
                raise StackLayoutError(
                    f"expert stack {fqn!r}: local size {int(local.shape[tensor_dim])} on dim {tensor_dim}, "
                    f"expected {sizes[coordinate[split_dim]]} (torch.chunk over {members} ranks)"
                )
            fields.update(
                split_dim=split_dim,
                tensor_dim=tensor_dim,
                split_homes=tuple(spread_homes(plan.local_experts, cost, loads)),
                piece_sizes=tuple(sizes),
                split_group=mesh.get_group(split_dim),
                split_rank=coordinate[split_dim],
            )
            plan = StackPlan(fqn, shape, plan.local_experts, **fields)
        if replica_dim is not None:
            members = mesh.size(replica_dim)
            loads = replica_loads.setdefault((mesh_key(mesh), replica_dim, split_dim), [0] * members)
            fields.update(
                replica_dim=replica_dim,
                replica_homes=tuple(spread_homes(plan.held_whole(), cost, loads)),
                replica_group=mesh.get_group(replica_dim),
                replica_rank=coordinate[replica_dim],
            )
            plan = StackPlan(fqn, shape, plan.local_experts, **fields)
        plans[fqn] = plan
    return plans


# ---------------------------------------------------------------------------------------------
# the update
# ---------------------------------------------------------------------------------------------
def _assemble(plan: StackPlan, local: torch.Tensor) -> torch.Tensor:
    """Collective over the split dimension: the whole experts homed here, from every piece."""
    members = len(plan.piece_sizes)
    rows, cols = plan.matrix
    piece_numel = [size * (cols if plan.tensor_dim == 1 else rows) for size in plan.piece_sizes]
    homed = [[k for k, home in enumerate(plan.split_homes) if home == m] for m in range(members)]
    send = torch.cat([local[homed[m]].reshape(-1) for m in range(members)]) if local.numel() else local.reshape(-1)
    recv_counts = [len(homed[plan.split_rank]) * piece_numel[m] for m in range(members)]
    received = local.new_empty(sum(recv_counts))
    dist.all_to_all_single(
        received,
        send.contiguous(),
        output_split_sizes=recv_counts,
        input_split_sizes=[len(homed[m]) * piece_numel[plan.split_rank] for m in range(members)],
        group=plan.split_group,
    )
    count = len(homed[plan.split_rank])
    pieces = []
    for m, part in enumerate(received.split(recv_counts)):
        shape = (count, plan.piece_sizes[m], cols) if plan.tensor_dim == 1 else (count, rows, plan.piece_sizes[m])
        pieces.append(part.view(shape))
    return torch.cat(pieces, dim=plan.tensor_dim)


def _scatter_back(plan: StackPlan, whole: torch.Tensor, local_shape: torch.Size) -> torch.Tensor:
    """Collective over the split dimension: each member's piece of the experts homed here."""
    members = len(plan.piece_sizes)
    rows, cols = plan.matrix
    homed = [[k for k, home in enumerate(plan.split_homes) if home == m] for m in range(members)]
    pieces = whole.split(list(plan.piece_sizes), dim=plan.tensor_dim)
    send = torch.cat([piece.reshape(-1) for piece in pieces]) if whole.numel() else whole.reshape(-1)
    mine = plan.piece_sizes[plan.split_rank]
    mine_numel = mine * (cols if plan.tensor_dim == 1 else rows)
    recv_counts = [len(homed[m]) * mine_numel for m in range(members)]
    received = whole.new_empty(sum(recv_counts))
    dist.all_to_all_single(
        received,
        send.contiguous(),
        output_split_sizes=recv_counts,
        input_split_sizes=[piece.numel() for piece in pieces],
        group=plan.split_group,
    )
    out = whole.new_empty(local_shape)
    for m, part in enumerate(received.split(recv_counts)):
        if homed[m]:
            out[homed[m]] = part.view(len(homed[m]), *local_shape[1:])
    return out


def _share_out(plan: StackPlan, whole: torch.Tensor, mine: torch.Tensor) -> torch.Tensor:
    """Collective over the replicas: every replica's orthogonalised share, back in place."""
    members = dist.get_world_size(plan.replica_group)
    homes = plan.replica_homes
    widest = max((sum(1 for h in homes if h == m) for m in range(members)), default=0)
    padded = whole.new_zeros((widest, *whole.shape[1:]))
    padded[: mine.shape[0]] = mine
    gathered = whole.new_empty((members * widest, *whole.shape[1:]))
    dist.all_gather_into_tensor(gathered, padded, group=plan.replica_group)
    out = torch.empty_like(whole)
    for m in range(members):
        index = [i for i, h in enumerate(homes) if h == m]
        if index:
            out[index] = gathered[m * widest : m * widest + len(index)]
    return out


def orthogonalize_stacks(updates: Sequence[tuple[StackPlan, torch.Tensor]], steps: int) -> list[torch.Tensor]:
    """Orthogonalise every expert of every stack, each once in the job, batched by shape.

    ``updates``: each stack's plan with this rank's local piece of its update (the local
    tensor of the DTensor, same layout as the parameter). Returns, in the same order, the
    orthogonalised local pieces, unscaled. Collective over the mesh dimensions the plans name;
    every rank of those dimensions must call it with the same stacks in the same order.
    """
    wholes: list[torch.Tensor] = []
    for plan, local in updates:
        wholes.append(_assemble(plan, local) if plan.split_dim is not None else local)
    mine_index = [plan.mine() for plan, _ in updates]
    by_shape: dict[tuple, list[tuple[int, torch.Tensor]]] = defaultdict(list)
    for i, (whole, index) in enumerate(zip(wholes, mine_index)):
        if index:
            part = whole if len(index) == whole.shape[0] else whole[index]
            by_shape[(tuple(whole.shape[1:]), whole.dtype)].append((i, part))
    results: dict[int, torch.Tensor] = {}
    for batch in by_shape.values():
        done = orthogonalize(torch.cat([part for _, part in batch]), steps)
        for (i, _), out in zip(batch, done.split([part.shape[0] for _, part in batch])):
            results[i] = out
    out_list: list[torch.Tensor] = []
    for i, ((plan, local), whole) in enumerate(zip(updates, wholes)):
        ortho = results.get(i, whole.new_empty((0, *whole.shape[1:])))
        if plan.replica_dim is not None:
            ortho = _share_out(plan, whole, ortho)
        if plan.split_dim is not None:
            ortho = _scatter_back(plan, ortho, local.shape)
        out_list.append(ortho)
    return out_list
