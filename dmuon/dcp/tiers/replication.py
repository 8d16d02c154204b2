"""A node's part of a local checkpoint, copied to the next node's local tier.

After a local save commits, every rank sends its own data file to its partner on the next
node (same position in the node, :meth:`NodeLayout.replica_target`) and receives its
partner's from the previous node, at the same time, over the background gloo group. A
received file is written under a temporary name, verified against the manifest's checksums
(the ones the save computed), fsynced and only then renamed into ``peer-<node>/step-<N>``:
a file is there whole and verified, or not at all, so a kill at any moment leaves nothing
that a restore would count on. When every rank's file arrived, each node's leader writes the
manifest and ``.metadata`` beside them.
"""

from __future__ import annotations

import contextlib
import os

from ..errors import StorageError
from ..format.layout import data_file_of
from ..format.verified_read import verify_stream
from .local import CommitCopy, LocalTier
from .nodes import NodeLayout, TierGroups
from .transfer import DEFAULT_CHUNK_BYTES, Incoming, Outgoing, exchange

__all__ = ["replicate_step"]


def replicate_step(
    groups: TierGroups,
    layout: NodeLayout,
    tier: LocalTier,
    step: int,
    commit: CommitCopy,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> int:
    """Collective on the background group. Returns the bytes this rank received; raises
    :class:`StorageError` on every rank (naming each rank's problem) if any file did not
    arrive whole; the files that did stay, each verified."""
    rank = layout.rank
    target, source = layout.replica_target(rank), layout.replica_source(rank)
    if target is None or source is None:
        return 0
    manifest = commit.manifest()
    mine, theirs = data_file_of(rank, manifest.files), data_file_of(source, manifest.files)
    send = recv = None
    if mine in manifest.files:
        send = Outgoing(target, os.path.join(tier.step_dir(step), mine), [(0, manifest.files[mine].size)])
    source_dir = tier.peer_step_dir(layout.node_of_rank[source], step)
    if theirs in manifest.files:
        size = manifest.files[theirs].size
        recv = Incoming(source, tier.incoming_path(source_dir, theirs), [(0, size)], size)
    exchange(groups.background.group, send, recv, chunk_bytes)
    problem = send.error if send is not None else None
    if recv is not None:
        problem = problem or _settle(recv, theirs, commit)
    groups.background.settle(problem, f"replicating step {step} to the next node failed", StorageError)
    if layout.is_leader:
        LocalTier.write_commit_copy(source_dir, commit)
    return recv.bytes_received if recv is not None else 0


def _settle(recv: Incoming, name: str, commit: CommitCopy) -> str | None:
    """Verify a received file and move it into place; or remove it and say why."""
    problem = recv.error
    if problem is None:
        manifest = commit.manifest()
        with open(recv.path, "rb") as stream:
            found = verify_stream(stream, name, manifest.files[name], manifest.checksum, save_id=manifest.save_id)
        if found is not None:
            problem = f"{name} from rank {recv.peer} arrived damaged: {found}"
    if problem is None:
        try:
            LocalTier.settle(recv.path, name)
        except OSError as exc:
            problem = f"moving {recv.path} into place: {exc}"
    if problem is not None:
        with contextlib.suppress(OSError):
            os.remove(recv.path)
    return problem
