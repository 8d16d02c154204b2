"""Committing a save, removing what it replaced, and un-committing a checkpoint to delete it.

The commit protocol of a save with id ``S`` to one store (see ``format.py`` for the names):

1. every rank has written its data file ``__<rank>_<S>.distcp`` (new names: an existing
   checkpoint at the same path is untouched);
2. the coordinator puts the manifest ``.dmuon-manifest-<S>.json``;
3. the coordinator puts ``.metadata``, the one commit marker. Without ``overwrite`` this is an
   exclusive create (a concurrent committed save makes it fail and this save's files are
   removed); with ``overwrite`` it atomically replaces the old one, so a reader sees the old
   or the new checkpoint, never a mixture;
4. files of the saves this commit replaced are deleted, and leftovers of saves that died long
   ago; never a recent file of another save, which may still be writing.
"""

from __future__ import annotations

import logging
import time

from .errors import CheckpointCorruptError, CheckpointExistsError
from .format.layout import METADATA, is_dmuon_file, is_manifest_name, manifest_name
from .format.manifest import Manifest, decode_manifest, encode_manifest
from .storage.base import Store
from .storage.retry import retrying

__all__ = ["STALE_AFTER_S", "collect_garbage", "commit", "files_of_committed_saves", "remove_checkpoint"]

log = logging.getLogger(__name__)

#: Files of a failed save older than this are collected by the next commit at that path.
STALE_AFTER_S = 3600.0


def files_of_committed_saves(store: Store, files: dict[str, int]) -> set[str]:
    """Files that the manifests present now list: what a commit here will replace."""
    out: set[str] = set()
    for name in files:
        if is_manifest_name(name):
            try:
                manifest = decode_manifest(name, store.read(name))
            except (CheckpointCorruptError, OSError):
                continue
            out.add(name)
            out.update(manifest.files)
    return out


def commit(store: Store, manifest: Manifest, metadata_bytes: bytes, *, overwrite: bool, replaced: set[str]) -> None:
    """Steps 2-4 of the protocol, on the coordinator."""
    name = manifest_name(manifest.save_id)
    retrying(store, "writing the manifest", lambda: store.put(name, encode_manifest(manifest)), writing=True)
    try:
        retrying(
            store,
            "committing .metadata",
            lambda: store.put(METADATA, metadata_bytes, exclusive=not overwrite),
            writing=True,
        )
    except FileExistsError as exc:
        for mine in list(manifest.files) + [name]:
            store.delete(mine)
        raise CheckpointExistsError(
            f"{store.url}: another save committed first; this save's files were removed"
        ) from exc
    collect_garbage(store, keep=set(manifest.files) | {name, METADATA}, replaced=replaced)


def collect_garbage(store: Store, keep: set[str], replaced: set[str]) -> None:
    """Delete what a commit replaced and dmuon leftovers older than :data:`STALE_AFTER_S`."""
    for name in store.list():
        if name in keep or not is_dmuon_file(name):
            continue  # never touch a user's file
        if name not in replaced and not _older_than(store, name, STALE_AFTER_S):
            continue
        try:
            store.delete(name)
        except OSError as exc:  # garbage left behind is harmless; say so and go on
            log.warning("could not remove stale checkpoint file %s: %s", name, exc)


def _older_than(store: Store, name: str, seconds: float) -> bool:
    try:
        return time.time() - store.modified(name) > seconds
    except (OSError, NotImplementedError, AttributeError):
        return False


def remove_checkpoint(store: Store) -> None:
    """Un-commit first (``.metadata``), then delete: a crash midway leaves an incomplete
    directory, never a committed checkpoint with missing files."""
    store.delete(METADATA)
    store.remove_tree()
