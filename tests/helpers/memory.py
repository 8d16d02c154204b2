"""Resident-memory measurement for 'no rank holds the whole model' checks (bytes, not time)."""
from __future__ import annotations

import ctypes
import threading
import time

import psutil

_M_MMAP_THRESHOLD = -3


def return_freed_memory_to_os() -> None:
    """Make large frees visible in RSS: fixed mmap threshold (no dynamic growth) and a trim."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(_M_MMAP_THRESHOLD, 64 * 1024)
        libc.malloc_trim(0)
    except OSError:  # not glibc: measurements are then only upper bounds
        pass


class PeakRSS:
    """Samples this process's RSS every millisecond; ``growth`` is peak minus the starting RSS."""

    def __init__(self, interval: float = 0.001) -> None:
        self.interval = interval
        self.proc = psutil.Process()
        self.start = self.peak = 0
        self._stop = threading.Event()

    def __enter__(self) -> "PeakRSS":
        return_freed_memory_to_os()
        self.start = self.peak = self.proc.memory_info().rss
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.proc.memory_info().rss)
            time.sleep(self.interval)

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.proc.memory_info().rss)

    @property
    def growth(self) -> int:
        return self.peak - self.start
