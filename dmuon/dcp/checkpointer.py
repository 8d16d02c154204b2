"""The checkpointers: one save body and one load body for every door.

:class:`Checkpointer` saves and loads a model and its ``dmuon.Muon`` optimizer as DCP
checkpoints with dmuon's planners, reader and writer, through dmuon's own rounds
(``save_protocol.py``, ``load_protocol.py``, over a ``transport.py`` transport), and keeps
what one save leaves for the next: the save plans of an unchanged layout (a
:class:`~dmuon.dcp.plan_cache.SavePlanCache`).
:class:`AsyncCheckpointer` is the same object whose write runs in the background: ``save``
returns once this rank's share is copied to host memory, and its writer thread runs the very
body a synchronous save runs (``Checkpointer._save_body``: the same rounds, errors, garbage-
collector pause and plan-cache reset). It also keeps a gloo group of its own (collectives in a
background thread can deadlock with training collectives on one group) and the host staging
buffers (torch's ``DefaultStager``), reused from one save to the next. Both have one vocabulary:
``save`` returns a :class:`SaveHandle`, ``wait(timeout)`` says whether the save in flight
finished (and raises its failure), ``close`` frees what is kept.

The one-line doors (``dmuon.dcp.save``, ``load``, ``async_save``, in ``api.py``) and the
managers (``manager.py``, ``tiers/``) are built on these two classes and run no save of their
own. A save in flight at the end of a job is finished first, or reported on stderr with a
non-zero exit (:mod:`dmuon.exit_guard`); ``close()`` remains the way to end cleanly.
"""

from __future__ import annotations

import concurrent.futures
import os
import time
from typing import cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

from .. import exit_guard
from ..optim.muon import Muon
from ..snapshot import track_snapshot, wait_for_snapshots
from .app_state import AppState
from .errors import CheckpointError
from .gc_pause import paused_gc
from .group_transport import transport_over
from .hf import is_safetensors_checkpoint, load_safetensors
from .load_planner import DMuonLoadPlanner
from .load_protocol import run_load
from .operation import load_state, open_once
from .plan_cache import SavePlanCache
from .rank_failure import Phases
from .reader import DMuonStorageReader
from .save_planner import DMuonSavePlanner
from .save_protocol import run_save
from .transport import Transport
from .writer import DMuonStorageWriter

__all__ = ["AsyncCheckpointer", "Checkpointer", "SaveHandle", "model_checkpointer"]


class SaveHandle:
    """One save. A synchronous save's handle is done when ``save`` returns."""

    def __init__(
        self,
        checkpoint_id: str | os.PathLike,
        future: concurrent.futures.Future,
        copied: concurrent.futures.Future | None = None,
    ) -> None:
        self.checkpoint_id = checkpoint_id
        #: done once the state at the call is in host memory (at once for a synchronous save)
        self.copied = copied if copied is not None else future
        self.started = time.perf_counter()
        self.finished: float | None = None
        self.reported = False
        self._future = future
        future.add_done_callback(self._mark_finished)

    @classmethod
    def committed(cls, checkpoint_id: str | os.PathLike) -> SaveHandle:
        future: concurrent.futures.Future = concurrent.futures.Future()
        future.set_result(None)
        return cls(checkpoint_id, future)

    def _mark_finished(self, _future) -> None:
        self.finished = time.perf_counter()

    def done(self) -> bool:
        return self._future.done()

    @property
    def error(self) -> BaseException | None:
        return self._future.exception() if self._future.done() else None

    def wait(self, timeout: float | None = None) -> bool:
        """True once the save committed; False if ``timeout`` seconds passed first. A failed
        save raises a :class:`CheckpointError` (once: the next wait returns True)."""
        try:
            self._future.exception(timeout)
        except concurrent.futures.TimeoutError:
            return False
        error = self._future.exception()
        if error is not None and not self.reported:
            self.reported = True
            if isinstance(error, CheckpointError):  # typed and named by the save body
                raise error
            raise CheckpointError(f"async save to {self.checkpoint_id} failed: {error}") from error
        return True


class Checkpointer:
    """Saves and loads one training job's model and optimizer; collective (every rank calls
    every method, in the same order). ``storage_options``: the default for every call (fsspec
    options: endpoint, credentials; ``direct_io`` for a local directory). ``key_prefixes``:
    spread each save's data files over that many key prefixes (object storage with many
    writers; off by default; docs/checkpoint.md, "Key prefixes")."""

    def __init__(self, *, storage_options: dict | None = None, key_prefixes: int = 0) -> None:
        self.storage_options = storage_options
        self.key_prefixes = key_prefixes
        self.plan_cache = SavePlanCache()
        self._in_flight: SaveHandle | None = None

    writes_in_background = False  # (storage/write_path.py: what such a save's writes cost training)

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @property
    def in_flight(self) -> SaveHandle | None:
        return self._in_flight

    def save(
        self,
        model: nn.Module,
        optimizer: Muon | None,
        checkpoint_id: str | os.PathLike,
        *,
        extra: dict | None = None,
        storage_options: dict | None = None,
        overwrite: bool = False,
        key_prefixes: int | None = None,
    ) -> SaveHandle:
        """Collective: every rank writes its own share straight to ``checkpoint_id``.

        ``checkpoint_id`` is a local directory or an fsspec URL (``s3://``, ``gs://``, ...).
        An existing committed checkpoint is only replaced with ``overwrite=True``, and then
        stays readable until the new one commits. The previous save is finished first, and
        its failure raised. The checkpoint holds the state at the call, whatever training does
        after it returns. Python's garbage collector is paused while planning (``gc_pause.py``).
        """
        self.wait()
        _finish_other_saves(model, self)
        options = self.storage_options if storage_options is None else storage_options
        state = AppState(model, optimizer, extra).state_dict()
        prefixes = self.key_prefixes if key_prefixes is None else key_prefixes
        background = self.writes_in_background
        writer = DMuonStorageWriter(
            checkpoint_id, storage_options=options, overwrite=overwrite, key_prefixes=prefixes, in_background=background
        )
        planner = DMuonSavePlanner(plan_cache=self.plan_cache)
        self._in_flight = self._write(state, writer, planner, checkpoint_id, model)
        return self._in_flight

    def _write(
        self, state: dict, writer: DMuonStorageWriter, planner: DMuonSavePlanner, checkpoint_id, model: nn.Module
    ) -> SaveHandle:
        self._save_body(state, writer, planner, transport_over(None), f"save to {checkpoint_id}")
        return SaveHandle.committed(checkpoint_id)

    def _save_body(
        self, state: dict, writer: DMuonStorageWriter, planner: DMuonSavePlanner, transport: Transport, title: str
    ) -> None:
        """The one body of every save, synchronous or on an async save's writer thread: the
        rounds over ``transport`` (every rank's failure raised on every rank as dmuon's typed
        error naming the ranks and the round; a rank that stops named with the phase this rank
        was in), Python's garbage collector paused, and the plan cache cleared on failure, on
        every rank alike (every rank fails the same save), so that the caches stay in step."""
        phases = Phases("planning")
        writer.phases = phases
        try:
            with paused_gc(), transport.operation(title, phases, "nothing was committed"):
                run_save(state, writer, planner, transport)
        except BaseException:
            self.plan_cache.clear()
            raise

    def load(
        self,
        model: nn.Module,
        optimizer: Muon | None,
        checkpoint_id: str | os.PathLike,
        *,
        storage_options: dict | None = None,
        allow_partial_load: bool = False,
        cooperative: bool | None = None,
        cast_dtypes: bool = False,
    ) -> dict:
        """Collective: load model (and optimizer) from any topology; returns the saved ``extra``.

        Shapes and dtypes are checked for every key first; on a mismatch nothing is written
        and one error lists every problem; ``allow_partial_load=True`` skips mismatched keys
        instead. A HuggingFace safetensors file or directory loads the model part
        (``optimizer=None``). A region several ranks hold identical copies of (HSDP replicas, a
        dedicated weight's shard column) is read from storage by one of them and sent to the
        others (``cooperative.py``; from a local path only to ranks of other machines: one
        machine's page cache serves its ranks); ``cooperative=False`` (or
        ``DMUON_COOPERATIVE_LOAD=0``) has every rank read for itself, ``True`` exchanges
        between ranks of one machine too. ``cast_dtypes=True`` loads floating-point entries
        stored in another floating-point dtype by casting them (an fp32 checkpoint into a bf16
        model); without it they are refused, by name. The save in flight is finished first.
        """
        self.wait()
        _finish_other_saves(model, self)
        wait_for_snapshots(model)
        options = self.storage_options if storage_options is None else storage_options
        if is_safetensors_checkpoint(checkpoint_id, options):
            if optimizer is not None:
                raise ValueError("a safetensors checkpoint holds weights only: pass optimizer=None")
            load_safetensors(model, checkpoint_id, storage_options=options, strict=not allow_partial_load)
            return {}
        transport = transport_over(None)
        listing = open_once(checkpoint_id, options, transport)  # typed errors, the same on every rank
        app, state = load_state(model, optimizer, listing.metadata)
        reader = DMuonStorageReader(checkpoint_id, storage_options=options, listing=listing, cooperative=cooperative)
        planner = DMuonLoadPlanner(allow_partial_load=allow_partial_load, cast_dtypes=cast_dtypes)
        phases = Phases("planning")
        reader.phases = phases
        consequence = "the model and optimizer may be partly loaded: load again"
        with paused_gc(), transport.operation(f"load from {checkpoint_id}", phases, consequence):
            run_load(state, reader, planner, transport)
        app.load_state_dict(state)
        return app.loaded_extra

    def wait(self, timeout: float | None = None) -> bool:
        """Finish the save in flight and raise its failure if nobody has seen it yet; False if
        ``timeout`` seconds passed first (it stays in flight)."""
        handle = self._in_flight
        if handle is None:
            return True
        try:
            if not handle.wait(timeout):
                return False
        except BaseException:
            self._in_flight = None
            self.plan_cache.clear()  # (every rank's save failed: every rank clears)
            raise
        finally:
            if handle.done():
                exit_guard.release_signals_if_idle()
        self._in_flight = None
        return True

    def close(self) -> None:
        """Finish the save in flight (raising its failure), then free what saves keep."""
        try:
            self.wait()
        finally:
            self.plan_cache.clear()


def _staging_options() -> StagingOptions:
    """The copy in a background thread (on a side stream into pinned host memory where there
    is an accelerator, torch's stager keeping one host buffer per source storage, reused from
    one save to the next); plain memory on CPU (torch's defaults need an accelerator)."""
    accelerator = torch.accelerator.is_available()
    return StagingOptions(
        use_pinned_memory=accelerator,
        use_shared_memory=False,
        use_async_staging=True,
        use_non_blocking_copy=accelerator,
    )


class AsyncCheckpointer(Checkpointer):
    """A :class:`Checkpointer` whose saves write in the background: ``save`` returns once this
    rank's share is in host memory. One save in flight at a time; a failure nobody has looked
    at is raised at the next call. Its gloo group is created on the first save (collective).
    On ext4/XFS its data files are written with direct I/O unless ``direct_io`` says otherwise:
    the write's CPU is what training feels (``storage/write_path.py``)."""

    writes_in_background = True

    def __init__(self, *, storage_options: dict | None = None, key_prefixes: int = 0) -> None:
        super().__init__(storage_options=storage_options, key_prefixes=key_prefixes)
        self._group: dist.ProcessGroup | None = None
        self._stager: DefaultStager | None = None

    # -- the exit guard's protocol (exit_guard.InFlight) ----------------------------------------
    def pending_description(self) -> str | None:
        """The checkpoint being written, or whose failure nobody has seen."""
        handle = self._in_flight
        if handle is None or (handle.done() and (handle.error is None or handle.reported)):
            return None
        return str(handle.checkpoint_id)

    def finish_pending(self) -> str | None:
        """Wait for the save in flight; None if it committed, else its error."""
        handle = self._in_flight
        if handle is None:
            return None
        try:
            handle.wait()
        except CheckpointError as exc:
            return str(exc)
        return None

    def release_process_groups(self) -> None:
        """The job's groups were destroyed (exit guard): drop the reference to this one."""
        self._group = None

    def _process_group(self) -> dist.ProcessGroup | None:
        if self._group is None and dist.is_initialized():
            # every rank is a member, so never GroupMember.NON_GROUP_MEMBER (in torch 2.14's stubs)
            self._group = cast(dist.ProcessGroup, dist.new_group(backend="gloo"))
        return self._group

    def _write(
        self, state: dict, writer: DMuonStorageWriter, planner: DMuonSavePlanner, checkpoint_id, model: nn.Module
    ) -> SaveHandle:
        exit_guard.track(self)  # raises first if this torch cannot guard a save at teardown
        group = self._process_group()
        if self._stager is None:
            self._stager = DefaultStager(_staging_options())
        # Everything is in place, the write thread started, before the copy to host memory
        # starts (it runs in the background: lazy snapshot, dmuon/snapshot.py): once it runs,
        # its thread holds the GIL for long stretches, and each hand-back to this thread can
        # cost the interpreter's switch interval (5 ms). Measured, 2 ranks, 64 MiB: the call
        # took 3-17 ms, median 14, with the write thread started after the copy began.
        started: concurrent.futures.Future = concurrent.futures.Future()  # what the stager returns
        copied: concurrent.futures.Future = concurrent.futures.Future()  # the snapshot window
        track_snapshot(model, copied)  # what changes the state in place (Muon.step) waits for it

        def write() -> None:
            staged = started.result()
            copy = staged.result() if isinstance(staged, concurrent.futures.Future) else staged
            self._save_body(copy, writer, planner, transport_over(group), f"async save to {checkpoint_id}")

        executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="dmuon-async-save")
        written = executor.submit(write)
        written.add_done_callback(lambda _: executor.shutdown(wait=False))
        handle = SaveHandle(checkpoint_id, written, copied=copied)
        exit_guard.guard_signals()
        try:
            staged = self._stager.stage(state)
        except BaseException as error:
            self.plan_cache.clear()  # starting failed on every rank
            started.set_exception(error)
            copied.set_exception(error)
            raise
        _finish_with(staged, copied)
        started.set_result(staged)
        return handle

    def close(self) -> None:
        """Finish the save in flight (raising its failure), then free the staging memory."""
        try:
            super().close()
        finally:
            if self._stager is not None:
                self._stager.close()
                self._stager = None


def _finish_with(staged, copied: concurrent.futures.Future) -> None:
    """``copied`` is done (or failed) when the stager's copy is: what the snapshot window waits for."""
    if not isinstance(staged, concurrent.futures.Future):
        copied.set_result(None)
        return

    def done(future: concurrent.futures.Future) -> None:
        error = future.exception()
        if error is None:
            copied.set_result(None)
        else:
            copied.set_exception(error)

    staged.add_done_callback(done)


_CHECKPOINTER_ATTR = "_dmuon_async_checkpointer"


def model_checkpointer(model: nn.Module) -> AsyncCheckpointer:
    """The checkpointer ``dmuon.dcp.async_save`` uses for ``model`` (created on first use, kept
    on the model and freed with it, or by its ``close()``)."""
    checkpointer = getattr(model, _CHECKPOINTER_ATTR, None)
    if checkpointer is None:
        checkpointer = AsyncCheckpointer()
        setattr(model, _CHECKPOINTER_ATTR, checkpointer)
    return checkpointer


def _finish_other_saves(model: nn.Module, caller: Checkpointer) -> None:
    """Before another checkpointer saves or loads ``model``: the async save in flight from
    ``async_save(model, ...)`` is finished (and its failure raised); two saves of one model
    never write at once, and a load never races a save of the same model."""
    checkpointer = getattr(model, _CHECKPOINTER_ATTR, None)
    if checkpointer is not None and checkpointer is not caller:
        checkpointer.wait()
