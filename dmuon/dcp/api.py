"""One-call save / load / async_save of a dmuon model and optimizer through DCP."""
from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, TensorStorageMetadata
from torch.distributed.tensor import DTensor

from ..optim.muon import Muon
from .errors import CheckpointError
from .planner import DMuonLoadPlanner, DMuonSavePlanner
from .state import AppState, StagedShard, global_offsets
from .storage import DMuonStorageReader, DMuonStorageWriter, open_checkpoint

log = logging.getLogger(__name__)


def _first_failure(exc: CheckpointException) -> BaseException:
    rank = min(exc.failures)
    return exc.failures[rank][0]


def run_checkpoint_op(fn, *args, what: str, **kwargs):
    """Call ``dcp.save``/``dcp.load``; turn torch's BaseException into a typed, catchable error."""
    try:
        return fn(*args, **kwargs)
    except CheckpointException as exc:
        cause = _first_failure(exc)
        ranks = sorted(exc.failures)
        message = f"{what} failed on rank(s) {ranks}: {cause}"
        error_type = type(cause) if isinstance(cause, CheckpointError) else CheckpointError
        try:
            error = error_type(message)
        except TypeError:
            error = CheckpointError(message)
        raise error from cause


# ---------------------------------------------------------------------------------------------
# save / load
# ---------------------------------------------------------------------------------------------
def save(
    model: nn.Module,
    optimizer: Muon | None,
    checkpoint_id: str | os.PathLike,
    *,
    extra: dict | None = None,
    storage_options: dict | None = None,
    overwrite: bool = False,
) -> None:
    """Collective: every rank writes its own share straight to ``checkpoint_id``.

    ``checkpoint_id`` is a local directory or an fsspec URL (``s3://``, ``gs://``, ...).
    An existing committed checkpoint is only replaced with ``overwrite=True``, and then stays
    readable until the new one commits.
    """
    raise_pending_async_failure()
    state = AppState(model, optimizer, extra).state_dict()
    writer = DMuonStorageWriter(checkpoint_id, storage_options=storage_options, overwrite=overwrite)
    run_checkpoint_op(dcp.save, state, storage_writer=writer, planner=DMuonSavePlanner(),
                      what=f"save to {checkpoint_id}")


def _extra_template(metadata: Metadata) -> dict:
    """Skeleton of the saved ``extra`` subtree, for DCP to fill in (keys come from the metadata)."""
    template: dict = {}
    mappings = metadata.planner_data or {}
    for fqn, md in metadata.state_dict_metadata.items():
        path = mappings.get(fqn)
        if not path or path[0] != "extra":
            continue
        if isinstance(md, TensorStorageMetadata):
            value: Any = torch.empty(md.size, dtype=md.properties.dtype)
        elif isinstance(md, BytesStorageMetadata):
            value = None
        else:  # pragma: no cover - future metadata kinds
            continue
        set_element(template, path, value)
    return template.get("extra", {})


def load(
    model: nn.Module,
    optimizer: Muon | None,
    checkpoint_id: str | os.PathLike,
    *,
    storage_options: dict | None = None,
    allow_partial_load: bool = False,
) -> dict:
    """Collective: load model (and optimizer) from any topology; returns the saved ``extra``.

    Shapes and dtypes are checked for every key first; on a mismatch nothing is written and
    one error lists every problem. ``allow_partial_load=True`` skips mismatched keys instead.
    A HuggingFace safetensors file or directory loads the model part (``optimizer=None``).
    """
    from .hf import is_safetensors_checkpoint, load_safetensors

    if is_safetensors_checkpoint(checkpoint_id, storage_options):
        if optimizer is not None:
            raise ValueError("a safetensors checkpoint holds weights only: pass optimizer=None")
        load_safetensors(model, checkpoint_id, storage_options=storage_options, strict=not allow_partial_load)
        return {}
    listing = open_checkpoint(checkpoint_id, storage_options)  # typed errors before any collective
    app = AppState(model, optimizer)
    state = app.state_dict()
    extra = _extra_template(listing.metadata)
    if extra:
        state["extra"] = extra
    reader = DMuonStorageReader(checkpoint_id, storage_options=storage_options, listing=listing)
    planner = DMuonLoadPlanner(allow_partial_load=allow_partial_load)
    run_checkpoint_op(dcp.load, state, storage_reader=reader, planner=planner,
                      what=f"load from {checkpoint_id}")
    app.load_state_dict(state)
    return app.loaded_extra


# ---------------------------------------------------------------------------------------------
# async save
# ---------------------------------------------------------------------------------------------
_CHECKPOINT_GROUP: dist.ProcessGroup | None = None
_IN_FLIGHT: list["AsyncSaveHandle"] = []


def checkpoint_process_group() -> dist.ProcessGroup | None:
    """A gloo group used only by background checkpoint collectives (created on first use)."""
    global _CHECKPOINT_GROUP
    if not dist.is_initialized():
        return None
    if _CHECKPOINT_GROUP is None:
        _CHECKPOINT_GROUP = dist.new_group(backend="gloo")
    return _CHECKPOINT_GROUP


_STAGING: dict[tuple, torch.Tensor] = {}


def release_staging_buffers() -> None:
    """Free the CPU copies async_save keeps between saves (they are re-created on demand)."""
    _STAGING.clear()


def _staged_copy(path: tuple, tensor: torch.Tensor) -> torch.Tensor:
    """Copy into this rank's staging buffer for ``path``, allocated once and reused.

    Reuse is safe because an async save only starts after the previous one has finished, and
    it saves the page faults of fresh allocations (most of the blocking time on CPU).
    """
    tensor = tensor.detach()
    buf = _STAGING.get(path)
    if buf is None or buf.shape != tensor.shape or buf.dtype != tensor.dtype:
        pin = tensor.device.type == "cuda"
        buf = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=pin)
        _STAGING[path] = buf
    buf.copy_(tensor, non_blocking=tensor.device.type != "cpu")
    return buf


def _stage(value: Any, path: tuple = ()) -> Any:
    """A private CPU copy of everything a rank will write; training may change the originals."""
    if isinstance(value, dict):
        return {k: _stage(v, path + (k,)) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_stage(v, path + (i,)) for i, v in enumerate(value))
    if isinstance(value, DTensor):
        return StagedShard(_staged_copy(path, value.to_local()), value.shape, global_offsets(value))
    if isinstance(value, torch.Tensor):
        return _staged_copy(path, value)
    import copy

    return copy.deepcopy(value)


class AsyncSaveHandle:
    """Returned by :func:`async_save`; ``wait()`` re-raises a background failure."""

    def __init__(self, checkpoint_id, staged: dict, writer, group) -> None:
        self.checkpoint_id = checkpoint_id
        self.error: BaseException | None = None
        self.reported = False
        self.started = time.perf_counter()
        self.finished: float | None = None
        self._thread = threading.Thread(
            target=self._run, args=(staged, writer, group), name="dmuon-async-save", daemon=True
        )
        self._thread.start()

    def _run(self, staged, writer, group) -> None:
        try:
            run_checkpoint_op(dcp.save, staged, storage_writer=writer, planner=DMuonSavePlanner(),
                              process_group=group, what=f"async save to {self.checkpoint_id}")
        except BaseException as exc:  # noqa: BLE001 - surfaced by wait()
            self.error = exc
        finally:
            self.finished = time.perf_counter()

    def done(self) -> bool:
        return not self._thread.is_alive()

    def wait(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError(f"async save to {self.checkpoint_id} still running after {timeout}s")
        if self in _IN_FLIGHT:
            _IN_FLIGHT.remove(self)
        if self.error is not None and not self.reported:
            self.reported = True
            raise CheckpointError(f"async save to {self.checkpoint_id} failed: {self.error}") from self.error


def raise_pending_async_failure() -> None:
    """Finish earlier async saves; a failure nobody has seen yet is raised here."""
    for handle in list(_IN_FLIGHT):
        handle.wait()


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
    group. One async save is in flight at a time: the next save waits for the previous one
    and raises its error if it failed unobserved.
    """
    raise_pending_async_failure()
    group = checkpoint_process_group()
    staged = _stage(AppState(model, optimizer, extra).state_dict())
    if torch.cuda.is_available():
        torch.cuda.synchronize()  # pinned non-blocking copies must land before training moves on
    writer = DMuonStorageWriter(checkpoint_id, storage_options=storage_options, overwrite=overwrite)
    handle = AsyncSaveHandle(checkpoint_id, staged, writer, group)
    _IN_FLIGHT.append(handle)
    return handle
