"""Which machine a rank runs on, as the checkpoint backend sees it.

Two features depend on it: the tiers (a node's local files are replicated to another node) and
a cooperative load from a local path (ranks of one machine share its page cache, so only ranks
on different machines gain from exchanging what they read). torchrun says which node a rank is
on in ``GROUP_RANK``; without it, ranks on one host are one node.
"""

from __future__ import annotations

import os
import socket
import zlib

__all__ = ["NODE_RANK_ENV", "node_number", "this_node"]

#: torchrun's name for the node's rank in the job.
NODE_RANK_ENV = "GROUP_RANK"


def this_node() -> int | str:
    """This rank's node: torchrun's node rank where it is set, else the host name."""
    value = os.environ.get(NODE_RANK_ENV, "")
    return int(value) if value.isdigit() else socket.gethostname()


def node_number() -> int:
    """:func:`this_node` as a non-negative number, for rounds that carry numbers only."""
    return zlib.crc32(str(this_node()).encode())
