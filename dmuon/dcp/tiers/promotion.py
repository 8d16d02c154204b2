"""A committed local checkpoint copied to the persistent tier, without serialising it again.

Every rank uploads its own data file from its node's local tier, checking each byte against
the checksums the local save computed as it streams it (a file that rotted on the local disk
is not copied); when every rank is done, rank 0 commits: the same manifest, then the same
``.metadata``, as an exclusive create (``dcp/commit.py``). So the persistent copy carries the
local save's checksums, and until its ``.metadata`` exists it is an incomplete directory
that nothing loads: a kill at any point of a promotion leaves the previous persistent
checkpoint the newest one there.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import BinaryIO

from ..commit import commit
from ..errors import CheckpointCorruptError, CheckpointExistsError, StorageError
from ..format.file_sums import read_file_sums
from ..format.layout import METADATA, data_file_of
from ..format.manifest import Manifest
from ..format.verified_read import verify_stream
from ..manager import CheckpointManager
from ..storage.base import Store
from ..storage.registry import open_store
from ..storage.retry import retrying
from ..transport import Attempt
from .local import CommitCopy, LocalTier
from .nodes import NodeLayout, TierGroups

__all__ = ["promote_step"]

log = logging.getLogger(__name__)


class _CopyingReader:
    """A read-only stream that writes what is read from it to ``sink``: one pass verifies
    and copies."""

    def __init__(self, source: BinaryIO, sink: BinaryIO) -> None:
        self.source, self.sink = source, sink

    def read(self, size: int = -1) -> bytes:
        data = self.source.read(size)
        if data:
            self.sink.write(data)
        return data


def _upload(store: Store, path: str, name: str, manifest: Manifest) -> None:
    stats = manifest.files[name]
    if stats.items is None:  # in the file's trailer: read first, as the copy cannot seek
        with open(path, "rb") as source:
            stats = dataclasses.replace(
                stats, items=read_file_sums(source, name, stats, manifest.checksum, manifest.save_id)
            )

    def attempt() -> None:
        with open(path, "rb") as source, store.open_write(name) as sink:
            problem = verify_stream(_CopyingReader(source, sink), name, stats, manifest.checksum)  # type: ignore[arg-type]
            if problem is not None:  # the stream is dropped, not committed
                raise CheckpointCorruptError(f"{path}: {problem}; not copied to {store.url}")

    retrying(store, f"copying {name}", attempt, writing=True)


def promote_step(
    groups: TierGroups,
    layout: NodeLayout,
    tier: LocalTier,
    step: int,
    copy: CommitCopy,
    persistent: CheckpointManager,
) -> bool:
    """Collective on the background group: copy step ``step`` from the local tier to
    ``persistent``. False if that step is committed there already (nothing is written);
    raises :class:`StorageError` on every rank if any upload or the commit failed."""
    store = open_store(persistent.path(step), persistent.storage_options)

    def start() -> bool:
        """True to promote; False when the step is committed there already."""
        files = store.list()
        if METADATA in files:
            return False
        if files:  # an earlier promotion of this step died: start afresh
            store.remove_tree()
        store.makedirs()
        return True

    where = f"promoting step {step} to {store.url}"
    transport = groups.background
    if not transport.decided(start, 0, where, StorageError):
        return False
    manifest = copy.manifest()
    mine = data_file_of(layout.rank, manifest.files)
    with Attempt() as uploading:
        if mine in manifest.files:
            _upload(store, os.path.join(tier.step_dir(step), mine), mine, manifest)
    transport.settle(uploading, f"{where} failed (not committed)", StorageError)

    def commit_here() -> None:
        try:
            commit(store, manifest, copy.metadata_bytes, overwrite=False, replaced=set())
        except CheckpointExistsError:
            return  # another job promoted it first; its copy stands
        try:
            persistent.clean_up()
        except Exception as exc:  # committed all the same: retention runs again next time
            log.warning("promoted step %d, but retention in %s failed: %s", step, persistent.root, exc)

    transport.decided(commit_here, 0, f"{where}: the commit failed", StorageError)
    return True
