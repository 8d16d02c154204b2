"""Step-numbered checkpoints under one root, with retention and crash recovery."""

from __future__ import annotations

import logging
import os

from torch import nn

from ..optim.muon import Muon
from ..topology import current_rank as _rank
from . import api
from .async_checkpointer import AsyncCheckpointer, AsyncSaveHandle
from .commit import remove_checkpoint
from .errors import (
    CheckpointCorruptError,
    CheckpointIncompleteError,
    NoLoadableCheckpointError,
    UnsafeCheckpointError,
)
from .format.layout import METADATA, step_dir_name, step_of_dir
from .plan_cache import SavePlanCache
from .storage.registry import open_store

__all__ = ["CheckpointManager"]

log = logging.getLogger(__name__)


class CheckpointManager:
    """``root/step-<N>`` checkpoints: save, resume from the newest good one, keep the last few.

    A training job keeps one and calls :meth:`save` every few steps and :meth:`load_latest`
    at start. Retention never deletes the newest committed step nor the one being written;
    steps that a crash left without ``.metadata`` are ignored by :meth:`steps` and deleted.
    Deleting removes ``.metadata`` first, so an interrupted deletion can only leave an
    incomplete directory. The manager owns what saves keep from one to the next (the save plans,
    and with ``async_save`` the staging memory and process group): :meth:`close` frees them.

    Args:
        root: a local directory or an fsspec URL (``s3://bucket/run``, ``gs://...``).
        keep_last: committed steps kept; older ones are deleted after each save (>= 1).
        async_save: save in the background (:func:`~dmuon.dcp.async_save`): :meth:`save`
            returns once this rank's share is copied to host memory. Needs ``keep_last >= 2``,
            since the step being written cannot be the only one kept.
        storage_options: passed to the store of ``root`` (fsspec options: endpoint,
            credentials; ``direct_io`` for a local directory).
    """

    def __init__(
        self,
        root: str | os.PathLike,
        *,
        keep_last: int = 3,
        async_save: bool = False,
        storage_options: dict | None = None,
    ) -> None:
        if keep_last < 1:
            raise ValueError(f"keep_last must be >= 1, got {keep_last}")
        if async_save and keep_last < 2:
            raise ValueError(
                "with async_save, keep_last must be >= 2: the step being written cannot count as the only one kept"
            )
        self.root = os.fspath(root).rstrip("/")
        self.keep_last = keep_last
        self.async_save = async_save
        self.storage_options = storage_options
        self.store = open_store(self.root, storage_options)
        self.async_checkpointer = AsyncCheckpointer() if async_save else None
        self.plan_cache = SavePlanCache()  # sync saves: the plans of an unchanged layout are reused
        self._in_flight: tuple[int, AsyncSaveHandle] | None = None
        self.last_extra: dict = {}  # what load_latest's checkpoint carried in ``extra``

    def path(self, step: int) -> str:
        return f"{self.root}/{step_dir_name(step)}"

    def _step_dirs(self) -> dict[int, str]:
        out = {}
        for name in self.store.list_dirs():
            step = step_of_dir(name)
            if step is not None:
                out[step] = name
        return out

    def steps(self) -> list[int]:
        """Committed steps, oldest first."""
        return sorted(step for step, name in self._step_dirs().items() if METADATA in self.store.child(name).list())

    def _writing(self) -> int | None:
        if self._in_flight is not None and not self._in_flight[1].done():
            return self._in_flight[0]
        return None

    def save(self, step: int, model: nn.Module, optimizer: Muon | None, extra: dict | None = None) -> None:
        """Collective. A step saved twice (after a resume) is replaced safely."""
        if self._in_flight is not None:
            self._in_flight[1].wait()  # raises if the previous async save failed
            self._in_flight = None
        path = self.path(step)
        if self.async_checkpointer is not None:
            handle = self.async_checkpointer.save(
                model, optimizer, path, extra=extra, storage_options=self.storage_options, overwrite=True
            )
            self._in_flight = (step, handle)
        else:
            api.save(
                model,
                optimizer,
                path,
                extra=extra,
                storage_options=self.storage_options,
                overwrite=True,
                plan_cache=self.plan_cache,
            )
        if _rank() == 0:
            self.clean_up()

    def wait(self) -> None:
        """Block until an async save finishes; raise its error."""
        if self._in_flight is not None:
            handle, self._in_flight = self._in_flight[1], None
            handle.wait()

    def close(self) -> None:
        """Finish an async save in flight (raising its error) and free its staging memory."""
        try:
            self.wait()
        finally:
            if self.async_checkpointer is not None:
                self.async_checkpointer.close()

    def clean_up(self) -> list[int]:
        """Delete uncommitted leftovers and committed steps beyond ``keep_last``; returns them."""
        writing = self._writing()
        dirs = self._step_dirs()
        committed = [s for s in sorted(dirs) if METADATA in self.store.child(dirs[s]).list()]
        if writing is None:
            keep = set(committed[-self.keep_last :])
        else:  # the step being written counts as one of the kept (keep_last >= 2 with async)
            keep = set(committed[-(self.keep_last - 1) :]) | {writing}
        if committed:
            keep.add(committed[-1])  # the newest committed step, whatever else happens
        removed = []
        for step, name in sorted(dirs.items()):
            if step in keep:
                continue
            try:
                remove_checkpoint(self.store.child(name))
                removed.append(step)
            except OSError as exc:
                log.warning("could not remove %s: %s", self.path(step), exc)
        return removed

    def load_latest(self, model: nn.Module, optimizer: Muon | None) -> int | None:
        """Collective: load the newest committed step that loads; returns it, or None if none is committed.

        Only a step whose bytes are at fault (incomplete, or failing a checksum, size or structural
        check) is skipped for the one before it; that load then overwrites whatever the failed
        attempt had written. Any other error, a checkpoint refused as unsafe or one that does not
        fit the model among them, is raised at once: falling back to an older step, or starting
        over, because this process cannot read what it wrote would silently throw training away.
        When committed steps exist and none loads, :class:`NoLoadableCheckpointError` lists every
        step's error; None means there was nothing to resume from.
        """
        self.wait()
        failures: list[str] = []
        for step in reversed(self.steps()):
            try:
                self.last_extra = api.load(model, optimizer, self.path(step), storage_options=self.storage_options)
            except UnsafeCheckpointError:
                raise
            except (CheckpointCorruptError, CheckpointIncompleteError) as exc:
                log.warning("skipping %s: %s", self.path(step), exc)
                failures.append(f"{self.path(step)}: {exc}")
                continue
            if _rank() == 0:
                self.clean_up()
            return step
        if failures:
            raise NoLoadableCheckpointError(failures)
        return None
