"""Which node each rank runs on, who replicates to whom, and the process groups the tiers use.

A node-local tier lives on one machine's disk, so the tiers need to know which ranks share a
machine. torchrun says so in ``GROUP_RANK`` (the node's rank in the job); without it, ranks
on one host are one node. Nodes form a ring in the order of their ids: each node replicates
its files to the next one, each rank to the rank with the same position on that node.

:class:`TierGroups` holds two transports (``transport.py``), each over a gloo group of the job's
ranks, both created at once by every rank (a collective): ``control`` for the main thread's few
small rounds (agreeing on a restore, on a preemption, sharing a manifest) and ``background``
for the replication and promotion thread, so the two never interleave on one group, and neither touches the training
group (which may be NCCL: the tiers move CPU bytes).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any, cast

import torch.distributed as dist

from ..group_transport import GroupTransport, SingleProcess
from ..node_identity import this_node
from ..transport import Transport

__all__ = ["NodeLayout", "TierGroups", "discover_nodes"]


@dataclass(frozen=True)
class NodeLayout:
    """The node of every rank of the job, seen from ``rank``."""

    node_of_rank: tuple[int, ...]
    rank: int

    @property
    def node(self) -> int:
        return self.node_of_rank[self.rank]

    @property
    def nodes(self) -> list[int]:
        return sorted(set(self.node_of_rank))

    def ranks_on(self, node: int) -> list[int]:
        return [r for r, n in enumerate(self.node_of_rank) if n == node]

    def leader(self, node: int) -> int:
        """The rank that does a node's one-per-node work (its lowest)."""
        return self.ranks_on(node)[0]

    @property
    def is_leader(self) -> bool:
        return self.leader(self.node) == self.rank

    def next_node(self, node: int, hops: int = 1) -> int:
        nodes = self.nodes
        return nodes[(nodes.index(node) + hops) % len(nodes)]

    def replica_target(self, rank: int) -> int | None:
        """The rank that keeps ``rank``'s files (same position, next node); None on one node."""
        if len(self.nodes) < 2:
            return None
        node = self.node_of_rank[rank]
        return self.ranks_on(self.next_node(node))[self.ranks_on(node).index(rank)]

    def replica_source(self, rank: int) -> int | None:
        """The rank whose files ``rank`` keeps (same position, previous node)."""
        if len(self.nodes) < 2:
            return None
        node = self.node_of_rank[rank]
        return self.ranks_on(self.next_node(node, -1))[self.ranks_on(node).index(rank)]


class TierGroups:
    """The tiers' two transports, each over a gloo group of its own (see the module docstring);
    single-process transports without a process group."""

    def __init__(self, timeout: timedelta | None = None) -> None:
        distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if distributed else 0
        self.world_size = dist.get_world_size() if distributed else 1
        kwargs: dict[str, Any] = {"backend": "gloo"}
        if timeout is not None:
            kwargs["timeout"] = timeout
        # every rank is a member of both groups (torch 2.14 types new_group's result as
        # ProcessGroup | NON_GROUP_MEMBER, which only a non-member gets)
        self.control: Transport = self._transport(distributed, kwargs)
        self.background: Transport = self._transport(distributed, kwargs)

    @staticmethod
    def _transport(distributed: bool, kwargs: dict[str, Any]) -> Transport:
        if not distributed:
            return SingleProcess()
        return GroupTransport(cast(dist.ProcessGroup, dist.new_group(**kwargs)))


def discover_nodes(groups: TierGroups, node_rank: int | None = None) -> NodeLayout:
    """Collective: every rank's node. ``node_rank``: this rank's node, else torchrun's
    ``GROUP_RANK``, else its host (ranks on one host are one node). Nodes with unequal rank
    counts are refused when replicating needs a partner for every rank."""
    mine: Any = node_rank if node_rank is not None else this_node()
    gathered = groups.control.share(mine)
    if all(isinstance(n, int) for n in gathered):
        node_of_rank = tuple(int(n) for n in gathered)
    elif any(isinstance(n, int) for n in gathered):
        raise ValueError(f"some ranks were given a node_rank and others not: {gathered}")
    else:
        hosts = sorted(set(gathered))
        node_of_rank = tuple(hosts.index(h) for h in gathered)
    layout = NodeLayout(node_of_rank, groups.rank)
    counts = {node: len(layout.ranks_on(node)) for node in layout.nodes}
    if len(set(counts.values())) > 1:
        raise ValueError(
            f"the nodes of this job have different numbers of ranks ({counts}): replicating each rank's "
            "files to a partner on the next node needs the same number on every node"
        )
    return layout
