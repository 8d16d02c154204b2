"""dmuon's DCP backend: owner-written sharded checkpoints on local disk, S3 and GCS."""

from .api import load, save
from .app_state import AppState, DedicatedEntry, DedicatedLayout
from .async_checkpointer import AsyncCheckpointer, AsyncSaveHandle, async_checkpointer, async_save
from .checkpoint import CheckpointListing, inspect, open_checkpoint, verify
from .errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointExistsError,
    CheckpointIncompleteError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    NoLoadableCheckpointError,
    PlanCacheError,
    SaveRefusedError,
    StorageError,
    UnsafeCheckpointError,
)
from .export import export
from .hf_config import MissingConfigWarning
from .load_planner import DMuonLoadPlanner
from .manager import CheckpointManager
from .plan_cache import SavePlanCache
from .reader import DMuonStorageReader
from .save_planner import DMuonSavePlanner
from .storage import RetryPolicy, Store
from .storage.registry import open_store, register_store, unregister_store
from .tiers import PreemptionReport, RestoreReport, TieredCheckpointManager
from .writer import DMuonStorageWriter

__all__ = [
    "AppState",
    "AsyncCheckpointer",
    "AsyncSaveHandle",
    "CheckpointCorruptError",
    "CheckpointError",
    "CheckpointExistsError",
    "CheckpointIncompleteError",
    "CheckpointListing",
    "CheckpointManager",
    "CheckpointMismatchError",
    "CheckpointNotFoundError",
    "DMuonLoadPlanner",
    "DMuonSavePlanner",
    "DMuonStorageReader",
    "DMuonStorageWriter",
    "DedicatedEntry",
    "DedicatedLayout",
    "MissingConfigWarning",
    "NoLoadableCheckpointError",
    "PlanCacheError",
    "PreemptionReport",
    "RestoreReport",
    "RetryPolicy",
    "SavePlanCache",
    "SaveRefusedError",
    "StorageError",
    "Store",
    "TieredCheckpointManager",
    "UnsafeCheckpointError",
    "async_checkpointer",
    "async_save",
    "export",
    "inspect",
    "load",
    "open_checkpoint",
    "open_store",
    "register_store",
    "save",
    "unregister_store",
    "verify",
]
