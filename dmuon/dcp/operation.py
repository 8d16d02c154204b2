"""One DCP save or load under a checkpointer: the call, its state, and its failures named.

``run_checkpoint_op`` runs ``dcp.save``/``dcp.load`` and turns what breaks into dmuon's
errors (torch's ``CheckpointException``; a rank that stopped, ``rank_failure.py``).
``open_once`` opens a checkpoint's small files on one rank for all; ``load_state`` builds
what a load fills in, for the checkpointers and for the tiers' planning of a load.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, TensorStorageMetadata

from .. import compat
from ..optim.muon import Muon
from .agreement import broadcast_over, decided
from .app_state import AppState
from .checkpoint import CheckpointListing, open_checkpoint
from .errors import from_checkpoint_exception
from .format.layout import EXTRA_SECTION
from .rank_failure import Phases, RollCall, explain_failure
from .storage.registry import open_store

__all__ = ["extra_template", "load_state", "open_once", "run_checkpoint_op"]


def run_checkpoint_op(fn, *args, what: str, phases: Phases | None = None, consequence: str = "", **kwargs):
    """Call ``dcp.save``/``dcp.load``; turn torch's BaseException into a typed, catchable error,
    and (given ``phases``) a collective broken by a rank that stopped into an error naming it
    (``rank_failure.py``)."""
    roll_call = RollCall() if phases is not None else None
    try:
        return fn(*args, **kwargs)
    except CheckpointException as exc:
        raise from_checkpoint_exception(exc, what) from exc.failures[min(exc.failures)][0]
    except RuntimeError as exc:
        if roll_call is None or phases is None:
            raise
        explained = explain_failure(exc, roll_call, what, phases.now, consequence)
        if explained is None:
            raise
        raise explained from exc
    finally:
        if roll_call is not None:
            roll_call.close()


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


def open_once(checkpoint_id: str | os.PathLike, storage_options: dict | None) -> CheckpointListing:
    """Collective: rank 0 reads and checks the checkpoint's small files (the listing,
    ``.metadata``, the manifest) and sends what it found to every rank, instead of every rank
    reading them from storage: one read per load, not one per rank (what a job of thousands
    of ranks asks of one object-store key at once). A failure there (missing, incomplete,
    corrupt) is raised on every rank with its type."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return open_checkpoint(checkpoint_id, storage_options)

    def opened() -> tuple:
        listing = open_checkpoint(checkpoint_id, storage_options)
        return listing.metadata, listing.manifest, listing.files, listing.manifest_file

    metadata, manifest, files, manifest_file = decided(
        opened, 0, dist.get_rank(), broadcast_over(), f"opening {os.fspath(checkpoint_id)}"
    )
    store = open_store(checkpoint_id, storage_options)
    return CheckpointListing(store, metadata, manifest, files=files, manifest_file=manifest_file)


def load_state(model: nn.Module, optimizer: Muon | None, metadata: Metadata) -> tuple[AppState, dict]:
    """What a load of ``metadata``'s checkpoint fills in, built in one place for the loads and
    for the tiers' planning of one: the model's and optimizer's state, and the skeleton of the
    saved ``extra``; with the :class:`AppState` that puts it back."""
    app = AppState(model, optimizer)
    state = app.state_dict()
    extra = extra_template(metadata)
    if extra:
        state[EXTRA_SECTION] = extra
    return app, state
