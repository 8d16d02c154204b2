"""Deprecated module: asynchronous saves live in ``checkpointer.py`` (the classes) and
``api.py`` (the ``async_save`` door); the old names work, with a warning, until dmuon 0.2."""

from __future__ import annotations

from typing import Any

from .deprecation import moved_name

_MOVED = {
    "AsyncCheckpointer": ("dmuon.dcp.checkpointer", "AsyncCheckpointer"),
    "AsyncSaveHandle": ("dmuon.dcp.checkpointer", "SaveHandle"),
    "async_save": ("dmuon.dcp.api", "async_save"),
    "async_checkpointer": ("dmuon.dcp.api", "model_checkpointer"),
}


def __getattr__(name: str) -> Any:
    return moved_name(__name__, name, _MOVED)
