"""Asynchronous saves: copy to CPU memory, return, write in the background.

A thin layer over torch's ``dcp.async_save`` (thread-based) that adds what a training job
needs from it, on an object the caller owns:

* background collectives run on a gloo group of their own, never the training group (DCP's
  collectives in a background thread can deadlock with training collectives on one group);
* one save in flight at a time; a failure nobody has looked at is raised at the next save;
* the CPU staging copies are reused from one save to the next (torch's stager keeps one CPU
  storage per source storage) and released by :meth:`AsyncCheckpointer.close`;
* the save plans too (a :class:`~dmuon.dcp.SavePlanCache`): a save whose layout did not
  change skips re-planning; a failed save clears them;
* a save still in flight when the job ends (``destroy_process_group``, exit, an exception,
  SIGTERM) is finished first, or reported on stderr with a non-zero exit
  (:mod:`dmuon.exit_guard`); ``close()`` remains the way to end cleanly.

``dmuon.dcp.async_save(model, ...)`` uses the checkpointer of that model (see
:func:`async_checkpointer`); a :class:`~dmuon.dcp.CheckpointManager` owns its own.
"""

from __future__ import annotations

import concurrent.futures
import os
import time
from typing import cast

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

from .. import exit_guard
from ..optim.muon import Muon
from .app_state import AppState
from .errors import CheckpointError, from_checkpoint_exception
from .plan_cache import SavePlanCache
from .save_planner import DMuonSavePlanner
from .writer import DMuonStorageWriter

__all__ = ["AsyncCheckpointer", "AsyncSaveHandle", "async_checkpointer", "async_save", "pending_async_saves"]


class AsyncSaveHandle:
    """One background save; ``wait()`` re-raises its failure as a :class:`CheckpointError`."""

    def __init__(self, checkpoint_id, future: concurrent.futures.Future) -> None:
        self.checkpoint_id = checkpoint_id
        self.started = time.perf_counter()
        self.finished: float | None = None
        self.reported = False
        self._future = future
        future.add_done_callback(self._mark_finished)

    def _mark_finished(self, _future) -> None:
        self.finished = time.perf_counter()

    def done(self) -> bool:
        return self._future.done()

    @property
    def error(self) -> BaseException | None:
        return self._future.exception() if self._future.done() else None

    def wait(self, timeout: float | None = None) -> None:
        try:
            self._future.exception(timeout)
        except concurrent.futures.TimeoutError:
            raise TimeoutError(f"async save to {self.checkpoint_id} still running after {timeout}s") from None
        error = self._future.exception()
        if error is not None and not self.reported:
            self.reported = True
            if isinstance(error, CheckpointException):
                error = from_checkpoint_exception(error, f"async save to {self.checkpoint_id}")
            raise CheckpointError(f"async save to {self.checkpoint_id} failed: {error}") from error


def _staging_options() -> StagingOptions:
    """Pinned host memory where there is an accelerator to copy from; plain memory on CPU
    (torch's defaults need an accelerator and fail on a CPU-only machine)."""
    accelerator = torch.accelerator.is_available()
    return StagingOptions(
        use_pinned_memory=accelerator,
        use_shared_memory=False,
        use_async_staging=False,
        use_non_blocking_copy=accelerator,
    )


class AsyncCheckpointer:
    """What asynchronous saves keep between calls: a gloo group, staging buffers, the save in
    flight. Create one per training job (collective on first save); ``close()`` frees it."""

    def __init__(self) -> None:
        self._group: dist.ProcessGroup | None = None
        self._stager: DefaultStager | None = None
        self._in_flight: AsyncSaveHandle | None = None
        self.plan_cache = SavePlanCache()

    @property
    def in_flight(self) -> AsyncSaveHandle | None:
        return self._in_flight

    def pending_description(self) -> str | None:
        """The checkpoint being written, or whose failure nobody has seen (exit guard protocol)."""
        handle = self._in_flight
        if handle is None or (handle.done() and (handle.error is None or handle.reported)):
            return None
        return str(handle.checkpoint_id)

    def finish_pending(self) -> str | None:
        """Wait for the save in flight; None if it committed, else its error (exit guard protocol)."""
        handle = self._in_flight
        if handle is None:
            return None
        try:
            handle.wait()
        except CheckpointError as exc:
            return str(exc)
        return None

    def _process_group(self) -> dist.ProcessGroup | None:
        if self._group is None and dist.is_initialized():
            # every rank is a member, so never GroupMember.NON_GROUP_MEMBER (in torch 2.14's stubs)
            self._group = cast(dist.ProcessGroup, dist.new_group(backend="gloo"))
        return self._group

    def raise_pending_failure(self) -> None:
        """Wait for the save in flight; raise its failure if nobody has seen it yet."""
        handle, self._in_flight = self._in_flight, None
        if handle is None:
            return
        try:
            handle.wait()
        finally:
            if handle.error is not None:  # (every rank's save failed: every rank clears)
                self.plan_cache.clear()
            exit_guard.release_signals_if_idle()

    def save(
        self,
        model: nn.Module,
        optimizer: Muon | None,
        checkpoint_id: str | os.PathLike,
        *,
        extra: dict | None = None,
        storage_options: dict | None = None,
        overwrite: bool = False,
    ) -> AsyncSaveHandle:
        """Collective: stage this rank's share in CPU memory, return, write in the background.

        Training may change the model as soon as this returns: the checkpoint holds the
        state at the call.
        """
        self.raise_pending_failure()
        exit_guard.track(self)  # raises first if this torch cannot guard a save at teardown
        group = self._process_group()
        if self._stager is None:
            self._stager = DefaultStager(_staging_options())
        state = AppState(model, optimizer, extra).state_dict()
        writer = DMuonStorageWriter(checkpoint_id, storage_options=storage_options, overwrite=overwrite)
        future = dcp.async_save(
            state,
            storage_writer=writer,
            planner=DMuonSavePlanner(plan_cache=self.plan_cache),
            process_group=group,
            async_stager=self._stager,
        )
        assert isinstance(future, concurrent.futures.Future)  # staging is synchronous here
        self._in_flight = AsyncSaveHandle(checkpoint_id, future)
        exit_guard.guard_signals()
        return self._in_flight

    def close(self) -> None:
        """Finish the save in flight (raising its failure), then free staging memory."""
        try:
            self.raise_pending_failure()
        finally:
            if self._stager is not None:
                self._stager.close()
                self._stager = None
            self.plan_cache.clear()


_CHECKPOINTER_ATTR = "_dmuon_async_checkpointer"


def async_checkpointer(model: nn.Module) -> AsyncCheckpointer:
    """The checkpointer ``async_save(model, ...)`` uses for this model (created on first use,
    freed with the model or by its ``close()``)."""
    checkpointer = pending_async_saves(model)
    if checkpointer is None:
        checkpointer = AsyncCheckpointer()
        setattr(model, _CHECKPOINTER_ATTR, checkpointer)
    return checkpointer


def pending_async_saves(model: nn.Module) -> AsyncCheckpointer | None:
    """The model's checkpointer if ``async_save`` ever ran on it (a sync save checks it first)."""
    return getattr(model, _CHECKPOINTER_ATTR, None)


def async_save(
    model: nn.Module,
    optimizer: Muon | None,
    checkpoint_id: str | os.PathLike,
    *,
    extra: dict | None = None,
    storage_options: dict | None = None,
    overwrite: bool = False,
) -> AsyncSaveHandle:
    """Collective: copy this rank's share to CPU memory, return, write it in the background.

    The background write runs its collectives on a dedicated gloo group, never the training
    group. One async save per model is in flight at a time: the next save waits for the
    previous one and raises its error if it failed unobserved.
    """
    return async_checkpointer(model).save(
        model, optimizer, checkpoint_id, extra=extra, storage_options=storage_options, overwrite=overwrite
    )
