"""Restore from the tiers: the newest step complete somewhere, all ranks agreeing, bytes verified.

1. Every node says what it holds (:meth:`LocalTier.holdings`: whole data files per step, and
   the commits it has); rank 0 lists the persistent tier's committed steps. All ranks see the
   same lists and pick the same candidates (:func:`choose_candidates`): newest step first, a
   step complete in the local tier (every data file of its manifest whole on some node)
   before the same step in the persistent tier.
2. A local candidate is assembled on every node in ``<root>/restore-view/``: links to the
   files the node holds, and for files it lacks a sparse file holding exactly the byte
   ranges its ranks will read (found by planning the load, :func:`planned_reads`), fetched
   from the nearest node that holds them, over the control group. Then it loads like any
   checkpoint (``api.load``): every byte read is checked against the manifest's checksums,
   and a range that was never fetched can only fail that check, never load. Each rank reads its
   own plan there (not cooperatively: the bytes are on its node's disk already).
3. A candidate whose bytes are at fault (incomplete, corrupt, unreachable) is skipped for the
   next one, on every rank; an unsafe checkpoint or a wrong model is raised at once.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections import defaultdict
from dataclasses import dataclass, field

from torch import nn
from torch.distributed.checkpoint.metadata import Metadata

from ...optim.muon import Muon
from .. import api
from ..errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointIncompleteError,
    CheckpointMismatchError,
    NoLoadableCheckpointError,
    UnsafeCheckpointError,
)
from ..format.layout import METADATA
from ..format.safe_metadata import load_metadata_bytes
from ..load_planner import DMuonLoadPlanner
from ..manager import CheckpointManager
from ..operation import load_state
from ..storage.local import LocalStore
from .local import CommitCopy, Holdings, LocalTier
from .nodes import NodeLayout, TierGroups
from .transfer import DEFAULT_CHUNK_BYTES, Incoming, Outgoing, exchange, merge_ranges

__all__ = ["LOCAL", "PERSISTENT", "Candidate", "RestoreReport", "choose_candidates", "planned_reads", "restore"]

log = logging.getLogger(__name__)

LOCAL = "local"
PERSISTENT = "persistent"


@dataclass(frozen=True)
class Candidate:
    """A step a restore may load: from the local tier (one save of it, complete across the
    nodes) or from the persistent tier."""

    step: int
    source: str
    save_id: str | None = None
    files: dict[str, int] = field(default_factory=dict)  # data file -> size (local only)
    holders: dict[str, list[int]] = field(default_factory=dict)  # data file -> nodes with it whole
    commit_node: int | None = None  # the lowest node holding the manifest and .metadata


@dataclass
class RestoreReport:
    """What a restore did. ``step``, ``source`` and ``skipped`` are the same on every rank
    (every rank agrees on each candidate); ``fetched_bytes`` and ``seconds`` are this rank's."""

    step: int | None = None
    source: str | None = None  # LOCAL or PERSISTENT
    fetched_bytes: int = 0  # received from other nodes by this rank
    skipped: list[str] = field(default_factory=list)  # candidates tried first, and why they failed
    seconds: float = 0.0  # this rank's wall time in the restore


@dataclass
class TierContext:
    """What a restore needs of the manager."""

    groups: TierGroups
    layout: NodeLayout
    tier: LocalTier
    persistent: CheckpointManager | None
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    cast_dtypes: bool = False  # load floating-point entries stored in another dtype, cast


def choose_candidates(holdings: list[Holdings], persistent_steps: list[int]) -> list[Candidate]:
    """Every loadable choice, best first (the same on every rank: a pure function of what the
    nodes reported)."""
    commits: dict[tuple[int, str], tuple[dict[str, int], list[int]]] = {}
    for held in sorted(holdings, key=lambda h: h.node):
        for step, records in held.commits.items():
            for record in records:
                files, nodes = commits.setdefault((step, record.save_id), (record.files, []))
                nodes.append(held.node)
    local: dict[int, list[Candidate]] = defaultdict(list)
    for (step, save_id), (files, commit_nodes) in sorted(commits.items()):
        holders = {
            name: [h.node for h in sorted(holdings, key=lambda h: h.node) if h.files.get(step, {}).get(name) == size]
            for name, size in files.items()
        }
        if all(holders.values()):
            local[step].append(Candidate(step, LOCAL, save_id, dict(files), holders, min(commit_nodes)))
    out: list[Candidate] = []
    for step in sorted(set(local) | set(persistent_steps), reverse=True):
        out += local.get(step, [])
        if step in persistent_steps:
            out.append(Candidate(step, PERSISTENT))
    return out


def planned_reads(
    model: nn.Module, optimizer: Muon | None, metadata: Metadata, cast_dtypes: bool = False
) -> dict[str, list[tuple[int, int]]]:
    """The byte ranges, per data file, that loading ``metadata``'s checkpoint into this rank's
    model and optimizer reads: the load is planned (as ``api.load`` plans it), not run."""
    _, state = load_state(model, optimizer, metadata)
    planner = DMuonLoadPlanner(cast_dtypes=cast_dtypes)
    planner.set_up_planner(state, metadata, False)
    reads: dict[str, list[tuple[int, int]]] = defaultdict(list)
    for item in planner.create_local_plan().items:
        info = metadata.storage_data[item.storage_index]
        reads[info.relative_path].append((info.offset, info.length))
    return dict(reads)


@dataclass(frozen=True)
class _Fetch:
    name: str
    src: int
    dst: int
    ranges: list[tuple[int, int]]
    size: int


def _plan_fetches(
    candidate: Candidate, layout: NodeLayout, reads: list[dict], trailers: dict[str, tuple[int, int]]
) -> list[_Fetch]:
    """Which rank sends which ranges to which: for each node, the ranges its ranks read from
    files it does not hold, and each such file's checksum trailer (``trailers``: file ->
    (offset, length); a reader reads it first), from the nearest holder after it in the ring
    (spread over the ranks of both nodes)."""
    nodes = layout.nodes
    per_node: dict[int, dict[str, list]] = defaultdict(lambda: defaultdict(list))
    for rank, rank_reads in enumerate(reads):
        for name, ranges in rank_reads.items():
            per_node[layout.node_of_rank[rank]][name] += ranges
    fetches: list[_Fetch] = []
    for node in nodes:
        for name in sorted(per_node[node]):
            holders = candidate.holders.get(name)
            if holders is None:
                raise CheckpointCorruptError(f"step {candidate.step}: {name} is read but not in its manifest")
            if node in holders:
                continue
            holder = min(holders, key=lambda h: (nodes.index(h) - nodes.index(node)) % len(nodes))
            senders, receivers = layout.ranks_on(holder), layout.ranks_on(node)
            k = len(fetches)
            fetches.append(
                _Fetch(
                    name,
                    senders[k % len(senders)],
                    receivers[k % len(receivers)],
                    merge_ranges(per_node[node][name] + ([trailers[name]] if name in trailers else [])),
                    candidate.files[name],
                )
            )
    return fetches


def _build_view(view: str, candidate: Candidate, held: Holdings, copy: CommitCopy) -> None:
    """The step as one directory on this node: links to whole files held here, sparse files
    (filled by the fetches, or never read) for the rest, then the manifest and .metadata."""
    shutil.rmtree(view, ignore_errors=True)
    os.makedirs(view)
    for name, size in candidate.files.items():
        path = held.paths.get((candidate.step, name))
        if path is not None and held.files[candidate.step].get(name) == size:
            os.symlink(path, os.path.join(view, name))
        else:
            with open(os.path.join(view, name), "wb") as f:
                f.truncate(size)
    store = LocalStore(view)
    store.put(copy.manifest_name, copy.manifest_bytes)
    store.put(METADATA, copy.metadata_bytes)


def _restore_local(ctx: TierContext, candidate: Candidate, held: Holdings, model, optimizer, report) -> dict:
    groups, layout, tier = ctx.groups, ctx.layout, ctx.tier
    step = candidate.step
    assert candidate.commit_node is not None and candidate.save_id is not None
    source = layout.leader(candidate.commit_node)
    key = (step, candidate.save_id)
    copy = groups.control.decided(
        lambda: tier.read_commit_copy(held.commit_dirs[key]),
        source,
        f"step {step}: the commit on node {candidate.commit_node} is unreadable",
        CheckpointCorruptError,
    )
    metadata = load_metadata_bytes(copy.metadata_bytes, f"step {step} ({LOCAL} tier)")
    mine: CheckpointError | None = None
    try:
        reads = planned_reads(model, optimizer, metadata, ctx.cast_dtypes)
    except CheckpointError as exc:  # a wrong model: every rank finds the same problems
        reads, mine = {}, exc
    groups.control.settle(mine, f"step {step} does not fit the model", CheckpointMismatchError)
    manifest = copy.manifest()
    trailers = {
        name: (stats.sums_at, stats.size - stats.sums_at)
        for name, stats in manifest.files.items()
        if stats.sums_at is not None
    }
    fetches = _plan_fetches(candidate, layout, groups.control.share(reads), trailers)
    view = tier.view_dir()
    if layout.is_leader:
        _build_view(view, candidate, held, copy)
    groups.control.barrier()
    try:
        problem = None
        for fetch in fetches:
            if layout.rank == fetch.src:
                out = Outgoing(fetch.dst, held.paths[(step, fetch.name)], fetch.ranges)
                exchange(groups.control.group, send=out, chunk_bytes=ctx.chunk_bytes)
                problem = problem or out.error
            elif layout.rank == fetch.dst:
                inc = Incoming(fetch.src, os.path.join(view, fetch.name), fetch.ranges, fetch.size)
                exchange(groups.control.group, recv=inc, chunk_bytes=ctx.chunk_bytes)
                report.fetched_bytes += inc.bytes_received
                problem = problem or inc.error
        groups.control.settle(problem, f"step {step}: fetching from other nodes failed", CheckpointIncompleteError)
        # each rank reads its own plan from its node's view: a cooperative load would have one
        # rank read a region for others on other nodes, sending over the network bytes that
        # are already on their own disks (it pays off against object storage, not here)
        return api.load(model, optimizer, view, cooperative=False, cast_dtypes=ctx.cast_dtypes)
    finally:
        groups.control.barrier()
        if layout.is_leader:
            shutil.rmtree(view, ignore_errors=True)


def restore(ctx: TierContext, model: nn.Module, optimizer: Muon | None) -> tuple[RestoreReport, dict]:
    """Collective: load the newest loadable step of any tier. Returns the report (its ``step``
    None when no tier holds anything) and the checkpoint's ``extra``."""
    started = time.monotonic()
    groups, layout = ctx.groups, ctx.layout
    held = ctx.tier.holdings(layout.node)
    summaries: dict[int, Holdings] = {}
    for summary in groups.control.share(held.summary()):
        summaries.setdefault(summary.node, summary)
    persistent_steps: list[int] = []
    if layout.rank == 0 and ctx.persistent is not None:
        try:
            persistent_steps = ctx.persistent.steps()
        except (CheckpointError, OSError) as exc:  # the local tier may still do
            log.warning("listing the persistent tier %s failed: %s", ctx.persistent.root, exc)
    persistent_steps = groups.control.broadcast(persistent_steps, 0)
    report = RestoreReport()
    for candidate in choose_candidates(list(summaries.values()), persistent_steps):
        try:
            if candidate.source == LOCAL:
                extra = _restore_local(ctx, candidate, held, model, optimizer, report)
            else:
                assert ctx.persistent is not None
                path = ctx.persistent.path(candidate.step)
                extra = api.load(
                    model, optimizer, path, storage_options=ctx.persistent.storage_options, cast_dtypes=ctx.cast_dtypes
                )
        except UnsafeCheckpointError:
            raise
        except (CheckpointCorruptError, CheckpointIncompleteError) as exc:
            log.warning("restore: skipping step %d from the %s tier: %s", candidate.step, candidate.source, exc)
            report.skipped.append(f"step {candidate.step} ({candidate.source}): {exc}")
            continue
        report.step, report.source = candidate.step, candidate.source
        report.seconds = time.monotonic() - started
        return report, extra
    if report.skipped:
        raise NoLoadableCheckpointError(report.skipped)
    report.seconds = time.monotonic() - started
    return report, {}
