"""Owner assignment for dedicated parameters.

Pure functions, no process groups: every rank calls :func:`assign_owners` with the same inputs and
gets the same map, so no communication is needed to agree on owners.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Sequence

__all__ = ["assign_owners", "layer_key", "owned_bytes_per_slot"]

Slot = tuple[int, int]  # (replicate_rank, shard_rank)

_INDEX = re.compile(r"^\d+$")


def layer_key(fqn: str) -> str:
    """The layer a parameter belongs to, used to spread one layer's matrices over owners.

    The FQN up to its first integer component (``layers.3.attn.q.weight`` -> ``layers.3``), so
    all matrices of one transformer block count as one layer; without an index, the module path.
    """
    parts = fqn.split(".")
    for i, part in enumerate(parts):
        if _INDEX.match(part):
            return ".".join(parts[: i + 1])
    return ".".join(parts[:-1])


def assign_owners(sizes: Sequence[tuple[str, int]], replicate_size: int, shard_size: int) -> dict[str, Slot]:
    """Greedy longest-processing-time assignment of parameters to (replicate, shard) slots.

    ``sizes`` lists ``(fqn, cost)`` in a rank-independent order (the model's parameter order).
    Largest first, each parameter goes to the least loaded slot; among equally loaded slots, the
    one holding the fewest parameters of the same layer, then the lowest slot index. Slots are
    numbered replicate-major, so ties fill different shard columns before a second replica.
    The result is deterministic: ties never depend on hashing or dict order.
    """
    if replicate_size < 1 or shard_size < 1:
        raise ValueError(f"mesh sizes must be >= 1, got replicate={replicate_size}, shard={shard_size}")
    fqns = [fqn for fqn, _ in sizes]
    if len(set(fqns)) != len(fqns):
        raise ValueError("assign_owners: duplicate FQNs in the input")
    n_slots = replicate_size * shard_size
    load = [0] * n_slots
    per_layer: list[dict[str, int]] = [defaultdict(int) for _ in range(n_slots)]
    order = sorted(range(len(sizes)), key=lambda i: (-sizes[i][1], i))
    owners: dict[str, Slot] = {}
    for i in order:
        fqn, cost = sizes[i]
        layer = layer_key(fqn)
        slot = min(range(n_slots), key=lambda k: (load[k], per_layer[k][layer], k))
        load[slot] += cost
        per_layer[slot][layer] += 1
        owners[fqn] = (slot // shard_size, slot % shard_size)
    return {fqn: owners[fqn] for fqn in fqns}


def owned_bytes_per_slot(
    owners: dict[str, Slot], nbytes: dict[str, int], replicate_size: int, shard_size: int
) -> list[int]:
    """Bytes of master copies each slot computes, replicate-major; for balance reports."""
    totals = [0] * (replicate_size * shard_size)
    for fqn, (r, s) in owners.items():
        totals[r * shard_size + s] += nbytes[fqn]
    return totals
