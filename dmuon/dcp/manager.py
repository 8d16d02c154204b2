"""Step-numbered checkpoints under one root, with retention and crash recovery."""

from __future__ import annotations

import logging
import os

from torch import nn

from ..optim.muon import Muon
from ..topology import current_rank as _rank
from .checkpointer import AsyncCheckpointer, Checkpointer, SaveHandle
from .deprecation import renamed, renamed_argument
from .errors import (
    CheckpointCorruptError,
    CheckpointIncompleteError,
    NoLoadableCheckpointError,
    UnsafeCheckpointError,
)
from .format.layout import step_dir_name
from .step_root import StepRoot
from .storage.registry import open_store, root_location

__all__ = ["CheckpointManager"]

log = logging.getLogger(__name__)


class CheckpointManager:
    """``root/step-<N>`` checkpoints: save, resume from the newest good one, keep the last few.

    A training job keeps one and calls :meth:`save` every few steps and :meth:`resume` at
    start. Retention never deletes the newest committed step nor the one being written;
    steps that a crash left without ``.metadata`` are ignored by :meth:`steps` and deleted.
    Deleting removes ``.metadata`` first, so an interrupted deletion can only leave an
    incomplete directory. Saves and loads go through the manager's :attr:`checkpointer` (a
    :class:`~dmuon.dcp.Checkpointer`, or an :class:`~dmuon.dcp.AsyncCheckpointer` with
    ``async_save``), which keeps what saves keep from one to the next (the save plans, the
    staging memory): :meth:`close` frees them.

    Args:
        root: a local directory or an fsspec URL (``s3://bucket/run``, ``gs://...``).
        keep: committed steps kept; older ones are deleted after each save (>= 1).
        async_save: save in the background: :meth:`save` returns once this rank's share is
            copied to host memory. Needs ``keep >= 2``, since the step being written cannot be
            the only one kept.
        storage_options: passed to the store of ``root`` (fsspec options: endpoint,
            credentials; ``direct_io`` for a local directory: ``{"direct_io": False}`` for
            steps meant to be restored on the node that wrote them, which then read them from
            memory; the default follows ``storage/write_path.py``'s rule).
        key_prefixes: spread each step's data files over that many key prefixes (object
            storage with many writers; docs/checkpoint.md, "Key prefixes"); 0, off, by default.
        keep_last: the old name of ``keep`` (deprecated).
    """

    def __init__(
        self,
        root: str | os.PathLike,
        *,
        keep: int = 3,
        async_save: bool = False,
        storage_options: dict | None = None,
        keep_last: int | None = None,
        key_prefixes: int = 0,
    ) -> None:
        keep = renamed_argument("CheckpointManager", "keep_last", keep_last, "keep", keep)
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        if async_save and keep < 2:
            raise ValueError(
                "with async_save, keep must be >= 2: the step being written cannot count as the only one kept"
            )
        self.root = root_location(root)
        self.keep = keep
        self.async_save = async_save
        self.storage_options = storage_options
        self.store = open_store(self.root, storage_options)
        self.step_root = StepRoot(self.store)
        self.checkpointer: Checkpointer = (
            AsyncCheckpointer(storage_options=storage_options, key_prefixes=key_prefixes)
            if async_save
            else Checkpointer(storage_options=storage_options, key_prefixes=key_prefixes)
        )
        self._step_in_flight: int | None = None
        self.last_extra: dict = {}  # what resume's checkpoint carried in ``extra``

    @property
    def keep_last(self) -> int:
        renamed("CheckpointManager.keep_last", "CheckpointManager.keep")
        return self.keep

    def path(self, step: int) -> str:
        return f"{self.root}/{step_dir_name(step)}"

    def steps(self) -> list[int]:
        """Committed steps, oldest first."""
        return self.step_root.committed()

    def _writing(self) -> int | None:
        handle = self.checkpointer.in_flight
        return self._step_in_flight if handle is not None and not handle.done() else None

    def save(self, step: int, model: nn.Module, optimizer: Muon | None, extra: dict | None = None) -> SaveHandle:
        """Collective. A step saved twice (after a resume) is replaced safely. The previous
        save is finished first, and its failure raised."""
        self.checkpointer.wait()
        self._step_in_flight = step
        handle = self.checkpointer.save(model, optimizer, self.path(step), extra=extra, overwrite=True)
        if _rank() == 0:
            self.clean_up()
        return handle

    def wait(self, timeout: float | None = None) -> bool:
        """Finish the save in flight and raise its failure; False if ``timeout`` seconds passed
        first (it stays in flight)."""
        return self.checkpointer.wait(timeout)

    def close(self) -> None:
        """Finish the save in flight (raising its failure) and free what saves keep."""
        self.checkpointer.close()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def clean_up(self) -> list[int]:
        """Delete uncommitted leftovers and committed steps beyond ``keep``; returns them."""
        return self.step_root.retain(self.keep, writing=self._writing())

    def load_latest(self, model: nn.Module, optimizer: Muon | None) -> int | None:
        """Deprecated name of :meth:`resume`."""
        renamed("CheckpointManager.load_latest()", "CheckpointManager.resume()")
        return self.resume(model, optimizer)

    def resume(self, model: nn.Module, optimizer: Muon | None, *, cast_dtypes: bool = False) -> int | None:
        """Collective: load the newest committed step that loads; returns it, or None if none is committed.

        Only a step whose bytes are at fault (incomplete, or failing a checksum, size or structural
        check) is skipped for the one before it; that load then overwrites whatever the failed
        attempt had written. Any other error, a checkpoint refused as unsafe or one that does not
        fit the model among them, is raised at once: falling back to an older step, or starting
        over, because this process cannot read what it wrote would silently throw training away.
        When committed steps exist and none loads, :class:`NoLoadableCheckpointError` lists every
        step's error; None means there was nothing to resume from. ``cast_dtypes``: as for
        :meth:`Checkpointer.load <dmuon.dcp.Checkpointer.load>` (a bf16 run resuming an fp32 one).
        """
        self.wait()
        failures: list[str] = []
        for step in reversed(self.steps()):
            try:
                self.last_extra = self.checkpointer.load(model, optimizer, self.path(step), cast_dtypes=cast_dtypes)
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
