"""``DMuonStorageReader``: DCP's storage reader over any store, verifying as it reads.

Items are read file by file, in file order (on object stores a large read-ahead turns them
into a few big requests), each checksummed against the manifest before any byte of it is used.
Knows nothing of models.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import io
import math
import os
from collections import defaultdict
from collections.abc import Iterator
from typing import Any, BinaryIO

import torch
import torch.distributed as dist
from torch.autograd.graph import increment_version
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from .checkpoint import CheckpointListing, open_checkpoint
from .cooperative import assign_readers, cooperative_setting, share_of, stored_dtypes
from .cooperative_exchange import read_shared
from .errors import CheckpointCorruptError
from .format.manifest import ItemChecksums
from .format.sharding_index import chunk_at
from .format.tensor_bytes import tensor_memory
from .group_transport import GroupTransport
from .host_staging import DeviceUploads
from .node_identity import node_number, this_node
from .rank_failure import Phases
from .replica_reads import ReplicaLayout, share_among_replicas
from .storage.base import ReadAheadStream, checked_name
from .storage.registry import is_remote
from .storage.retry import retrying
from .transport import Transport

__all__ = ["DMuonStorageReader", "narrow_to"]

_NODE_KEY = "dmuon_node"  # where a local plan tells the coordinator its rank's machine


def narrow_to(tensor: torch.Tensor, offsets, lengths) -> torch.Tensor:
    """The region ``offsets``/``lengths`` of ``tensor``, as a view."""
    for dim, (offset, length) in enumerate(zip(offsets, lengths)):
        tensor = tensor.narrow(dim, offset, length)
    return tensor


class DMuonStorageReader(StorageReader):
    """DCP storage reader for local paths and fsspec URLs; verifies as it reads.

    Items bound for an accelerator are read into two reused (pinned) host buffers, and each
    copy to the device overlaps the read of the next item (:class:`~.host_staging.DeviceUploads`).
    """

    #: Run CPU destinations through the reused buffers too (tests of the accelerator path on CPU).
    stage_host_tensors = False
    #: Items this reader has copied to their destination through the reused buffers.
    uploaded = 0
    #: Bytes of data files this reader has fetched from storage (read-ahead included).
    bytes_fetched = 0

    def __init__(
        self,
        checkpoint_id: str | os.PathLike | None = None,
        *,
        storage_options: dict | None = None,
        listing: CheckpointListing | None = None,
        cooperative: bool | None = None,
        process_group: Any = None,
    ) -> None:
        """``listing``: an already opened and verified checkpoint, to skip reading it again.
        ``cooperative``: a region several ranks need is read by one and sent to the others
        (``cooperative.py``): True between every pair of ranks, False never, None (the
        default) as ``DMUON_COOPERATIVE_LOAD`` says, and where it says nothing, between all
        ranks on object storage and only between machines on a local path.
        ``process_group``: the group the load runs on (what ``dcp.load`` is given; default:
        the default group), over which shared regions are exchanged."""
        super().__init__()
        self.storage_options = storage_options
        self.listing = listing
        self.cooperative = cooperative
        self.process_group = process_group
        self.phases: Phases | None = None  # told where this rank is (rank_failure.py)
        #: the rounds of the load this reader is part of (``load_protocol.run_load`` sets it;
        #: under torch's ``dcp.load``, one over ``process_group`` when an exchange needs it)
        self.transport: Transport | None = None
        if checkpoint_id is not None:
            self.checkpoint_id = checkpoint_id

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id is not None and checkpoint_id != getattr(self, "checkpoint_id", None):
            self.checkpoint_id = checkpoint_id
            self.listing = None

    def _listing(self) -> CheckpointListing:
        if self.listing is None:
            self.listing = open_checkpoint(self.checkpoint_id, self.storage_options)
        return self.listing

    def read_metadata(self) -> Metadata:
        # No **kwargs on purpose: torch then never falls back to per-rank metadata files.
        return self._listing().metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self._listing()
        self.storage_data = metadata.storage_data

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        if self._exchange_across_nodes_only():  # the coordinator learns every rank's machine
            data = dict(plan.storage_data) if isinstance(plan.storage_data, dict) else {}
            data[_NODE_KEY] = this_node()
            plan = dataclasses.replace(plan, storage_data=data)
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        if len(plans) < 2 or cooperative_setting(self.cooperative) is False or not dist.is_initialized():
            return plans
        nodes = None
        if self._exchange_across_nodes_only():
            nodes = [
                plan.storage_data.get(_NODE_KEY) if isinstance(plan.storage_data, dict) else None for plan in plans
            ]
        return assign_readers(plans, self._stored_dtypes(), self._listing().metadata.storage_data, nodes)

    def share_among_replicas(self, plan: LoadPlan, state: dict, layout: ReplicaLayout) -> LoadPlan:
        """Collective over ``layout``'s replica group: this rank's ``plan`` (reading into the
        flattened ``state``) with its share of what the replicas all read
        (``replica_reads.py``), where this reader shares at all; without a gather of plans
        (``load_protocol.run_load``)."""
        if cooperative_setting(self.cooperative) is False:
            return plan
        node = node_number() if self._exchange_across_nodes_only() else None
        transport = self.transport if self.transport is not None else GroupTransport(self.process_group)
        return share_among_replicas(plan, state, layout, self._listing().metadata, node, transport)

    def wants_global_plan(self) -> bool | None:
        """Does a load need every rank's plan on the coordinator (a cooperative assignment of
        readers)? None: only if the ranks are on more than one machine (``load_protocol.py``)."""
        setting = cooperative_setting(self.cooperative)
        if setting is False:
            return False
        return None if self._exchange_across_nodes_only() else True

    def _exchange_across_nodes_only(self) -> bool:
        """The default on a local path: ranks of one machine each read a shared region (the
        page cache serves all but the first), only other machines' ranks receive it."""
        return cooperative_setting(self.cooperative) is None and not is_remote(self._listing().store.url)

    def _stored_dtypes(self) -> dict[str, torch.dtype]:
        return stored_dtypes(self._listing().metadata)

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        # no autograd here: a DTensor's to_local() (what the planner resolves a shard with)
        # otherwise goes through an autograd function for every item
        if self.phases is not None:
            self.phases.enter("reading")
        with torch.no_grad():
            share = share_of(plan)
            if share is None:
                self._read_items(plan.items, planner)
            else:
                transport = share.replicas or self.transport  # (a replica group's: share_among_replicas)
                if not isinstance(transport, GroupTransport):
                    transport = GroupTransport(self.process_group)
                read_shared(plan, share, planner, self._read_items, self._stored_dtypes(), transport)
        if self.phases is not None:
            self.phases.enter("waiting for the other ranks' reads (its own were done)")
        future: Future = Future()
        future.set_result(None)
        return future

    def _read_items(self, items: list[ReadItem], planner: LoadPlanner, keep: dict[int, Any] | None = None) -> None:
        """Read ``items`` from storage into their destinations, file by file; ``keep``: ids
        of items whose resolved destination tensors are wanted afterwards, filled in here."""
        per_file: dict[str, dict[MetadataIndex, list]] = defaultdict(lambda: defaultdict(list))
        for req in items:
            info = self.storage_data[req.storage_index]
            per_file[info.relative_path][req.storage_index].append(req)
        listing = self._listing()
        uploads = DeviceUploads(stage_host_tensors=self.stage_host_tensors)
        for name, by_index in per_file.items():
            ordered = sorted(by_index.items(), key=lambda kv: self.storage_data[kv[0]].offset)

            def read_file(name=name, ordered=ordered):  # redelivering an item is harmless
                before = listing.bytes_read
                stats = listing.manifest.files.get(name) if listing.manifest is not None else None
                size = stats.size if stats is not None else None  # (checked against the listing by rank 0)
                with listing.store.open_read(checked_name(name), size) as stream, _finishing(uploads):
                    if listing.manifest is not None:
                        listing.file_items(name, stream)  # (its trailer first, through this stream)
                    ahead = _ReadAhead(stream, [self.storage_data[index] for index, _ in ordered])
                    for first in range(0, len(ordered), _RESOLVE_BATCH):
                        # Destinations are resolved a batch at a time, before the batch's bytes
                        # are read: the per-item Python work (DCP's lookups, shape checks, row
                        # ranges) then runs back to back instead of between copies of megabytes
                        # that push its data out of the CPU's caches.
                        batch = [
                            _Delivery(listing, index, reqs, planner, uploads.stage_host_tensors, keep)
                            for index, reqs in ordered[first : first + _RESOLVE_BATCH]
                        ]
                        for k, delivery in enumerate(batch, start=first):
                            ahead.reading(k)
                            delivery.read(listing, stream, planner, uploads)
                    fetched = getattr(stream, "bytes_fetched", None)  # (what read-ahead brought in)
                self.bytes_fetched += listing.bytes_read - before if fetched is None else fetched

            retrying(listing.store, f"reading {name}", read_file)
        self.uploaded += uploads.uploaded

    @property
    def bytes_read(self) -> int:
        """Data bytes this reader has read so far (each one checksummed)."""
        return self.listing.bytes_read if self.listing is not None else 0

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return isinstance(checkpoint_id, (str, os.PathLike))


@contextlib.contextmanager
def _finishing(uploads: DeviceUploads) -> Iterator[None]:
    """Every copy to the device started while reading a file has landed (and its item is
    committed) before the file is done with, or before an attempt at it is retried."""
    try:
        yield
    finally:
        uploads.finish()


class _ReadAhead:
    """Tells a stream that can take the hint (:class:`~.storage.base.ReadAheadStream`) which
    items come next, :data:`READ_AHEAD_BYTES` ahead of the one being read: on a cold local
    file the device then reads while this rank checksums and copies (measured on a 2-rank
    512 MiB load with dropped pages: benchmarks/save_load.py, docs/performance.md)."""

    def __init__(self, stream: BinaryIO, items: list[Any]) -> None:
        self.stream = stream if isinstance(stream, ReadAheadStream) else None
        self.items = items  # storage infos (offset, length), in file order
        self.told = 0  # items hinted so far
        # bytes between two items that one hint may cover: none for a file (the kernel reads
        # what it is told), some for an object store (a request costs more than the bytes)
        self.gap = getattr(stream, "merge_gap", 0)

    def reading(self, k: int) -> None:
        """Item ``k`` is read now: hint every item that starts within the window after it."""
        if self.stream is None:
            return
        items = self.items
        horizon = items[k].offset + items[k].length + READ_AHEAD_BYTES
        run_start = run_end = None  # the byte range of the current run of items to hint
        while self.told < len(items) and (self.told <= k or items[self.told].offset < horizon):
            item = items[self.told]
            if run_start is not None and run_end is not None and item.offset - run_end > self.gap:
                # (the bytes between are not read: not hinted)
                self.stream.will_need(run_start, run_end - run_start)
                run_start = None
            if run_start is None:
                run_start = item.offset
            run_end = item.offset + item.length
            self.told += 1
        if run_start is not None and run_end is not None:
            self.stream.will_need(run_start, run_end - run_start)


READ_AHEAD_BYTES = 64 << 20

# Items whose destinations are resolved before any of their bytes is read: bounds what a planner
# that allocates in resolve_tensor (none of torch's does) holds at once.
_RESOLVE_BATCH = 64


class _Delivery:
    """One stored item and the requests it serves: destinations resolved and checked, and for
    each the byte range of the item's data it needs where that is one range (None: it needs
    the whole stored tensor, read and narrowed)."""

    def __init__(
        self,
        listing: CheckpointListing,
        index: MetadataIndex,
        reqs: list,
        planner: LoadPlanner,
        staged: bool = False,
        keep: dict[int, Any] | None = None,
    ) -> None:
        """``staged``: never fill a CPU destination in place (tests of the upload buffers).
        ``keep``: ids of requests whose destination tensor the caller wants, filled in."""
        self.index, self.reqs = index, reqs
        self.blocks: ItemChecksums | None = None
        self.dtype: torch.dtype | None = None
        self.targets: list[tuple[torch.Tensor, int | None, memoryview | None]] = []
        if reqs[0].type == LoadItemType.BYTE_IO:
            return
        md = listing.metadata.state_dict_metadata.get(index.fqn)
        if isinstance(md, TensorStorageMetadata):  # (else the stored tensor is read whole, below)
            self.dtype = md.properties.dtype
            self.blocks = listing.data_blocks(index)
        for req in reqs:
            target = planner.resolve_tensor(req).detach()
            if keep is not None and id(req) in keep:
                keep[id(req)] = target
            if tuple(target.size()) != tuple(req.lengths):
                raise CheckpointCorruptError(
                    f"{req.storage_index.fqn}: stored region has shape {tuple(req.lengths)}, "
                    f"expected {tuple(target.size())}"
                )
            start = _row_range_start(md, index, req) if isinstance(md, TensorStorageMetadata) else None
            in_place = start is not None and (
                target.is_contiguous() and target.device.type == "cpu" and target.dtype == self.dtype and not staged
            )
            self.targets.append((target, start, tensor_memory(target) if in_place else None))

    def read(self, listing: CheckpointListing, stream: BinaryIO, planner: LoadPlanner, uploads: DeviceUploads) -> None:
        index, blocks = self.index, self.blocks
        if not self.targets:  # an object
            data = listing.read_item(index, stream)
            for req in self.reqs:
                planner.load_bytes(req, io.BytesIO(data))
            return
        saved = None  # the whole item, read only when a request cannot be served directly
        if blocks is not None:  # (here, not for the whole batch first: streams read ahead in file order)
            listing.verify_frame(index, stream, blocks, tail=False)
        loaded = []  # committed once the whole item is verified, its frame's tail included
        for req, (target, start, view) in zip(self.reqs, self.targets):
            if start is None or blocks is None:
                if saved is None:
                    saved = listing.read_tensor(index, stream)
                target.copy_(narrow_to(saved, req.storage_offsets, req.lengths))
            elif view is not None:  # one copy, from storage to the tensor, verified block by block
                listing.read_data_into(index, stream, start, view, blocks)
                # written through its memory: its version counter must say so, as an in-place
                # torch op's would (autograd, and dmuon's check of unwritten masters, read it)
                increment_version(target)
            elif self.dtype is not None and uploads.takes(target, math.prod(req.lengths) * self.dtype.itemsize):
                # into a reused (pinned) buffer; its copy to the device overlaps the next read
                host = uploads.buffer(tuple(req.lengths), self.dtype, target.device)
                listing.read_data_into(index, stream, start, tensor_memory(host), blocks)
                uploads.upload(host, target, functools.partial(planner.commit_tensor, req, target))
                continue
            else:
                staging = torch.empty(tuple(req.lengths), dtype=self.dtype)
                listing.read_data_into(index, stream, start, tensor_memory(staging), blocks)
                target.copy_(staging)
            loaded.append((req, target))
        if blocks is not None:  # after the data: the file is read front to back, never jumping ahead
            listing.verify_frame(index, stream, blocks, head=False)
        for req, target in loaded:
            planner.commit_tensor(req, target)


def _row_range_start(md: TensorStorageMetadata, index: MetadataIndex, req) -> int | None:
    """Where in a stored chunk's data the request's bytes start, if the request is a range of
    whole rows of the chunk (one byte range, read straight into the destination); None else."""
    chunk = chunk_at(md, index.offset or ())
    if chunk is None:
        return None
    sizes, starts, lengths = tuple(chunk.sizes), tuple(req.storage_offsets), tuple(req.lengths)
    if len(sizes) > 1 and (any(starts[1:]) or lengths[1:] != sizes[1:]):
        return None  # not whole rows: not one byte range
    row_bytes = math.prod(sizes[1:]) * md.properties.dtype.itemsize
    return starts[0] * row_bytes if sizes else 0
