"""An async save still in flight when the job ends is finished, or reported; never dropped.

Training scripts end with ``dist.destroy_process_group()`` and a return, with an exception, or
with the launcher's SIGTERM. An asynchronous checkpoint still writing at that moment needs its
process group to commit: torn down under it, the save fails in its background thread, the
error sits in a future nobody reads, and the process exits 0 with nothing committed. Three
guards close those doors:

1. ``destroy_process_group`` (dmuon's second patch, made here and nowhere else): before a
   process group is torn down, every save in flight in this process is waited for. dmuon's own
   saves register themselves (:func:`track`); torch's thread-based ``dcp.async_save`` (what
   torchtitan's async mode calls) is recognised by the name of its worker thread. A dmuon save
   that failed is then reported on stderr with its path and raised from the call.
2. Interpreter exit: before Python starts shutting down (while thread pools, which object
   store clients need, still take work; ``threading``'s own exit hook, which runs before the
   interpreter joins threads and long before ``atexit``), every save in flight is finished; a
   dmuon save that could not commit is then reported on stderr, naming its path, and the
   process exits with status 1 instead of 0.
3. SIGTERM (and SIGINT) while a dmuon save is in flight: the handler, installed by the save
   from the main thread, finishes the save, says on stderr whether it committed, and then lets
   the signal do what it did before (the previous handler, or the default: exit by the signal).

What is tracked is visible (:func:`saves_in_flight`) and released with its owner (a weak set).
Once the whole job's groups are destroyed (``destroy_process_group()`` without a group), each
tracked owner that holds process groups of its own (an ``AsyncCheckpointer``'s gloo group, the
tiers' two) is asked to drop them (``release_process_groups``), so that nothing of dmuon's keeps
a dead group alive until the interpreter tears down (docs/reliability.md, "Exit status").

The guard is installed by the first public name of ``dmuon`` or ``dmuon.dcp`` used
(``lazy.py``) and by every background save dmuon starts (:func:`track`).
"""

from __future__ import annotations

import atexit
import functools
import logging
import os
import signal
import sys
import threading
import weakref
from collections.abc import Callable
from typing import Protocol

import torch
import torch.distributed as dist

from .compat import DCP_ASYNC_THREAD_PREFIX

__all__ = [
    "ExitGuardError",
    "HoldsGroups",
    "InFlight",
    "guard_signals",
    "install",
    "release_signals_if_idle",
    "saves_in_flight",
    "track",
]

log = logging.getLogger(__name__)


class ExitGuardError(RuntimeError):
    """A save in flight could not be guarded, or failed at teardown without being committed."""


class InFlight(Protocol):
    """What the guard needs of an object that may hold a save in flight."""

    def pending_description(self) -> str | None:
        """The checkpoint being written, or None when nothing is in flight."""

    def finish_pending(self) -> str | None:
        """Wait for the save in flight; None if it committed, else why not (never raises)."""


class HoldsGroups(Protocol):
    """What a tracked owner that keeps process groups of its own may offer besides."""

    def release_process_groups(self) -> None:
        """Drop every reference to the process groups it made (they are destroyed already)."""


_tracked: weakref.WeakSet = weakref.WeakSet()
_SIGNALS = (signal.SIGTERM, signal.SIGINT)
_previous_handlers: dict[int, object] = {}
_PATCHED = "_dmuon_exit_guard"
_install_error: str | None = None
_handling_signal = False


def track(owner: InFlight) -> None:
    """Have the guards wait for ``owner``'s saves (kept until ``owner`` is garbage collected);
    installs the guard first if nothing did yet."""
    install()
    if _install_error is not None:
        raise ExitGuardError(_install_error)
    _tracked.add(owner)


def saves_in_flight() -> list[str]:
    """The checkpoints dmuon is writing in the background in this process right now."""
    return [desc for owner in list(_tracked) if (desc := owner.pending_description()) is not None]


def _say(message: str) -> None:
    print(f"dmuon: {message}", file=sys.stderr, flush=True)


def _finish_all(why: str) -> list[str]:
    """Wait for every save in flight, dmuon's and torch's; returns one line per failed dmuon save."""
    failures = []
    for owner in list(_tracked):
        desc = owner.pending_description()
        if desc is None:
            continue
        _say(f"{why}: finishing the async save to {desc} first")
        error = owner.finish_pending()
        if error is None:
            _say(f"async save to {desc} committed")
        else:
            failures.append(f"async save to {desc} was NOT committed: {error}")
            _say(failures[-1])
    current = threading.current_thread()
    for thread in threading.enumerate():  # torch's own async saves (torchtitan's among them)
        if thread is not current and thread.name.startswith(DCP_ASYNC_THREAD_PREFIX):
            thread.join(timeout=1.0)  # a finished save's thread needs a moment to end: say nothing
            if thread.is_alive():
                _say(f"{why}: waiting for torch's async checkpoint thread {thread.name}")
                thread.join()
    return failures


# ---------------------------------------------------------------------------------------------
# 1. destroy_process_group
# ---------------------------------------------------------------------------------------------
def _guarded_destroy(original: Callable) -> Callable:
    @functools.wraps(original)
    def destroy_process_group(group=None):
        failures = _finish_all("destroy_process_group()")
        original(group)
        if group is None:
            _release_groups()
        if failures:
            raise ExitGuardError("\n".join(failures))

    setattr(destroy_process_group, _PATCHED, True)
    return destroy_process_group


def _release_groups() -> None:
    """Every tracked owner drops the process groups it made: the whole job's are gone now."""
    for owner in list(_tracked):
        release = getattr(owner, "release_process_groups", None)
        if release is not None:
            try:
                release()
            except Exception as exc:  # a teardown must not fail on this
                log.warning("releasing the process groups of %r failed: %s", owner, exc)


def install() -> None:
    """Idempotent; made by the first public name of ``dmuon`` or ``dmuon.dcp`` used, and by
    :func:`track`. If torch no longer has the patched function, only async saves are disabled,
    with an error naming it when one is started."""
    global _install_error
    import torch.distributed.distributed_c10d as c10d

    original = getattr(c10d, "destroy_process_group", None)
    if getattr(original, _PATCHED, False) or _install_error is not None:
        return
    if original is None or not callable(original) or getattr(dist, "destroy_process_group", None) is not original:
        _install_error = (
            f"dmuon's async saves need torch.distributed.destroy_process_group to guard a save in flight at "
            f"teardown, and torch {torch.__version__} does not have it where dmuon looks; async saves are disabled"
        )
        return
    patched = _guarded_destroy(original)  # type: ignore[arg-type]
    c10d.destroy_process_group = patched
    dist.destroy_process_group = patched
    # threading's exit hooks run first thing at shutdown, in reverse order of registration:
    # this one before concurrent.futures stops taking work. Where a Python lacks the hook, the
    # save is still finished (Python joins its thread) and a failure reported, from atexit.
    register = getattr(threading, "_register_atexit", None)
    if register is not None:
        register(_finish_at_exit)
    else:  # pragma: no cover - CPython 3.10-3.14 have it
        atexit.register(_finish_at_exit)


# ---------------------------------------------------------------------------------------------
# 2. interpreter exit
# ---------------------------------------------------------------------------------------------
def _finish_at_exit() -> None:
    failures = _finish_all("exit")
    if failures:
        _say("exiting with status 1: the last checkpoint of this run was lost (see above)")
        sys.stdout.flush()
        logging.shutdown()
        os._exit(1)  # an exit hook cannot set the status any other way


# ---------------------------------------------------------------------------------------------
# 3. SIGTERM / SIGINT
# ---------------------------------------------------------------------------------------------
def guard_signals() -> None:
    """From the main thread, while a save is in flight: finish it on SIGTERM/SIGINT first.

    Elsewhere (another thread) nothing is installed. The previous handlers come back as soon
    as a signal was handled; a Python handler that was there before is called after the save.
    """
    if threading.current_thread() is not threading.main_thread():
        return
    for signum in _SIGNALS:
        current = signal.getsignal(signum)
        if current is _on_signal or current is None:  # ours already, or set outside Python
            continue
        _previous_handlers[signum] = current
        signal.signal(signum, _on_signal)


def release_signals_if_idle() -> None:
    """Put the previous handlers back once nothing is in flight (from the main thread only):
    a Python-level handler delays a signal while the main thread is inside a long C call."""
    if threading.current_thread() is not threading.main_thread() or saves_in_flight():
        return
    _restore_handlers()


def _restore_handlers() -> None:
    for signum, handler in _previous_handlers.items():
        if signal.getsignal(signum) is _on_signal:
            signal.signal(signum, handler)  # type: ignore[arg-type]
    _previous_handlers.clear()


def _on_signal(signum: int, frame) -> None:
    global _handling_signal
    if _handling_signal:  # a launcher often sends SIGTERM twice: the first one is being handled
        return
    _handling_signal = True
    name = signal.Signals(signum).name
    try:
        _finish_all(f"{name} received")
    finally:
        _handling_signal = False
    previous = _previous_handlers.get(signum, signal.SIG_DFL)
    _restore_handlers()
    if callable(previous):
        previous(signum, frame)
    elif previous == signal.SIG_DFL:
        signal.signal(signum, signal.SIG_DFL)
        sys.stdout.flush()
        sys.stderr.flush()
        os.kill(os.getpid(), signum)
