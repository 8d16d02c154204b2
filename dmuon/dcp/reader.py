"""``DMuonStorageReader``: DCP's storage reader over any store, verifying as it reads.

Items are read file by file, in file order (on object stores a large read-ahead turns them
into a few big requests), each checksummed against the manifest before any byte of it is used.
Knows nothing of models.
"""

from __future__ import annotations

import io
import math
import os
from collections import defaultdict
from typing import Any, BinaryIO

import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from .checkpoint import CheckpointListing, open_checkpoint
from .errors import CheckpointCorruptError
from .manifest import ItemChecksums
from .store import checked_name, retrying
from .torch_file import tensor_memory

__all__ = ["DMuonStorageReader", "narrow_to"]


def narrow_to(tensor: torch.Tensor, offsets, lengths) -> torch.Tensor:
    """The region ``offsets``/``lengths`` of ``tensor``, as a view."""
    for dim, (offset, length) in enumerate(zip(offsets, lengths)):
        tensor = tensor.narrow(dim, offset, length)
    return tensor


class DMuonStorageReader(StorageReader):
    """DCP storage reader for local paths and fsspec URLs; verifies as it reads."""

    def __init__(
        self,
        checkpoint_id: str | os.PathLike | None = None,
        *,
        storage_options: dict | None = None,
        listing: CheckpointListing | None = None,
    ) -> None:
        """``listing``: an already opened and verified checkpoint, to skip reading it again."""
        super().__init__()
        self.storage_options = storage_options
        self.listing = listing
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
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        # no autograd here: a DTensor's to_local() (what the planner resolves a shard with)
        # otherwise goes through an autograd function for every item
        with torch.no_grad():
            self._read_plan(plan, planner)
        future: Future = Future()
        future.set_result(None)
        return future

    def _read_plan(self, plan: LoadPlan, planner: LoadPlanner) -> None:
        per_file: dict[str, dict[MetadataIndex, list]] = defaultdict(lambda: defaultdict(list))
        for req in plan.items:
            info = self.storage_data[req.storage_index]
            per_file[info.relative_path][req.storage_index].append(req)
        store = self._listing().store
        for name, by_index in per_file.items():
            ordered = sorted(by_index.items(), key=lambda kv: self.storage_data[kv[0]].offset)

            def read_file(name=name, ordered=ordered):  # redelivering an item is harmless
                with store.open_read(checked_name(name)) as stream:
                    for index, reqs in ordered:
                        self._deliver(planner, reqs, index, stream)

            retrying(store, f"reading {name}", read_file)

    def _deliver(self, planner: LoadPlanner, reqs: list, index: MetadataIndex, stream: BinaryIO) -> None:
        listing = self._listing()
        if reqs[0].type == LoadItemType.BYTE_IO:
            data = listing.read_item(index, stream)
            for req in reqs:
                planner.load_bytes(req, io.BytesIO(data))
            return
        saved = None  # the whole item, read only when a request cannot be served directly
        blocks = listing.data_blocks(index)
        if blocks is not None:
            listing.verify_frame(index, stream, blocks)
        for req in reqs:
            target = planner.resolve_tensor(req).detach()
            if tuple(target.size()) != tuple(req.lengths):
                raise CheckpointCorruptError(
                    f"{req.storage_index.fqn}: stored region has shape {tuple(req.lengths)}, "
                    f"expected {tuple(target.size())}"
                )
            if blocks is None or not self._read_rows(listing, index, blocks, stream, req, target):
                if saved is None:
                    saved = listing.read_tensor(index, stream)
                target.copy_(narrow_to(saved, req.storage_offsets, req.lengths))
            planner.commit_tensor(req, target)

    @staticmethod
    def _read_rows(
        listing: CheckpointListing, index: MetadataIndex, blocks: ItemChecksums, stream: BinaryIO, req, target
    ) -> bool:
        """Serve a request whose region is a range of whole rows of a stored chunk by reading
        just those bytes (verified block by block) into the target: one copy, from storage to
        the tensor, where the target is a contiguous CPU tensor of the stored dtype."""
        md = listing.metadata.state_dict_metadata.get(index.fqn)
        if not isinstance(md, TensorStorageMetadata):
            return False
        offsets = tuple(index.offset or ())
        chunk = next((c for c in md.chunks if tuple(c.offsets) == offsets), None)
        if chunk is None:
            return False
        sizes, starts, lengths = tuple(chunk.sizes), tuple(req.storage_offsets), tuple(req.lengths)
        if len(sizes) > 1 and (any(starts[1:]) or lengths[1:] != sizes[1:]):
            return False  # not whole rows: not one byte range
        dtype = md.properties.dtype
        row_bytes = math.prod(sizes[1:]) * dtype.itemsize
        start = starts[0] * row_bytes if sizes else 0
        if target.is_contiguous() and target.dtype == dtype and target.device.type == "cpu":
            listing.read_data_into(index, stream, start, tensor_memory(target), blocks)
        else:
            staging = torch.empty(lengths, dtype=dtype)
            listing.read_data_into(index, stream, start, tensor_memory(staging), blocks)
            target.copy_(staging)
        return True

    @property
    def bytes_read(self) -> int:
        """Data bytes this reader has read so far (each one checksummed)."""
        return self.listing.bytes_read if self.listing is not None else 0

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return isinstance(checkpoint_id, (str, os.PathLike))
