"""A committed checkpoint, opened safely: its files, verified metadata and manifest.

:func:`open_checkpoint` lists the directory, refuses an uncommitted one, checks the
``.metadata`` bytes against the manifest before unpickling them with an allow-listed
unpickler, and checks that every byte range the metadata names lies inside a known file of
the right size -- all before any data file is read. The :class:`CheckpointListing` it returns
then reads items, each checksummed as it is read (``format.verified_read``). :func:`verify`
re-reads every data file; :func:`inspect` describes a checkpoint as plain data.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections import defaultdict
from collections.abc import Callable, Mapping
from typing import Any

from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, TensorStorageMetadata

from .. import compat
from .errors import CheckpointCorruptError, CheckpointIncompleteError, CheckpointNotFoundError
from .format.layout import METADATA, RESERVED_KEY, is_manifest_name, rank_of_data_file
from .format.manifest import FileStats, Manifest, decode_manifest
from .format.safe_metadata import load_metadata_bytes
from .format.sharding_index import IndexedStorage, decode_index
from .format.verified_read import VerifiedReads
from .storage.base import Store, checked_name
from .storage.registry import open_store

__all__ = ["CheckpointListing", "inspect", "open_checkpoint", "read_commit", "verify"]

log = logging.getLogger(__name__)


@dataclasses.dataclass
class CheckpointListing(VerifiedReads):
    """A committed checkpoint: its files, verified metadata and manifest; reads verified items."""

    files: Mapping[str, int] = dataclasses.field(default_factory=dict)
    manifest_file: str | None = None

    def planner_info(self) -> dict:
        """What dmuon's save planner recorded about the save (empty for other writers)."""
        return (self.metadata.planner_data or {}).get(RESERVED_KEY, {})


def _check_storage_ranges(files: dict[str, int], metadata: Metadata, manifest: Manifest | None, where: str):
    """Every referenced file exists, is named safely, and holds the referenced byte ranges."""
    checked: dict[str, tuple[int, FileStats | None]] = {}  # per data file: its size and manifest entry
    for index, info in metadata.storage_data.items():
        if not isinstance(info, compat.StorageInfo):
            raise CheckpointCorruptError(f"{where}: storage entry for {index.fqn} is not a file range")
        name = info.relative_path
        if name not in checked:
            checked[name] = _checked_file(files, manifest, checked_name(name), index.fqn, where)
        size, stats = checked[name]
        if stats is not None and stats.sums_at is not None:
            size = stats.sums_at  # items end where the file's checksum trailer starts
        if info.offset < 0 or info.length < 0 or info.offset + info.length > size:
            raise CheckpointCorruptError(
                f"{where}: {index.fqn} claims bytes {info.offset}..{info.offset + info.length} of {name}, "
                f"which has {size} bytes of items"
            )
        # (version 4: each item is matched when its file's trailer is read, by the first read there)
        if stats is not None and stats.items is not None and stats.item_length(info.offset) != info.length:
            raise CheckpointCorruptError(f"{where}: {index.fqn} in {name} does not match the manifest")


def _checked_file(
    files: dict[str, int], manifest: Manifest | None, name: str, fqn: str, where: str
) -> tuple[int, FileStats | None]:
    """A data file's size, and its manifest entry: the file must exist and match the manifest."""
    size = files.get(name)
    if size is None:
        raise CheckpointCorruptError(f"{where}: data file {name} (holding {fqn}) is missing")
    if manifest is None:
        return size, None
    stats = manifest.files.get(name)
    if stats is None:
        raise CheckpointCorruptError(f"{where}: data file {name} is not in the checksum manifest")
    if stats.size != size:
        raise CheckpointCorruptError(
            f"{where}: data file {name} has {size} bytes, the manifest says {stats.size} (truncated?)"
        )
    return size, stats


def read_commit(store: Store, files: dict[str, int]) -> tuple[bytes, Manifest | None, str | None]:
    """The ``.metadata`` bytes of a committed directory and the manifest that describes them
    (None, None where it has no manifest: not written by dmuon). Reads nothing else: the
    data files may lie elsewhere (a node-local tier holds only its node's)."""
    metadata_bytes = store.read(METADATA)
    manifests = sorted(name for name in files if is_manifest_name(name))
    corrupt_manifest = None
    for name in manifests:
        try:
            candidate = decode_manifest(name, store.read(name))
        except CheckpointCorruptError as exc:
            corrupt_manifest = exc
            continue
        if candidate.describes_metadata(metadata_bytes):
            return metadata_bytes, candidate, name
    if manifests:
        if corrupt_manifest is not None and len(manifests) == 1:
            raise corrupt_manifest
        raise CheckpointCorruptError(
            f"{store.url}: .metadata does not match its checksum manifest ({', '.join(manifests)}): "
            ".metadata is corrupted"
        )
    return metadata_bytes, None, None


def _check_indexed_files(files: dict[str, int], storage: IndexedStorage, manifest: Manifest, where: str) -> None:
    """What :func:`_check_storage_ranges` checks, per data file of the sharding index: it
    exists, matches the manifest, and is long enough for the items its class places in it."""
    for name, end in storage.item_ends().items():
        size, stats = _checked_file(files, manifest, checked_name(name), "its items", where)
        bound = stats.sums_at if stats is not None and stats.sums_at is not None else size
        if end > bound:
            raise CheckpointCorruptError(
                f"{where}: the sharding index places items up to byte {end} of {name}, which has {bound} bytes of items"
            )


def open_checkpoint(
    checkpoint_id: str | os.PathLike,
    storage_options: dict | None = None,
    store: Store | None = None,
    *,
    indexed: bool = False,
) -> CheckpointListing:
    """List, verify and decode a checkpoint's metadata (no data file is read). ``indexed``:
    from the manifest's sharding index where it has one (``format/sharding_index.py``), its
    chunks and storage computed when asked for, instead of unpickling ``.metadata`` (whose
    bytes are still checked against the manifest: the commit is the one it describes)."""
    store = store or open_store(checkpoint_id, storage_options)
    files = store.list()
    where = store.url
    if METADATA not in files:
        if not files and not store.is_dir():
            raise CheckpointNotFoundError(f"no checkpoint at {where}")
        raise CheckpointIncompleteError(
            f"{where} is incomplete: it has no .metadata (the save that wrote it did not finish); refusing to load it"
        )
    metadata_bytes, manifest, manifest_file = read_commit(store, files)
    if manifest is None:
        log.warning("%s has no dmuon checksum manifest (not written by dmuon?): loading unverified", where)
    # (an index comes with a version-4 manifest, whose files' checksums are in their trailers)
    with_trailers = manifest is not None and all(stats.sums_at is not None for stats in manifest.files.values())
    if indexed and manifest is not None and manifest.index is not None and with_trailers:
        metadata = decode_index(manifest.index, where)
        assert isinstance(metadata.storage_data, IndexedStorage)
        _check_indexed_files(files, metadata.storage_data, manifest, where)
        return CheckpointListing(store, metadata, manifest, files=files, manifest_file=manifest_file)
    metadata = load_metadata_bytes(metadata_bytes, where)
    _check_storage_ranges(files, metadata, manifest, where)
    return CheckpointListing(store, metadata, manifest, files=files, manifest_file=manifest_file)


def verify(
    checkpoint_id: str | os.PathLike,
    *,
    storage_options: dict | None = None,
    progress: Callable[[int], Any] | None = None,
) -> list[str]:
    """Re-read every byte of a committed checkpoint; the problems found (empty: all good).

    Raises like :func:`open_checkpoint` when the checkpoint is missing, uncommitted or its
    metadata is damaged. ``progress(bytes)`` is called as data is read.
    """
    return open_checkpoint(checkpoint_id, storage_options).verify_files(progress)


def inspect(
    checkpoint_id: str | os.PathLike | CheckpointListing, *, storage_options: dict | None = None
) -> dict[str, Any]:
    """What a checkpoint holds, as plain data (the ``dmuon-ckpt inspect --json`` document)."""
    listing = (
        checkpoint_id
        if isinstance(checkpoint_id, CheckpointListing)
        else open_checkpoint(checkpoint_id, storage_options)
    )
    md = listing.metadata
    info = listing.planner_info()
    writers = info.get("writers", {})
    owners = info.get("owners", {})
    chunk_bytes: dict[str, int] = defaultdict(int)
    for index, storage in md.storage_data.items():
        chunk_bytes[index.fqn] += storage.length
    tensors, objects = [], []
    for fqn, item in md.state_dict_metadata.items():
        if isinstance(item, TensorStorageMetadata):
            tensors.append(
                {
                    "key": fqn,
                    "shape": list(item.size),
                    "dtype": str(item.properties.dtype).replace("torch.", ""),
                    "bytes": chunk_bytes[fqn],
                    "chunks": len(item.chunks),
                    "owner": owners.get(fqn),
                    "written_by": writers.get(fqn),
                }
            )
        elif isinstance(item, BytesStorageMetadata):
            objects.append(fqn)
    files = {name: size for name, size in sorted(listing.files.items())}
    per_rank: dict[int, int] = defaultdict(int)
    for name, size in files.items():
        rank = rank_of_data_file(name)
        if rank is not None:
            per_rank[rank] += size
    return {
        "checkpoint": listing.store.url,
        "committed": True,
        "save_id": listing.manifest.save_id if listing.manifest else None,
        "verified_metadata": listing.manifest is not None,
        "checksum": listing.manifest.checksum if listing.manifest else None,
        "dmuon_version": info.get("dmuon_version"),
        "torch_version": info.get("torch_version"),
        "world_size": info.get("world_size"),
        "topology": info.get("topology"),
        "files": files,
        "bytes_per_rank": dict(sorted(per_rank.items())),
        "tensors": tensors,
        "objects": objects,
        "aliases": info.get("aliases", {}),
    }
