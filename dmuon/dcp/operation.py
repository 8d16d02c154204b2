"""What a load starts from, for the checkpointers and for the tiers' planning of a load.

``open_once`` opens a checkpoint's small files on one rank for all; ``load_state`` builds
what a load fills in (the model's and optimizer's state, the skeleton of the saved ``extra``).
"""

from __future__ import annotations

import os
import pickle
import zlib
from array import array
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, TensorStorageMetadata

from .. import compat
from ..optim.muon import Muon
from .app_state import AppState
from .checkpoint import CheckpointListing, open_checkpoint
from .errors import CheckpointCorruptError
from .format.layout import EXTRA_SECTION, METADATA, RankFileNames
from .format.manifest import FileStats, Manifest
from .format.sharding_index import IndexedStorage, decode_index
from .gc_pause import paused_gc
from .metadata_wire import decode_metadata, encode_metadata
from .storage.registry import open_store
from .transport import Transport

__all__ = ["extra_template", "load_state", "open_once"]


def extra_template(metadata: Metadata) -> dict:
    """Skeleton of the saved ``extra`` subtree, for DCP to fill in (keys come from the metadata)."""
    template: dict = {}
    mappings = metadata.planner_data or {}
    for fqn, md in metadata.state_dict_metadata.items():
        path = mappings.get(fqn)
        if not path or path[0] != EXTRA_SECTION:
            continue
        if isinstance(md, TensorStorageMetadata):
            value: Any = torch.empty(md.size, dtype=md.properties.dtype)
        elif isinstance(md, BytesStorageMetadata):
            value = None
        else:  # pragma: no cover - future metadata kinds
            continue
        compat.set_element(template, path, value)
    return template.get(EXTRA_SECTION, {})


def open_once(
    checkpoint_id: str | os.PathLike, storage_options: dict | None, transport: Transport
) -> CheckpointListing:
    """Collective: rank 0 reads and checks the checkpoint's small files (the listing,
    ``.metadata``, the manifest) and sends what it found to every rank, instead of every rank
    reading them from storage: one read per load, not one per rank (what a job of thousands
    of ranks asks of one object-store key at once). A failure there (missing, incomplete,
    corrupt) is raised on every rank with its type.

    What it sends: for a checkpoint with a sharding index (``format/sharding_index.py``) the
    index, the manifest's scalars and its files' sizes as columns -- a size that does not grow
    with the ranks but by a few bytes a file -- and each rank decodes the index itself; for
    one without, the decoded ``Metadata`` in a compact form (``metadata_wire.py``: the chunks
    as columns of integers, compressed), and each rank rebuilds the same ``Metadata``."""
    if transport.world == 1:
        return open_checkpoint(checkpoint_id, storage_options, indexed=True)
    where = os.fspath(checkpoint_id)
    kept: list[CheckpointListing] = []  # rank 0's own listing: it need not decode what it sent

    def opened() -> bytes:
        listing = open_checkpoint(checkpoint_id, storage_options, indexed=True)
        kept.append(listing)
        storage = listing.metadata.storage_data
        if isinstance(storage, IndexedStorage) and listing.manifest is not None:
            small_files: tuple = (_INDEXED, *_manifest_columns(listing.manifest, storage.names), listing.manifest_file)
            small_files += ({name: listing.files[name] for name in (METADATA, listing.manifest_file) if name},)
        else:
            small_files = (encode_metadata(listing.metadata), listing.manifest, listing.files, listing.manifest_file)
        # (the file list and the manifest name every data file: one per writing rank, alike
        # but for the rank's number; compressed, they cost a few bytes a file)
        return zlib.compress(pickle.dumps(small_files, protocol=pickle.HIGHEST_PROTOCOL), 1)

    payload = transport.decided(opened, 0, f"opening {where}")
    if kept:
        return kept[0]
    small_files = pickle.loads(zlib.decompress(payload))
    store = open_store(checkpoint_id, storage_options)
    if small_files[0] == _INDEXED:
        _, scalars, index, others, sizes, sums_at, manifest_file, small = small_files
        metadata = decode_index(index, where)
        assert isinstance(metadata.storage_data, IndexedStorage)
        stats = FileColumns(metadata.storage_data.names, others, sizes, sums_at)
        save_id, checksum, metadata_size, metadata_checksum, version = scalars
        manifest = Manifest(save_id, checksum, metadata_size, metadata_checksum, stats, version, index)
        return CheckpointListing(store, metadata, manifest, files=FileSizes(stats, small), manifest_file=manifest_file)
    wire, manifest, files, manifest_file = small_files
    with paused_gc():
        metadata = decode_metadata(wire)
    return CheckpointListing(store, metadata, manifest, files=files, manifest_file=manifest_file)


_INDEXED = "indexed"  # open_once's message for a checkpoint with a sharding index


class FileColumns(Mapping[str, FileStats]):
    """A manifest's data files on a rank that did not read the manifest: the sizes and trailer
    offsets rank 0 sent as columns, in the index's file order (``others``: files the index does
    not name, after them). A file's ``FileStats`` is made when first asked for, and kept (a
    reader fills in its items): a rank's load asks for the two or three files it reads, and
    its cost does not grow with the N files of the job."""

    def __init__(self, names: Sequence[str], others: list[str], sizes: bytes, sums_at: bytes) -> None:
        self._names, self._others = names, others
        self._other_positions = {name: len(names) + k for k, name in enumerate(others)}
        self._sizes, self._sums_at = array("q", sizes), array("q", sums_at)
        if len(self._sizes) != len(self) or len(self._sums_at) != len(self):
            raise CheckpointCorruptError("open_once: the manifest's file columns do not match its files")
        self._positions: dict[str, int] | None = None  # (names given as a list: a table, made once)
        self._made: dict[str, FileStats] = {}

    def _position(self, name: str) -> int | None:
        position = self._other_positions.get(name)
        if position is not None:
            return position
        if isinstance(self._names, RankFileNames):
            return self._names.position(name)
        if self._positions is None:
            self._positions = {known: k for k, known in enumerate(self._names)}
        return self._positions.get(name)

    def __getitem__(self, name: str) -> FileStats:
        stats = self._made.get(name)
        if stats is None:
            position = self._position(name) if isinstance(name, str) else None
            if position is None:
                raise KeyError(name)
            stats = self._made[name] = FileStats(self._sizes[position], None, sums_at=self._sums_at[position])
        return stats

    def __iter__(self) -> Iterator[str]:
        yield from self._names
        yield from self._others

    def __len__(self) -> int:
        return len(self._names) + len(self._others)


class FileSizes(Mapping[str, int]):
    """A listing's files on such a rank: the data files' sizes from :class:`FileColumns`, and
    the small files' (``small``)."""

    def __init__(self, data_files: FileColumns, small: dict[str, int]) -> None:
        self._data_files, self._small = data_files, small

    def __getitem__(self, name: str) -> int:
        if name in self._small:
            return self._small[name]
        return self._data_files[name].size

    def __iter__(self) -> Iterator[str]:
        yield from self._data_files
        yield from (name for name in self._small if name not in self._data_files)

    def __len__(self) -> int:
        return sum(1 for _ in self)


def _manifest_columns(manifest: Manifest, names: Sequence[str]) -> tuple:
    """A version-4 manifest with a sharding index, its files as columns in the index's order."""
    order = list(names)
    order += sorted(set(manifest.files) - set(order))
    stats = [manifest.files[name] for name in order]
    sizes, sums_at = array("q", (s.size for s in stats)), array("q", (s.sums_at or 0 for s in stats))
    scalars = (
        manifest.save_id,
        manifest.checksum,
        manifest.metadata_size,
        manifest.metadata_checksum,
        manifest.version,
    )
    return scalars, manifest.index, order[len(names) :], sizes.tobytes(), sums_at.tobytes()


def load_state(model: nn.Module, optimizer: Muon | None, metadata: Metadata) -> tuple[AppState, dict]:
    """What a load of ``metadata``'s checkpoint fills in, built in one place for the loads and
    for the tiers' planning of one: the model's and optimizer's state, and the skeleton of the
    saved ``extra``; with the :class:`AppState` that puts it back."""
    app = AppState(model, optimizer)
    state = app.state_dict()
    extra = extra_template(metadata)
    if extra:
        state[EXTRA_SECTION] = extra
    return app, state
