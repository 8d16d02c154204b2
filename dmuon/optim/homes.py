"""Where a matrix's Muon update runs when no single rank holds it whole: balanced homes.

Expert stacks cut across ranks (``expert_stacks.py``) and matrices left sharded by tensor
parallelism (``sharded_matrices.py``) both pick, for each matrix, one rank among those holding
its pieces to assemble and orthogonalise it. Both balance the same quantity, the
Newton-Schulz work a rank is given, so that the slowest rank of the step does as little as
the layout allows.
"""

from __future__ import annotations

from typing import Any

__all__ = ["mesh_key", "newton_schulz_cost", "spread_homes"]


def mesh_key(mesh: Any) -> tuple:
    """A device mesh by its shape and ranks, not its object: the balance of homes is kept per
    set of ranks, and each ``fully_shard`` call (under expert or tensor parallelism) holds a
    mesh object of its own; keyed by object, the balance would start afresh at every layer,
    every layer's first matrix homed on the same rank."""
    return tuple(mesh.shape), tuple(mesh.mesh.flatten().tolist())


def newton_schulz_cost(rows: int, cols: int) -> int:
    """Relative cost of orthogonalising one matrix: its Gram products, ``small^2 * large``."""
    small, large = min(rows, cols), max(rows, cols)
    return small * small * large


def spread_homes(count: int, cost: int, loads: list[int]) -> list[int]:
    """Homes for ``count`` equal items: each to the least loaded member, ties to the lowest.

    ``loads`` is updated: it carries the balance across the matrices that share the members.
    """
    homes = []
    for _ in range(count):
        member = min(range(len(loads)), key=lambda m: (loads[m], m))
        loads[member] += cost
        homes.append(member)
    return homes
