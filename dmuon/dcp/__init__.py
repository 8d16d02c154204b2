"""dmuon's DCP backend: owner-written sharded checkpoints on local disk, S3 and GCS.

Which door for which job (README.md has the table with examples):

* a script: :func:`save` / :func:`load` / :func:`async_save`, torch's idiom;
* a training loop with resume and retention: :class:`CheckpointManager`;
* node-local tiers, replication and preemption: :class:`TieredCheckpointManager`;
* your own loop over saves: a :class:`Checkpointer` or :class:`AsyncCheckpointer` kept by you;
* torch's own ``dcp.save`` / ``dcp.load`` / ``dcp.async_save``, torchtitan: :class:`AppState`
  and the planners, reader and writer below.

The names are imported when first used (``dmuon/lazy.py``): ``import dmuon.dcp`` alone imports
no torch. Everything else stays importable from the submodules (``dmuon.dcp.storage``, ``.errors``,
``.tiers``, ...). Names that moved from here still work, with a ``DeprecationWarning`` naming
their new place (``deprecation.py``), until dmuon 0.2.
"""

import sys
from typing import TYPE_CHECKING, Any

from .. import lazy
from .deprecation import moved_name

#: public name -> the module it is imported from on first use (dmuon/lazy.py)
PUBLIC = {
    "AppState": "dmuon.dcp.app_state",
    "AsyncCheckpointer": "dmuon.dcp.checkpointer",
    "CheckpointCorruptError": "dmuon.dcp.errors",
    "CheckpointError": "dmuon.dcp.errors",
    "CheckpointExistsError": "dmuon.dcp.errors",
    "CheckpointIncompleteError": "dmuon.dcp.errors",
    "CheckpointManager": "dmuon.dcp.manager",
    "CheckpointMismatchError": "dmuon.dcp.errors",
    "CheckpointNotFoundError": "dmuon.dcp.errors",
    "Checkpointer": "dmuon.dcp.checkpointer",
    "DMuonLoadPlanner": "dmuon.dcp.load_planner",
    "DMuonSavePlanner": "dmuon.dcp.save_planner",
    "DMuonStorageReader": "dmuon.dcp.reader",
    "DMuonStorageWriter": "dmuon.dcp.writer",
    "NoLoadableCheckpointError": "dmuon.dcp.errors",
    "SaveHandle": "dmuon.dcp.checkpointer",
    "StorageError": "dmuon.dcp.errors",
    "TieredCheckpointManager": "dmuon.dcp.tiers",
    "UnsafeCheckpointError": "dmuon.dcp.errors",
    "async_save": "dmuon.dcp.api",
    "export": "dmuon.dcp.export",
    "inspect": "dmuon.dcp.checkpoint",
    "load": "dmuon.dcp.api",
    "save": "dmuon.dcp.api",
    "verify": "dmuon.dcp.checkpoint",
}

if TYPE_CHECKING:  # what type checkers and IDEs see; at run time, __getattr__ imports them
    from .api import async_save, load, save
    from .app_state import AppState
    from .checkpoint import inspect, verify
    from .checkpointer import AsyncCheckpointer, Checkpointer, SaveHandle
    from .errors import (
        CheckpointCorruptError,
        CheckpointError,
        CheckpointExistsError,
        CheckpointIncompleteError,
        CheckpointMismatchError,
        CheckpointNotFoundError,
        NoLoadableCheckpointError,
        StorageError,
        UnsafeCheckpointError,
    )
    from .export import export
    from .load_planner import DMuonLoadPlanner
    from .manager import CheckpointManager
    from .reader import DMuonStorageReader
    from .save_planner import DMuonSavePlanner
    from .tiers import TieredCheckpointManager
    from .writer import DMuonStorageWriter

__all__ = [
    "AppState",
    "AsyncCheckpointer",
    "CheckpointCorruptError",
    "CheckpointError",
    "CheckpointExistsError",
    "CheckpointIncompleteError",
    "CheckpointManager",
    "CheckpointMismatchError",
    "CheckpointNotFoundError",
    "Checkpointer",
    "DMuonLoadPlanner",
    "DMuonSavePlanner",
    "DMuonStorageReader",
    "DMuonStorageWriter",
    "NoLoadableCheckpointError",
    "SaveHandle",
    "StorageError",
    "TieredCheckpointManager",
    "UnsafeCheckpointError",
    "async_save",
    "export",
    "inspect",
    "load",
    "save",
    "verify",
]

#: old public name -> (where it lives now, its name there)
MOVED = {
    "AsyncSaveHandle": ("dmuon.dcp.checkpointer", "SaveHandle"),
    "async_checkpointer": ("dmuon.dcp.api", "model_checkpointer"),
    "CheckpointListing": ("dmuon.dcp.checkpoint", "CheckpointListing"),
    "open_checkpoint": ("dmuon.dcp.checkpoint", "open_checkpoint"),
    "DedicatedEntry": ("dmuon.dcp.app_state", "DedicatedEntry"),
    "DedicatedLayout": ("dmuon.dcp.app_state", "DedicatedLayout"),
    "PlanCacheError": ("dmuon.dcp.errors", "PlanCacheError"),
    "SaveRefusedError": ("dmuon.dcp.errors", "SaveRefusedError"),
    "SavePlanCache": ("dmuon.dcp.plan_cache", "SavePlanCache"),
    "RetryPolicy": ("dmuon.dcp.storage", "RetryPolicy"),
    "Store": ("dmuon.dcp.storage", "Store"),
    "open_store": ("dmuon.dcp.storage.registry", "open_store"),
    "register_store": ("dmuon.dcp.storage.registry", "register_store"),
    "unregister_store": ("dmuon.dcp.storage.registry", "unregister_store"),
    "PreemptionReport": ("dmuon.dcp.tiers", "PreemptionReport"),
    "RestoreReport": ("dmuon.dcp.tiers", "RestoreReport"),
}


def __getattr__(name: str) -> Any:
    if name in MOVED:  # warns on every use: never kept
        return moved_name(__name__, name, MOVED)
    return lazy.load(globals(), name, PUBLIC)


def __dir__() -> list[str]:
    return lazy.public_dir(globals(), PUBLIC)


# ``export`` is a public function and a submodule: importing the submodule must not put the
# module in the function's place (the import system sets the package's attribute)
lazy.keep_public_over_submodules(sys.modules[__name__], PUBLIC)
