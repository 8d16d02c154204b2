"""A node-local checkpoint tier: one node's directory, what it holds, and its upkeep.

Layout (names in ``dcp/format/layout.py``)::

    <root>/step-<N>/             this node's part of step N: its ranks' data files, and the
                                 step's manifest and .metadata (on the node of rank 0, the
                                 commit itself; elsewhere copies, written after the commit)
    <root>/peer-<node>/step-<N>/ another node's part of step N, replicated here (data files
                                 first, each verified and renamed into place, then copies of
                                 the manifest and .metadata)
    <root>/restore-view/         transient: the step being restored, assembled (restore)

No directory here is a checkpoint on its own: a step is complete when every data file its
manifest lists is present, whole, on some node. :meth:`LocalTier.holdings` says what this
node holds; files are only ever present whole (written, fsynced and renamed, or written by
the save that committed), so presence and size are what the nodes compare, and every byte
is still checked against its checksum when it is read.
"""

from __future__ import annotations

import contextlib
import logging
import os
import uuid
from dataclasses import dataclass, field

from ..checkpoint import read_commit
from ..errors import CheckpointCorruptError
from ..format.layout import (
    METADATA,
    RESTORE_VIEW_DIR,
    is_dmuon_file,
    node_of_peer_dir,
    peer_dir_name,
    rank_of_data_file,
    step_dir_name,
)
from ..format.manifest import Manifest, decode_manifest
from ..step_root import StepRoot
from ..storage.base import temp_name
from ..storage.local import LocalStore
from ..storage.registry import local_path

__all__ = ["CommitCopy", "Holdings", "LocalTier", "StepCommit"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepCommit:
    """One committed save of a step, as every node can compare it: the save id and the size of
    every data file its manifest lists."""

    step: int
    save_id: str
    files: dict[str, int]


@dataclass
class CommitCopy:
    """The commit of a save, as bytes: what makes a directory of its data files loadable."""

    manifest_name: str
    manifest_bytes: bytes
    metadata_bytes: bytes

    def manifest(self) -> Manifest:
        return decode_manifest(self.manifest_name, self.manifest_bytes)


@dataclass
class Holdings:
    """What one node holds: whole data files per step (name -> size), and the commits of the
    steps it has a manifest and .metadata for. ``paths`` (not sent to other nodes) says where
    each file lies on this node."""

    node: int
    files: dict[int, dict[str, int]] = field(default_factory=dict)
    commits: dict[int, list[StepCommit]] = field(default_factory=dict)
    paths: dict[tuple[int, str], str] = field(default_factory=dict, repr=False)
    commit_dirs: dict[tuple[int, str], str] = field(default_factory=dict, repr=False)

    def summary(self) -> Holdings:
        """The part other ranks need (no local paths)."""
        return Holdings(self.node, self.files, self.commits)


class LocalTier:
    """The node-local directory ``root`` (a local path: NVMe, ``/dev/shm``, a local disk)."""

    def __init__(self, root: str | os.PathLike) -> None:
        try:
            self.root = local_path(root)
        except ValueError:
            raise ValueError(f"the local tier must be a node-local path, not {os.fspath(root)}") from None

    # -- where ------------------------------------------------------------------------------
    def step_dir(self, step: int) -> str:
        return os.path.join(self.root, step_dir_name(step))

    def peer_step_dir(self, node: int, step: int) -> str:
        return os.path.join(self.root, peer_dir_name(node), step_dir_name(step))

    def view_dir(self) -> str:
        return os.path.join(self.root, RESTORE_VIEW_DIR)

    def _locations(self) -> list[str]:
        """Directories under the root holding step directories: the own one, then each peer's."""
        out = [self.root]
        with contextlib.suppress(FileNotFoundError):
            for entry in sorted(os.scandir(self.root), key=lambda e: e.name):
                if entry.is_dir() and node_of_peer_dir(entry.name) is not None:
                    out.append(entry.path)
        return out

    @staticmethod
    def _steps_in(location: str) -> dict[int, str]:
        return {step: os.path.join(location, name) for step, name in StepRoot(LocalStore(location)).dirs().items()}

    # -- what ---------------------------------------------------------------------------------
    def committed_steps(self) -> list[int]:
        """Steps this node's own directory has the commit of (whatever other nodes hold)."""
        return StepRoot(LocalStore(self.root)).committed()

    def holdings(self, node: int) -> Holdings:
        """Every whole data file and every readable commit under the root."""
        held = Holdings(node)
        for location in self._locations():
            for step, path in self._steps_in(location).items():
                files = LocalStore(path).list()
                for name, size in files.items():
                    if rank_of_data_file(name) is not None and (step, name) not in held.paths:
                        held.files.setdefault(step, {})[name] = size
                        held.paths[(step, name)] = os.path.join(path, name)
                if METADATA not in files:
                    continue
                try:
                    _, manifest, _ = read_commit(LocalStore(path), files)
                except (CheckpointCorruptError, OSError) as exc:
                    log.warning("%s: unreadable commit, ignored: %s", path, exc)
                    continue
                if manifest is None or (step, manifest.save_id) in held.commit_dirs:
                    continue
                sizes = {name: stats.size for name, stats in manifest.files.items()}
                held.commits.setdefault(step, []).append(StepCommit(step, manifest.save_id, sizes))
                held.commit_dirs[(step, manifest.save_id)] = path
        return held

    def read_commit_copy(self, path: str) -> CommitCopy:
        store = LocalStore(path)
        metadata_bytes, manifest, name = read_commit(store, store.list())
        if manifest is None or name is None:
            raise CheckpointCorruptError(f"{path}: no dmuon manifest describes its .metadata")
        return CommitCopy(name, store.read(name), metadata_bytes)

    # -- writing ------------------------------------------------------------------------------
    @staticmethod
    def write_commit_copy(path: str, commit: CommitCopy) -> None:
        """The manifest, then ``.metadata`` (each put atomically), into a directory holding data
        files of the save; files of other saves there are then removed."""
        store = LocalStore(path)
        store.makedirs()
        store.put(commit.manifest_name, commit.manifest_bytes)
        store.put(METADATA, commit.metadata_bytes)
        keep = set(commit.manifest().files) | {commit.manifest_name, METADATA}
        for name in store.list():
            if name not in keep and is_dmuon_file(name):
                store.delete(name)

    @staticmethod
    def incoming_path(directory: str, name: str) -> str:
        """Where a replicated file is received before it is verified and renamed into place."""
        os.makedirs(directory, exist_ok=True)
        return os.path.join(directory, temp_name(name, uuid.uuid4().hex[:12]))

    @staticmethod
    def settle(temporary: str, name: str) -> str:
        """fsync a received, verified file and rename it into place (then fsync the directory)."""
        directory = os.path.dirname(temporary)
        LocalStore(directory).settle(os.path.basename(temporary), name)
        return os.path.join(directory, name)

    def prepare_step_dir(self, step: int) -> str:
        """The own directory for a new save of ``step``: leftovers of a save that did not commit
        there are removed first (a committed one stays until the new one replaces it)."""
        StepRoot(LocalStore(self.root)).clear_leftovers(step)
        path = self.step_dir(step)
        os.makedirs(path, exist_ok=True)
        return path

    # -- upkeep -------------------------------------------------------------------------------
    def retain(self, keep: int, upto: int | None = None) -> list[str]:
        """Keep the newest ``keep`` committed steps of each location (own, every peer's) up to
        step ``upto``; remove older ones, and uncommitted directories older than the newest
        committed step (a crash left them). Steps after ``upto`` are not touched (a save of a
        newer step may not be replicated yet), nor newer uncommitted ones (a replica may be
        arriving). Returns what was removed."""
        removed = []
        for location in self._locations():
            root = StepRoot(LocalStore(location))
            names = root.dirs()
            for step in root.retain(keep, upto=upto, newer_leftovers=False):
                removed.append(os.path.join(location, names[step]))
        return removed
