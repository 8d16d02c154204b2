"""``DMuonStorageReader``: DCP's storage reader over any store, verifying as it reads.

Items are read file by file, in file order (on object stores a large read-ahead turns them
into a few big requests), each checksummed against the manifest before any byte of it is used.
Knows nothing of models.
"""

from __future__ import annotations

import io
import os
from collections import defaultdict
from typing import Any, BinaryIO

import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from .checkpoint import CheckpointListing, open_checkpoint
from .errors import CheckpointCorruptError
from .store import checked_name, retrying

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
        future: Future = Future()
        future.set_result(None)
        return future

    def _deliver(self, planner: LoadPlanner, reqs: list, index: MetadataIndex, stream: BinaryIO) -> None:
        listing = self._listing()
        if reqs[0].type == LoadItemType.BYTE_IO:
            data = listing.read_item(index, stream)
            for req in reqs:
                planner.load_bytes(req, io.BytesIO(data))
            return
        saved = listing.read_tensor(index, stream)
        for req in reqs:
            piece = narrow_to(saved, req.storage_offsets, req.lengths)
            target = planner.resolve_tensor(req).detach()
            if target.size() != piece.size():
                raise CheckpointCorruptError(
                    f"{req.storage_index.fqn}: stored chunk has shape {tuple(piece.size())}, "
                    f"expected {tuple(target.size())}"
                )
            target.copy_(piece)
            planner.commit_tensor(req, target)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return isinstance(checkpoint_id, (str, os.PathLike))
