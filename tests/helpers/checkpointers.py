"""The two ways a save runs, for fault tests that run each fault for both: the synchronous save,
and the async save, whose writer thread runs the same body (``Checkpointer._save_body``)."""
from __future__ import annotations

import dmuon.dcp as ddcp

KINDS = ("sync", "async")


def save(kind: str, model, optimizer, path, **kwargs) -> None:
    """Save with a fresh checkpointer of ``kind`` and wait for the commit; a failure is raised
    as that checkpointer raises it (``save`` for a synchronous one, ``wait`` for an async one)."""
    checkpointer = ddcp.AsyncCheckpointer() if kind == "async" else ddcp.Checkpointer()
    try:
        checkpointer.save(model, optimizer, path, **kwargs).wait()
    finally:
        checkpointer.close()
