"""One-call save / load / async_save of a dmuon model and optimizer through DCP."""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, TensorStorageMetadata

from .. import compat
from ..optim.muon import Muon
from .app_state import AppState
from .async_checkpointer import pending_async_saves
from .checkpoint import open_checkpoint
from .errors import from_checkpoint_exception
from .format.layout import EXTRA_SECTION
from .gc_pause import paused_gc
from .hf import is_safetensors_checkpoint, load_safetensors
from .load_planner import DMuonLoadPlanner
from .plan_cache import SavePlanCache
from .reader import DMuonStorageReader
from .save_planner import DMuonSavePlanner
from .writer import DMuonStorageWriter

__all__ = ["extra_template", "load", "run_checkpoint_op", "save"]

log = logging.getLogger(__name__)


def run_checkpoint_op(fn, *args, what: str, **kwargs):
    """Call ``dcp.save``/``dcp.load``; turn torch's BaseException into a typed, catchable error."""
    try:
        return fn(*args, **kwargs)
    except CheckpointException as exc:
        raise from_checkpoint_exception(exc, what) from exc.failures[min(exc.failures)][0]


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
    plan_cache: SavePlanCache | None = None,
) -> None:
    """Collective: every rank writes its own share straight to ``checkpoint_id``.

    ``checkpoint_id`` is a local directory or an fsspec URL (``s3://``, ``gs://``, ...).
    An existing committed checkpoint is only replaced with ``overwrite=True``, and then stays
    readable until the new one commits. ``plan_cache``: keep one per rank across the saves of a
    job and a save whose layout did not change skips re-planning (cleared here if a save fails).
    Python's garbage collector is paused for the call (``gc_pause.py``).
    """
    pending = pending_async_saves(model)
    if pending is not None:
        pending.raise_pending_failure()
    state = AppState(model, optimizer, extra).state_dict()
    writer = DMuonStorageWriter(checkpoint_id, storage_options=storage_options, overwrite=overwrite)
    planner = DMuonSavePlanner(plan_cache=plan_cache)
    try:
        with paused_gc():
            run_checkpoint_op(dcp.save, state, storage_writer=writer, planner=planner, what=f"save to {checkpoint_id}")
    except BaseException:
        if plan_cache is not None:
            plan_cache.clear()  # every rank fails the same save: the caches stay in step
        raise


def extra_template(metadata: Metadata) -> dict:
    """Skeleton of the saved ``extra`` subtree, for DCP to fill in (keys come from the metadata)."""
    template: dict = {}
    mappings = metadata.planner_data or {}
    for fqn, md in metadata.state_dict_metadata.items():
        path = mappings.get(fqn)
        if not path or path[0] != EXTRA_SECTION:
            continue
        if isinstance(md, TensorStorageMetadata):
            value: Any = torch.empty(md.size, dtype=md.properties.dtype)
        elif isinstance(md, BytesStorageMetadata):
            value = None
        else:  # pragma: no cover - future metadata kinds
            continue
        compat.set_element(template, path, value)
    return template.get(EXTRA_SECTION, {})


def load(
    model: nn.Module,
    optimizer: Muon | None,
    checkpoint_id: str | os.PathLike,
    *,
    storage_options: dict | None = None,
    allow_partial_load: bool = False,
    cooperative: bool | None = None,
) -> dict:
    """Collective: load model (and optimizer) from any topology; returns the saved ``extra``.

    Shapes and dtypes are checked for every key first; on a mismatch nothing is written and
    one error lists every problem; ``allow_partial_load=True`` skips mismatched keys instead.
    A HuggingFace safetensors file or directory loads the model part (``optimizer=None``).
    A region several ranks hold identical copies of (HSDP replicas, a dedicated weight's shard
    column) is read from storage by one of them and sent to the others (``cooperative.py``;
    from a local path only to ranks of other machines: one machine's page cache serves its
    ranks); ``cooperative=False`` (or ``DMUON_COOPERATIVE_LOAD=0``) has every rank read for
    itself, ``True`` exchanges between ranks of one machine too.
    Python's garbage collector is paused for the call.
    """
    if is_safetensors_checkpoint(checkpoint_id, storage_options):
        if optimizer is not None:
            raise ValueError("a safetensors checkpoint holds weights only: pass optimizer=None")
        load_safetensors(model, checkpoint_id, storage_options=storage_options, strict=not allow_partial_load)
        return {}
    listing = open_checkpoint(checkpoint_id, storage_options)  # typed errors before any collective
    app = AppState(model, optimizer)
    state = app.state_dict()
    extra = extra_template(listing.metadata)
    if extra:
        state[EXTRA_SECTION] = extra
    reader = DMuonStorageReader(
        checkpoint_id, storage_options=storage_options, listing=listing, cooperative=cooperative
    )
    planner = DMuonLoadPlanner(allow_partial_load=allow_partial_load)
    with paused_gc():
        run_checkpoint_op(dcp.load, state, storage_reader=reader, planner=planner, what=f"load from {checkpoint_id}")
    app.load_state_dict(state)
    return app.loaded_extra
