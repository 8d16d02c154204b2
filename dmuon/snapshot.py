"""Lazy snapshots: an async save copies the state while training goes on; what changes it waits.

``dmuon.dcp.async_save`` (and the async checkpointer and managers) return as soon as the save
is started: the copy of the state to host memory runs in the background while the loop runs
its forward and backward passes, which do not change the parameters or the optimizer state.
What does change them in place waits for that copy first, so the checkpoint is the state at
the call, bit for bit:

* ``dmuon.Muon.step()`` (every weight, master and moment it updates);
* dmuon's loads into the model (``set_model_state_dict``, ``model.load_state_dict``, the
  checkpointers' ``load``).

State changed outside dmuon during that window (a user's in-place edit of a weight, a
module's running statistics in a forward pass) is not waited for: call
:func:`wait_for_snapshots` (or ``with snapshot_window_closed(model):``) before such an edit.

The copies in flight are kept on the model (never module state): each save registers its
copy's future there, and a finished one is dropped at the next look.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
from collections.abc import Iterator

from torch import nn

__all__ = ["SNAPSHOTS_ATTR", "snapshot_window_closed", "track_snapshot", "wait_for_snapshots"]

SNAPSHOTS_ATTR = "_dmuon_snapshots_in_flight"


def track_snapshot(model: nn.Module, copied: concurrent.futures.Future) -> None:
    """``copied`` completes once a save's copy of ``model``'s state is in host memory."""
    pending = [future for future in getattr(model, SNAPSHOTS_ATTR, []) if not future.done()]
    pending.append(copied)
    setattr(model, SNAPSHOTS_ATTR, pending)


def wait_for_snapshots(model: nn.Module) -> None:
    """Block until every save's copy of ``model``'s state is taken. A copy that failed is not
    raised here: its save reports it (``wait()``, the next save, the exit guard)."""
    pending = getattr(model, SNAPSHOTS_ATTR, None)
    if not pending:
        return
    for future in pending:
        concurrent.futures.wait([future])
    setattr(model, SNAPSHOTS_ATTR, [])


@contextlib.contextmanager
def snapshot_window_closed(model: nn.Module) -> Iterator[None]:
    """Inside, no save is copying ``model``'s state: edit it in place safely."""
    wait_for_snapshots(model)
    yield
