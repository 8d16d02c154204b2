"""The tiers' background thread: replication, promotion and retention, one job at a time.

Jobs run in the order they were submitted, on one thread per owner, so every rank runs the
same collectives in the same order. A job's failure is kept and raised by the next
:meth:`BackgroundWork.raise_failure` (the manager calls it at its next save, step boundary or
wait): a failed background copy is never lost silently. The object is an
:class:`dmuon.exit_guard.InFlight`, so the end of the job (``destroy_process_group``, exit)
waits for the work in flight.
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Callable

from ... import exit_guard

__all__ = ["BackgroundWork"]


class BackgroundWork:
    """One worker thread and the jobs given to it; owned (and closed) by a manager."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._jobs: list[tuple[str, concurrent.futures.Future]] = []
        self._tracked = False

    def submit(self, description: str, fn: Callable[[], None]) -> None:
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=self.name)
        if not self._tracked:
            exit_guard.track(self)
            self._tracked = True
        self._jobs.append((description, self._executor.submit(fn)))

    def busy(self) -> bool:
        return any(not future.done() for _, future in self._jobs)

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for every job (at most ``timeout`` seconds); True when none is left running."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for _, future in list(self._jobs):
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                future.exception(timeout=left)
            except concurrent.futures.TimeoutError:
                return False
        return True

    def raise_failure(self) -> None:
        """Forget finished jobs; raise the first failure among them."""
        done = [(d, f) for d, f in self._jobs if f.done()]
        self._jobs = [(d, f) for d, f in self._jobs if not f.done()]
        for _, future in done:
            error = future.exception()
            if error is not None:
                raise error

    # exit_guard.InFlight -------------------------------------------------------------------
    def pending_description(self) -> str | None:
        running = [d for d, f in self._jobs if not f.done()]
        return ", ".join(running) if running else None

    def finish_pending(self) -> str | None:
        self.wait()
        errors = [f"{d}: {f.exception()}" for d, f in self._jobs if f.exception() is not None]
        self._jobs = []
        return "; ".join(errors) if errors else None

    def close(self) -> None:
        """Wait for the jobs, stop the thread; raise the first failure nobody has seen."""
        try:
            self.wait()
            self.raise_failure()
        finally:
            if self._executor is not None:
                self._executor.shutdown(wait=True)
                self._executor = None
