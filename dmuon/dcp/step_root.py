"""Step-numbered checkpoints under one store: ``<root>/step-<N>``.

The one place that names step directories, tells the committed ones (a ``.metadata``) from
a save's leftovers, applies retention and removes a step. The managers use it on every tier:
:class:`~dmuon.dcp.CheckpointManager` on its root (local disk or object storage), the
tiers on each node's own directory and on every peer's replica directory beside it.

Removal un-commits first (``.metadata`` goes first), so an interrupted removal leaves an
incomplete directory, never a committed checkpoint with missing files.
"""

from __future__ import annotations

import logging

from .commit import remove_checkpoint
from .format.layout import METADATA, step_dir_name, step_of_dir
from .storage.base import Store

__all__ = ["StepRoot"]

log = logging.getLogger(__name__)


class StepRoot:
    """The step directories of ``store``."""

    def __init__(self, store: Store) -> None:
        self.store = store

    def step_store(self, step: int) -> Store:
        return self.store.child(step_dir_name(step))

    def dirs(self) -> dict[int, str]:
        """Every step directory present, committed or not: step -> its name."""
        out = {}
        for name in self.store.list_dirs():
            step = step_of_dir(name)
            if step is not None:
                out[step] = name
        return out

    def is_committed(self, step: int) -> bool:
        return METADATA in self.step_store(step).list()

    def committed(self) -> list[int]:
        """Committed steps, oldest first."""
        return sorted(step for step in self.dirs() if self.is_committed(step))

    def remove(self, step: int) -> None:
        """Un-commit, then delete the step's directory."""
        remove_checkpoint(self.step_store(step))

    def clear_leftovers(self, step: int) -> None:
        """Before a new save of ``step``: files of a save that did not commit there go (a
        committed one stays until the new one replaces it)."""
        if step in self.dirs() and not self.is_committed(step):
            self.step_store(step).remove_tree()

    def retain(
        self, keep: int, *, writing: int | None = None, upto: int | None = None, newer_leftovers: bool = True
    ) -> list[int]:
        """Keep the newest ``keep`` committed steps and remove every other step directory;
        returns the steps removed.

        Never removed: the newest committed step, and ``writing`` (a save in flight, which then
        counts as one of the ``keep``). Steps after ``upto`` are not looked at (a newer save may
        still be arriving). Uncommitted directories newer than the newest committed step are
        a crash's leftovers only where nothing else writes here (``newer_leftovers``); where
        another process may be writing one (a replica arriving from a peer) they stay.
        """
        dirs = {step: name for step, name in self.dirs().items() if upto is None or step <= upto}
        committed = [step for step in sorted(dirs) if self.is_committed(step)]
        if writing is None:
            kept = set(committed[-keep:])
        else:
            kept = set(committed[-(keep - 1) :] if keep > 1 else []) | {writing}
        if committed:
            kept.add(committed[-1])
        newest = committed[-1] if committed else None
        removed = []
        for step in sorted(dirs):
            if step in kept:
                continue
            if not newer_leftovers and (newest is None or step > newest):
                continue
            try:
                self.remove(step)
                removed.append(step)
            except OSError as exc:  # what is left is retried by the next retention
                log.warning("could not remove %s: %s", f"{self.store.url}/{dirs[step]}", exc)
        return removed
