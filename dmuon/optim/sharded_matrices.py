"""Muon on matrices left sharded (tensor parallelism, FSDP2): each one assembled on a home rank.

Tensor parallelism cuts a weight matrix for forward and backward: ``ColwiseParallel`` by rows
(``Shard(0)``), ``RowwiseParallel`` by columns (``Shard(1)``); ``fully_shard`` over a data
mesh cuts each piece again (torch 2.13: ``(_StridedShard(0), Shard(0))`` over
``("dp_shard", "tp")`` for a column-wise matrix, ``(Shard(0), Shard(1))`` for a row-wise one).
Such a matrix is not a dedicated parameter: it stays the DTensor torch made it, so forward,
backward and every checkpoint door are torch's own, and its momentum is a DTensor laid out
like it. Only the update is special, as for expert stacks (``expert_stacks.py``):

* every rank applies momentum (and Nesterov) to its own piece, elementwise;
* each matrix has one *home* among the ranks of its mesh, balanced by Newton-Schulz cost over
  every sharded matrix on that mesh; one ``all_to_all_single`` over the mesh sends every
  piece of every matrix to its home (a matrix replicated on a mesh dimension, HSDP, is
  assembled from one replica's pieces);
* each home orthogonalises the matrices it assembled, batched by shape;
* one ``all_to_all_single`` sends every rank its pieces of the results back.

Two collectives per step for all the matrices of a mesh (per dtype), whatever their number;
each matrix orthogonalised once per job; a rank holds at most its homes' full matrices.

Where each rank's piece lies in the matrix is DTensor's own computation (the one DCP saves
shards with): a block of rows and columns at an offset. A plan checks that the blocks of one
replica tile the matrix exactly, and refuses a layout whose pieces are not such blocks.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Replicate, Shard

from .. import compat
from .homes import mesh_key, newton_schulz_cost, spread_homes
from .newton_schulz import orthogonalize

__all__ = ["MatrixLayoutError", "MatrixPlan", "orthogonalize_matrices", "plan_matrices"]


class MatrixLayoutError(NotImplementedError):
    """A sharded matrix laid out in a way the update does not handle; names the parameter."""


@dataclass(frozen=True)
class Block:
    """Where one rank's piece lies in the matrix: rows ``[row, row + rows)``, columns
    ``[col, col + cols)``."""

    row: int
    rows: int
    col: int
    cols: int

    @property
    def numel(self) -> int:
        return self.rows * self.cols

    def of(self, whole: torch.Tensor) -> torch.Tensor:
        return whole[self.row : self.row + self.rows, self.col : self.col + self.cols]


@dataclass(frozen=True)
class MatrixPlan:
    """Where one sharded matrix is orthogonalised, the same on every rank of its mesh.

    ``group``: a process group over every rank of the mesh (None: the matrix is held whole
    here, no communication). ``blocks[g]``: the piece group rank ``g`` holds. ``home``: the
    group rank that assembles and orthogonalises it, from the pieces of ``sources`` (one
    replica's ranks).
    """

    fqn: str
    shape: tuple[int, int]
    group: dist.ProcessGroup | None = None
    rank: int = 0
    home: int = 0
    blocks: tuple[Block, ...] = ()
    sources: frozenset[int] = frozenset()

    @property
    def matrix(self) -> tuple[int, int]:
        return self.shape


@dataclass(frozen=True)
class _MeshRanks:
    group: dist.ProcessGroup
    rank: int  # this rank's place in the group
    coordinates: tuple[tuple[int, ...], ...]  # each group rank's mesh coordinate


def _mesh_ranks(mesh: DeviceMesh) -> _MeshRanks:
    """A group over every rank of ``mesh`` (the mesh itself, the world, or its flattening) and
    each member's coordinate in the mesh."""
    group: dist.ProcessGroup | None
    if mesh.ndim == 1:
        group = mesh.get_group()
    elif mesh.size() == dist.get_world_size():
        group = dist.group.WORLD
    else:
        group = mesh._flatten().get_group()
    assert group is not None
    where = {int(rank): index for index, rank in enumerate(mesh.mesh.flatten().tolist())}
    coordinates = []
    for global_rank in dist.get_process_group_ranks(group):
        flat = where[global_rank]
        coordinate = []
        for size in reversed(mesh.shape):
            coordinate.append(flat % size)
            flat //= size
        coordinates.append(tuple(reversed(coordinate)))
    return _MeshRanks(group, dist.get_rank(group), tuple(coordinates))


def _replicated_dims(fqn: str, param: DTensor) -> list[int]:
    """The mesh dims that replicate the matrix; refuses a placement that is not a shard or a
    replica (a pending partial sum)."""
    replicated = []
    for dim, placement in enumerate(param.placements):
        if isinstance(placement, Replicate):
            if param.device_mesh.size(dim) > 1:
                replicated.append(dim)
        elif not (isinstance(placement, Shard) or compat.is_strided_shard(placement)):
            raise MatrixLayoutError(
                f"sharded matrix {fqn!r} has placement {placement} on mesh dim {dim}: Muon needs its gradient "
                "reduced (Shard or Replicate), not a partial sum"
            )
    return replicated


def _blocks(fqn: str, param: DTensor, ranks: _MeshRanks) -> tuple[Block, ...]:
    """Every group rank's piece, by DTensor's local shape and global offset; this rank's is
    checked against its local tensor and its own mesh coordinate."""
    mesh, placements, shape = param.device_mesh, tuple(param.placements), tuple(param.shape)
    blocks = []
    for coordinate in ranks.coordinates:
        size, offset = compat.local_shape_and_offset(shape, tuple(mesh.shape), list(coordinate), placements)
        blocks.append(Block(int(offset[0]), int(size[0]), int(offset[1]), int(size[1])))
    mine = blocks[ranks.rank]
    own = mesh.get_coordinate()
    assert own is not None  # (a rank of the mesh: its parameter is a DTensor on it)
    size, offset = compat.local_shape_and_offset(shape, tuple(mesh.shape), list(own), placements)
    local = tuple(param.to_local().shape)
    if (mine.rows, mine.cols) != local or tuple(size) != local or (mine.row, mine.col) != tuple(offset):
        raise MatrixLayoutError(
            f"sharded matrix {fqn!r}: this rank holds {local}, DTensor says {tuple(size)} at {tuple(offset)}, "
            f"the plan {(mine.rows, mine.cols)} at {(mine.row, mine.col)}"
        )
    return tuple(blocks)


def _partition(spans: list[tuple[int, int]], total: int) -> bool:
    """Do sorted ``(start, length)`` spans cover ``[0, total)`` once, end to end?"""
    at = 0
    for start, length in spans:
        if start != at:
            return False
        at += length
    return at == total


def _check_tiling(fqn: str, shape: tuple[int, int], blocks: Sequence[Block]) -> None:
    """The pieces of one replica must be the blocks of a grid that covers the matrix once."""
    held = [b for b in blocks if b.numel]
    row_spans = sorted({(b.row, b.rows) for b in held})
    col_spans = sorted({(b.col, b.cols) for b in held})
    grid = {(b.row, b.rows, b.col, b.cols) for b in held}
    covers = (
        _partition(row_spans, shape[0])
        and _partition(col_spans, shape[1])
        and len(grid) == len(held) == len(row_spans) * len(col_spans)
    )
    if not covers and shape[0] * shape[1]:
        raise MatrixLayoutError(
            f"sharded matrix {fqn!r} of shape {shape}: its pieces {sorted(grid)} do not tile it as blocks "
            "(a layout whose pieces are not blocks of rows and columns is not handled)"
        )


def plan_matrices(matrices: Sequence[tuple[str, torch.Tensor]]) -> dict[str, MatrixPlan]:
    """Plans for every sharded matrix of a model, keyed in the order given (the model's).

    Local: every rank computes the same homes from the same layouts. Homes are balanced by
    Newton-Schulz cost over all the matrices of one mesh, the costliest placed first (each to
    the least loaded rank, ties to the lowest), so no home carries more than one matrix's
    cost above another.
    """
    meshes: dict[tuple, _MeshRanks] = {}
    loads: dict[tuple, list[int]] = {}
    plans: dict[str, MatrixPlan] = {}
    for fqn, param in matrices:
        if param.ndim != 2:
            raise MatrixLayoutError(f"sharded matrix {fqn!r} has shape {tuple(param.shape)}; a matrix is 2-D")
    order = sorted(range(len(matrices)), key=lambda i: -newton_schulz_cost(*matrices[i][1].shape))
    for i in order:
        fqn, param = matrices[i]
        shape = (int(param.shape[0]), int(param.shape[1]))
        if not isinstance(param, DTensor):
            plans[fqn] = MatrixPlan(fqn, shape)
            continue
        mesh = param.device_mesh
        replicated = _replicated_dims(fqn, param)
        key = mesh_key(mesh)
        if key not in meshes:
            meshes[key] = _mesh_ranks(mesh)
            loads[key] = [0] * len(meshes[key].coordinates)
        ranks = meshes[key]
        blocks = _blocks(fqn, param, ranks)
        home = spread_homes(1, newton_schulz_cost(*shape), loads[key])[0]
        home_at = ranks.coordinates[home]
        sources = frozenset(g for g, at in enumerate(ranks.coordinates) if all(at[d] == home_at[d] for d in replicated))
        _check_tiling(fqn, shape, [blocks[g] for g in sorted(sources)])
        plans[fqn] = MatrixPlan(fqn, shape, ranks.group, ranks.rank, home, blocks, sources)
    return {fqn: plans[fqn] for fqn, _ in matrices}


# ---------------------------------------------------------------------------------------------
# the update
# ---------------------------------------------------------------------------------------------
def _to_homes(bucket: list[tuple[int, MatrixPlan, torch.Tensor]]) -> dict[int, torch.Tensor]:
    """One collective over the bucket's group: every matrix homed here, assembled whole."""
    first = bucket[0][1]
    size, me = len(first.blocks), first.rank
    sends: list[list[torch.Tensor]] = [[] for _ in range(size)]
    expected: list[list[tuple[int, Block]]] = [[] for _ in range(size)]  # from each source
    for i, plan, local in bucket:
        if me in plan.sources:
            sends[plan.home].append(local.reshape(-1))
        if plan.home == me:
            for source in sorted(plan.sources):
                expected[source].append((i, plan.blocks[source]))
    sample = bucket[0][2]
    send = torch.cat([t for parts in sends for t in parts]) if any(sends) else sample.new_empty(0)
    in_sizes = [sum(t.numel() for t in parts) for parts in sends]
    out_sizes = [sum(b.numel for _, b in parts) for parts in expected]
    received = sample.new_empty(sum(out_sizes))
    dist.all_to_all_single(received, send.contiguous(), out_sizes, in_sizes, group=first.group)
    wholes: dict[int, torch.Tensor] = {}
    shapes = {i: plan.shape for i, plan, _ in bucket if plan.home == me}
    for i, shape in shapes.items():
        wholes[i] = sample.new_empty(shape)
    for parts, data in zip(expected, received.split(out_sizes)):
        for (i, block), piece in zip(parts, data.split([b.numel for _, b in parts])):
            block.of(wholes[i]).copy_(piece.view(block.rows, block.cols))
    return wholes


def _from_homes(bucket: list[tuple[int, MatrixPlan, torch.Tensor]], done: dict[int, torch.Tensor]) -> dict:
    """One collective over the bucket's group: this rank's piece of every result, from its home."""
    first = bucket[0][1]
    size, me = len(first.blocks), first.rank
    sends: list[list[torch.Tensor]] = [[] for _ in range(size)]
    expected: list[list[int]] = [[] for _ in range(size)]  # from each home
    for i, plan, _ in bucket:
        if plan.home == me:
            for dest in range(size):
                sends[dest].append(plan.blocks[dest].of(done[i]).reshape(-1))
        expected[plan.home].append(i)
    sample = bucket[0][2]
    send = torch.cat([t for parts in sends for t in parts]) if any(sends) else sample.new_empty(0)
    in_sizes = [sum(t.numel() for t in parts) for parts in sends]
    mine = {i: plan.blocks[me] for i, plan, _ in bucket}
    out_sizes = [sum(mine[i].numel for i in parts) for parts in expected]
    received = sample.new_empty(sum(out_sizes))
    dist.all_to_all_single(received, send.contiguous(), out_sizes, in_sizes, group=first.group)
    pieces: dict[int, torch.Tensor] = {}
    for parts, data in zip(expected, received.split(out_sizes)):
        for i, piece in zip(parts, data.split([mine[i].numel for i in parts])):
            pieces[i] = piece.view(mine[i].rows, mine[i].cols)
    return pieces


def orthogonalize_matrices(updates: Sequence[tuple[MatrixPlan, torch.Tensor]], steps: int) -> list[torch.Tensor]:
    """Orthogonalise every sharded matrix once in the job, each on its home, batched by shape.

    ``updates``: each matrix's plan with this rank's piece of its update (the local tensor of
    the DTensor). Returns, in the same order, this rank's pieces of the orthogonalised
    matrices, unscaled. Collective over each plan's group, two ``all_to_all_single`` per group
    and dtype; every rank of those groups must call it with the same matrices in the same order.
    """
    buckets: dict[tuple, list[tuple[int, MatrixPlan, torch.Tensor]]] = defaultdict(list)
    wholes: dict[int, torch.Tensor] = {}
    for i, (plan, local) in enumerate(updates):
        if plan.group is None:
            wholes[i] = local
        else:
            buckets[(id(plan.group), local.dtype)].append((i, plan, local))
    for bucket in buckets.values():
        wholes.update(_to_homes(bucket))
    by_shape: dict[tuple, list[int]] = defaultdict(list)
    for i in sorted(wholes):
        by_shape[(tuple(wholes[i].shape), wholes[i].dtype)].append(i)
    done: dict[int, torch.Tensor] = {}
    for index in by_shape.values():
        batch = orthogonalize(torch.stack([wholes[i] for i in index]), steps)
        done.update(zip(index, batch.unbind(0)))
    out: dict[int, torch.Tensor] = {i: done[i] for i, (plan, _) in enumerate(updates) if plan.group is None}
    for bucket in buckets.values():
        out.update(_from_homes(bucket, done))
    return [out[i] for i in range(len(updates))]
