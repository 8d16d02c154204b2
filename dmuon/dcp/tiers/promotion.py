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

import os
from typing import BinaryIO

from ..commit import commit
from ..errors import CheckpointCorruptError, CheckpointExistsError, StorageError
from ..format.layout import METADATA, data_file_name
from ..format.manifest import FileStats
from ..format.verified_read import verify_stream
from ..manager import CheckpointManager
from ..storage.base import Store
from ..storage.registry import open_store
from ..storage.retry import retrying
from .local import CommitCopy, LocalTier
from .nodes import NodeLayout, TierGroups

__all__ = ["promote_step"]


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


def _upload(store: Store, path: str, name: str, stats: FileStats, checksum: str) -> None:
    def attempt() -> None:
        with open(path, "rb") as source, store.open_write(name) as sink:
            problem = verify_stream(_CopyingReader(source, sink), stats, checksum)  # type: ignore[arg-type]
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
    decision = None
    if layout.rank == 0:
        try:
            files = store.list()
            if METADATA in files:
                decision = "committed"
            else:
                if files:  # an earlier promotion of this step died: start afresh
                    store.remove_tree()
                store.makedirs()
                decision = "go"
        except Exception as exc:
            decision = f"{type(exc).__name__}: {exc}"
    decision = groups.broadcast(decision, 0, background=True)
    if decision == "committed":
        return False
    if decision != "go":
        raise StorageError(f"promoting step {step} to {store.url}: {decision}")
    manifest = copy.manifest()
    mine = data_file_name(layout.rank, manifest.save_id)
    problem = None
    if mine in manifest.files:
        try:
            _upload(store, os.path.join(tier.step_dir(step), mine), mine, manifest.files[mine], manifest.checksum)
        except Exception as exc:
            problem = f"{type(exc).__name__}: {exc}"
    problems = groups.all_gather(problem, background=True)
    failed = {r: p for r, p in enumerate(problems) if p}
    if failed:
        detail = "; ".join(f"rank {r}: {p}" for r, p in sorted(failed.items()))
        raise StorageError(f"promoting step {step} to {store.url} failed (not committed): {detail}")
    outcome = None
    if layout.rank == 0:
        try:
            commit(store, manifest, copy.metadata_bytes, overwrite=False, replaced=set())
            outcome = "committed"
            persistent.clean_up()
        except CheckpointExistsError:
            outcome = "committed"  # another job promoted it first; its copy stands
        except Exception as exc:
            outcome = outcome or f"{type(exc).__name__}: {exc}"
    outcome = groups.broadcast(outcome, 0, background=True)
    if outcome != "committed":
        raise StorageError(f"promoting step {step} to {store.url}: the commit failed: {outcome}")
    return True
