"""dmuon's DCP backend: owner-written sharded checkpoints on local disk, S3 and GCS."""
from .api import load, save
from .async_checkpointer import AsyncCheckpointer, AsyncSaveHandle, async_checkpointer, async_save
from .errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointExistsError,
    CheckpointIncompleteError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    SaveRefusedError,
    StorageError,
    UnsafeCheckpointError,
)
from .export import export
from .manager import CheckpointManager
from .planner import DMuonLoadPlanner, DMuonSavePlanner
from .state import AppState, DedicatedEntry, DedicatedLayout
from .storage import DMuonStorageReader, DMuonStorageWriter

__all__ = [
    "AppState",
    "AsyncCheckpointer",
    "AsyncSaveHandle",
    "CheckpointCorruptError",
    "CheckpointError",
    "CheckpointExistsError",
    "CheckpointIncompleteError",
    "CheckpointManager",
    "CheckpointMismatchError",
    "CheckpointNotFoundError",
    "DMuonLoadPlanner",
    "DMuonSavePlanner",
    "DMuonStorageReader",
    "DMuonStorageWriter",
    "DedicatedEntry",
    "DedicatedLayout",
    "SaveRefusedError",
    "StorageError",
    "UnsafeCheckpointError",
    "async_checkpointer",
    "async_save",
    "export",
    "load",
    "save",
]
