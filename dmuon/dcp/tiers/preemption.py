"""A preemption notice (SIGTERM from a spot or preemptible node's agent) turned into a flag.

The handler only records which signal came and when; nothing else can safely run inside a
signal handler while training may be in the middle of a collective. The training loop's
manager reads the flag at its next step boundary, where all ranks agree on it and save
(:meth:`TieredCheckpointManager.step`).

Composes with :mod:`dmuon.exit_guard`: that guard puts its own handler in front only while an
asynchronous save is in flight, finishes the save on a signal and then calls the handler it
found, which is this one: the flag is set and the process goes on to its step boundary
instead of dying. The watcher belongs to its caller (a manager); :meth:`close` puts the
previous handlers back. It can only be installed from the main thread (Python's rule).
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterable
from typing import Any

__all__ = ["PreemptionWatcher"]


class PreemptionWatcher:
    """Sets :attr:`requested` when one of ``signals`` arrives; nothing more."""

    def __init__(self, signals: Iterable[int] = (signal.SIGTERM,)) -> None:
        self.signals = tuple(signal.Signals(s) for s in signals)
        self.received: signal.Signals | None = None
        self.received_at: float | None = None  # time.monotonic() of the first signal
        self._previous: dict[signal.Signals, Any] = {}
        if self.signals and threading.current_thread() is not threading.main_thread():
            raise RuntimeError(
                "a preemption handler can only be installed from the main thread: create the manager "
                "there, or pass preemption_signals=() and call notify() yourself"
            )
        for signum in self.signals:
            self._previous[signum] = signal.getsignal(signum)
            signal.signal(signum, self._on_signal)

    def _on_signal(self, signum: int, frame: Any) -> None:
        self.notify(signal.Signals(signum))

    def notify(self, signum: signal.Signals | None = None) -> None:
        """Record a preemption notice (what the handler does; also for notices that come
        another way, a metadata-server poll for instance). The first one counts."""
        if self.received_at is None:
            self.received = signum
            self.received_at = time.monotonic()

    @property
    def requested(self) -> bool:
        return self.received_at is not None

    def seconds_since(self) -> float:
        return 0.0 if self.received_at is None else time.monotonic() - self.received_at

    def close(self) -> None:
        """Put back the handlers found at install, where ours is still the one installed."""
        if threading.current_thread() is not threading.main_thread():
            return
        for signum, previous in self._previous.items():
            if signal.getsignal(signum) == self._on_signal:
                signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
        self._previous.clear()
