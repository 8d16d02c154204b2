"""The one-line doors: ``save``, ``load`` and ``async_save`` of a dmuon model and optimizer.

torch's idiom (``dcp.save`` / ``dcp.load`` / ``dcp.async_save``) for a script that saves now and
then. Each is a call on a checkpointer (``checkpointer.py``): ``save`` and ``load`` on a new one,
``async_save`` on the :class:`~dmuon.dcp.AsyncCheckpointer` kept on the model (its staging memory
and gloo group are reused by the model's next async save, and freed with the model or by
``model_checkpointer(model).close()``). A training loop that saves every few steps and resumes
keeps a :class:`~dmuon.dcp.CheckpointManager` instead.
"""

from __future__ import annotations

import os

from torch import nn

from ..optim.muon import Muon
from .checkpointer import Checkpointer, SaveHandle, model_checkpointer
from .plan_cache import SavePlanCache

__all__ = ["async_save", "load", "model_checkpointer", "save"]


def save(
    model: nn.Module,
    optimizer: Muon | None,
    checkpoint_id: str | os.PathLike,
    *,
    extra: dict | None = None,
    storage_options: dict | None = None,
    overwrite: bool = False,
    plan_cache: SavePlanCache | None = None,
    key_prefixes: int = 0,
) -> None:
    """Collective: every rank writes its own share straight to ``checkpoint_id``
    (:meth:`Checkpointer.save <dmuon.dcp.Checkpointer.save>`). ``plan_cache``: keep one per rank
    across the saves of a job and a save whose layout did not change skips re-planning; a
    :class:`~dmuon.dcp.Checkpointer` kept by the caller does the same on its own.
    ``key_prefixes``: spread the data files over that many key prefixes (object storage)."""
    checkpointer = Checkpointer(storage_options=storage_options, key_prefixes=key_prefixes)
    if plan_cache is not None:
        checkpointer.plan_cache = plan_cache
    checkpointer.save(model, optimizer, checkpoint_id, extra=extra, overwrite=overwrite)


def load(
    model: nn.Module,
    optimizer: Muon | None,
    checkpoint_id: str | os.PathLike,
    *,
    storage_options: dict | None = None,
    allow_partial_load: bool = False,
    cooperative: bool | None = None,
    cast_dtypes: bool = False,
) -> dict:
    """Collective: load model (and optimizer) from a checkpoint of any topology, or the model
    from HuggingFace safetensors; returns the saved ``extra``
    (:meth:`Checkpointer.load <dmuon.dcp.Checkpointer.load>`)."""
    return Checkpointer(storage_options=storage_options).load(
        model,
        optimizer,
        checkpoint_id,
        allow_partial_load=allow_partial_load,
        cooperative=cooperative,
        cast_dtypes=cast_dtypes,
    )


def async_save(
    model: nn.Module,
    optimizer: Muon | None,
    checkpoint_id: str | os.PathLike,
    *,
    extra: dict | None = None,
    storage_options: dict | None = None,
    overwrite: bool = False,
    key_prefixes: int = 0,
) -> SaveHandle:
    """Collective: copy this rank's share to host memory, return, write it in the background.

    The background write runs its collectives on a gloo group of its own, never the training
    group. One async save per model is in flight at a time: the next save waits for the
    previous one and raises its error if it failed unobserved.
    """
    return model_checkpointer(model).save(
        model,
        optimizer,
        checkpoint_id,
        extra=extra,
        storage_options=storage_options,
        overwrite=overwrite,
        key_prefixes=key_prefixes,
    )
