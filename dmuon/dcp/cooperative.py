"""Cooperative restore: a region several ranks need is read from storage by one of them and
sent to the others over the process group.

Under HSDP every replica group needs the same shards, and every rank of a dedicated weight's
shard column needs the whole weight: with a plain per-rank read, a job of R replicas reads the
checkpoint R times from S3 or GCS. A restart then costs R times the bytes and, when the store's
bandwidth is the limit, R times the wall time. Here the read items that several ranks request
for exactly the same stored region (same item, same offsets and lengths: identical copies) get
one reader each, chosen to balance bytes across ranks (what a rank must read anyway counts),
and the others receive them. Ranks then read what they were given -- verifying every byte
against its checksum, as always -- and exchange the shared regions point to point.

Who finds the shared regions: under HSDP, the ranks of each replica group among themselves
(``replica_reads.py``: all-reduces over the group whose width the checkpoint sets, and the same
assignment computed on each member), so no plan travels anywhere and what a rank sends and
receives does not grow with the job (dmuon's own load, ``load_protocol.run_load``). Under
torch's ``dcp.load``, or where the tensors lie on several meshes, the coordinator, which sees
every rank's plan (:func:`assign_readers`).

The exchange itself, and how a failed read stays loud, are in ``cooperative_exchange.py``.

Objects (non-tensor items: step counters, hyper-parameters) are small and read by every rank
that needs them.

Ranks of one machine loading from a local path (a local disk, or a network filesystem mounted
there) do not exchange by default: the machine's page cache already serves a region to its
second reader, and sending it over the process group instead made a 2x2 HSDP load of one
machine 1.3x slower (benchmarks/cooperative_restore.py). Only ranks on other machines receive
it from the rank that read it. From object storage every rank's read is a request of its own,
so there all ranks that want a region share one read.

The setting (:func:`cooperative_setting`): ``cooperative=False`` on the reader, or
``DMUON_COOPERATIVE_LOAD=0``, turns the whole thing off (every rank reads for itself, as torch's
readers do); ``True`` (or ``DMUON_COOPERATIVE_LOAD=1``) shares between every pair of ranks,
machines notwithstanding; unset is the behaviour above.
"""

from __future__ import annotations

import heapq
import os
from collections import defaultdict
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

from .format.layout import rank_of_data_file
from .transport import Transport

__all__ = [
    "COOPERATIVE_ENV",
    "RankShare",
    "ReadRequest",
    "ReaderRule",
    "Transfer",
    "assign_readers",
    "cooperative_setting",
    "read_requests",
    "share_of",
    "stored_dtypes",
    "with_share",
]

COOPERATIVE_ENV = "DMUON_COOPERATIVE_LOAD"
_PLAN_KEY = "dmuon_cooperative"  # where a rank's part of the assignment travels in its LoadPlan
# How far above the least loaded rank a region's reader may be when it also read the region just
# before it in the same file: small neighbours go in one request from one rank.
STICKY_BYTES = 8 << 20


def cooperative_setting(requested: bool | None) -> bool | None:
    """The reader's setting, else the environment's: False (off), True (between every pair of
    ranks) or None (the default: between ranks of different machines on a local path, between
    all ranks on object storage)."""
    if requested is not None:
        return requested
    value = os.environ.get(COOPERATIVE_ENV, "").strip().lower()
    if value in ("0", "false", "no", "off"):
        return False
    if value in ("1", "true", "yes", "on"):
        return True
    return None


@dataclass(frozen=True)
class Transfer:
    """One shared region: read by ``source`` (a rank of the load's group), sent to ``targets``."""

    tag: int  # its place in the job-wide order of transfers (both sides post them in this order)
    source: int
    targets: tuple[int, ...]


@dataclass
class RankShare:
    """What one rank does about shared regions: items it reads and sends, items it receives."""

    sends: dict[int, Transfer] = field(default_factory=dict)  # index in the rank's plan -> transfer
    receives: dict[int, Transfer] = field(default_factory=dict)
    #: the transport of the replica group the transfers' ranks are numbered in and travel over
    #: (``replica_reads.share_among_replicas``); None: the load's own (the coordinator's)
    replicas: Transport | None = None


def stored_dtypes(metadata: Metadata) -> dict[str, torch.dtype]:
    """Each stored tensor's dtype, by key (what a region's size is counted in)."""
    entries = metadata.state_dict_metadata
    return {fqn: md.properties.dtype for fqn, md in entries.items() if isinstance(md, TensorStorageMetadata)}


def _region(item: ReadItem) -> tuple:
    """What makes two ranks' read items identical copies: the stored item and the region of it."""
    index = item.storage_index
    return index.fqn, tuple(index.offset or ()), tuple(item.storage_offsets), tuple(item.lengths)


def _nbytes(item: ReadItem, dtypes: dict[str, torch.dtype]) -> int:
    size = 1
    for length in item.lengths:
        size *= length
    dtype = dtypes.get(item.storage_index.fqn)
    return size * (dtype.itemsize if dtype is not None else 1)


#: one tensor read of a rank's plan, as the assignment sees it:
#: (region, bytes, file, offset in the file, position in the plan)
ReadRequest = tuple[tuple, int, str, int, int]


def read_requests(plan: LoadPlan, dtypes: dict[str, torch.dtype], locations: dict[Any, Any]) -> list[ReadRequest]:
    out = []
    for position, item in enumerate(plan.items):
        if item.type != LoadItemType.BYTE_IO:
            where = locations[item.storage_index]
            out.append((_region(item), _nbytes(item, dtypes), where.relative_path, where.offset, position))
    return out


def with_share(plan: LoadPlan, share: RankShare) -> LoadPlan:
    data = dict(plan.storage_data) if isinstance(plan.storage_data, dict) else {}
    data[_PLAN_KEY] = share
    return LoadPlan(plan.items, storage_data=data, planner_data=plan.planner_data)


def assign_readers(
    plans: list[LoadPlan],
    dtypes: dict[str, torch.dtype],
    locations: dict[Any, Any],
    nodes: Sequence[Hashable] | None = None,
) -> list[LoadPlan]:
    """The coordinator's step: one reader per region several ranks request; the plans back
    with each rank's share in ``storage_data``. ``dtypes``: stored dtype per key (for sizes);
    ``locations``: the metadata's storage data (file and offset of each stored item);
    ``nodes``: each rank's machine, where ranks of one machine should each read a region
    themselves (a local path: its page cache serves the second reader) and only ranks of
    other machines receive it; None: every rank that wants a region receives it.

    Balancing is greedy by bytes: regions only one rank needs count for that rank first. Then
    shared regions, in file order, go to whichever of their ranks has read the least so far --
    except that a region next to the previous one in the same file stays with that one's
    reader while it is within :data:`STICKY_BYTES` of the least loaded rank: neighbours then
    come in one request, not many small ones from several ranks. Deterministic (ties go to the
    lowest rank), so it is the same whoever runs it.
    """
    machines: Sequence[Hashable] = nodes if nodes is not None else range(len(plans))
    shares = _assign([read_requests(plan, dtypes, locations) for plan in plans], machines)
    if shares is None:
        return plans  # nothing shared: no rank exchanges anything, and no collective is added
    return [with_share(plan, share) for plan, share in zip(plans, shares)]


class ReaderRule:
    """:func:`assign_readers`' rule, one shared region at a time, in file order: the region goes
    to the least loaded of the ranks that want it (ties: the lowest), unless the reader of the
    region just before it in the same file wants it too and has read at most
    :data:`STICKY_BYTES` more (neighbours then come in one request from one rank). The
    coordinator (any ranks want a region) and each replica group (every member wants it,
    ``replica_reads.py``) both assign through it: the same rule in one place. ``load``: what
    each rank reads already; a heap of it finds the least loaded of all ranks in O(log R).

    ``writers``: the rank (numbered as ``load`` is) that wrote each data file, where one of
    them did, and ``regions``: every (file, bytes, wanting) the rule will be asked about. Each
    writer keeps the regions of its own file that it wants, up to its fair share of all the
    bytes (plus :data:`STICKY_BYTES`), before any balancing: on the topology that saved, each
    rank then reads its own file and few others (HSDP's replicas wrote their chunks spread
    over them, so the shares come out as balanced as the save was), where the balance alone,
    region by region, sent each member to every replica's file -- a request or more per file
    and member on object storage, as many files as replicas."""

    def __init__(
        self,
        load: list[int],
        writers: Mapping[str, int] | None = None,
        regions: Iterable[tuple[str, int, Sequence[int] | None]] = (),
    ) -> None:
        self.load = load
        self.writers = writers or {}
        self.reserve = self._reserves(regions) if self.writers else [0] * len(load)
        for rank, kept in enumerate(self.reserve):
            load[rank] += kept  # (committed from the start: the balance counts it)
        self._heap = [(nbytes, rank) for rank, nbytes in enumerate(load)]  # stale entries skipped
        heapq.heapify(self._heap)
        self._previous: tuple[str, int] | None = None  # (file, reader) of the region before

    def _reserves(self, regions: Iterable[tuple[str, int, Sequence[int] | None]]) -> list[int]:
        owned = [0] * len(self.load)
        total = sum(self.load)
        for file, nbytes, wanting in regions:
            total += nbytes
            writer = self.writers.get(file)
            if writer is not None and (wanting is None or writer in wanting):
                owned[writer] += nbytes
        fair = total // max(1, len(self.load)) + STICKY_BYTES
        return [max(0, min(own, fair - self.load[rank])) for rank, own in enumerate(owned)]

    def pick(self, file: str, wanting: Sequence[int] | None = None, nbytes: int = 0) -> int:
        """The reader of the next region, ``nbytes`` in ``file``, among ``wanting`` (sorted;
        None: all)."""
        writer = self.writers.get(file)
        if writer is not None and 0 < nbytes <= self.reserve[writer] and (wanting is None or writer in wanting):
            self.reserve[writer] -= nbytes
            self.load[writer] -= nbytes  # (counted from the start; ``charge`` counts it again)
            self._previous = (file, writer)
            return writer
        if wanting is None:
            while self._heap[0][0] != self.load[self._heap[0][1]]:
                heapq.heappop(self._heap)
            least = self._heap[0][1]
        else:
            least = min(wanting, key=lambda rank: (self.load[rank], rank))
        source = least
        previous = self._previous
        if previous is not None and previous[0] == file and (wanting is None or previous[1] in wanting):
            if self.load[previous[1]] <= self.load[least] + STICKY_BYTES:
                source = previous[1]
        self._previous = (file, source)
        return source

    def charge(self, rank: int, nbytes: int) -> None:
        """``rank`` reads ``nbytes`` more from storage."""
        self.load[rank] += nbytes
        heapq.heappush(self._heap, (self.load[rank], rank))


def _assign(requests: list[list[ReadRequest]], machine: Sequence[Hashable]) -> list[RankShare] | None:
    """:func:`assign_readers`' rule over every rank's requests (``machine``: each rank's);
    None where no region is shared."""
    wanted: dict[tuple, list[tuple[int, int]]] = defaultdict(list)  # region -> [(rank, position)]
    about: dict[tuple, tuple[int, str, int]] = {}  # region -> (bytes, file, offset)
    for rank, mine in enumerate(requests):
        for region, nbytes, file, offset, position in mine:
            wanted[region].append((rank, position))
            about.setdefault(region, (nbytes, file, offset))
    load = [0] * len(requests)
    shared = []
    for region, askers in wanted.items():
        nbytes, file, offset = about[region]
        if len({machine[rank] for rank, _ in askers}) == 1:
            for rank, _ in askers:
                load[rank] += nbytes
        else:
            shared.append(((file, offset, region), nbytes, askers))
    if not shared:
        return None
    shares = [RankShare() for _ in requests]
    shared.sort(key=lambda entry: entry[0])
    job = {rank: rank for rank in range(len(requests))}  # (the coordinator's plans: one per job rank)
    wanting = [sorted({rank for rank, _ in askers}) for _, _, askers in shared]
    regions = [(file, nbytes, ranks) for ((file, _, _), nbytes, _), ranks in zip(shared, wanting)]
    rule = ReaderRule(load, writers_of((file for file, _, _ in regions), job), regions)
    for tag, (((file, _, _), nbytes, askers), ranks) in enumerate(zip(shared, wanting)):
        source = rule.pick(file, ranks, nbytes)
        # the reader's machine mates read it themselves, from their page cache (``nodes``)
        mates = {rank for rank in ranks if rank != source and machine[rank] == machine[source]}
        for rank in (source, *mates):
            rule.charge(rank, nbytes)
        transfer = Transfer(tag, source, tuple(rank for rank in ranks if rank != source and rank not in mates))
        read_by_source = False
        for rank, position in askers:
            if rank == source and not read_by_source:
                shares[rank].sends[position] = transfer
                read_by_source = True
            elif rank != source and rank not in mates:  # (the same region twice on one rank: read twice)
                shares[rank].receives[position] = transfer
    return shares


def writers_of(files: Iterable[str], member_of: Mapping[int, int]) -> dict[str, int]:
    """For :class:`ReaderRule`: which of the ranks assigned (``member_of``: job rank -> their
    number in the rule) wrote each of ``files`` (by its name), where one did."""
    out = {}
    for file in files:
        if file not in out:
            rank = rank_of_data_file(file)
            member = member_of.get(rank) if rank is not None else None
            if member is not None:
                out[file] = member
    return out


def share_of(plan: LoadPlan) -> RankShare | None:
    """This rank's part of the assignment; None when the load has no shared region (then no
    rank of it takes part in an exchange)."""
    data = plan.storage_data
    if isinstance(data, dict) and isinstance(data.get(_PLAN_KEY), RankShare):
        return data[_PLAN_KEY]
    return None
