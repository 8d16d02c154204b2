"""Buffered writes whose writeback starts while the file is still being written.

A buffered save copies its bytes into the page cache and then waits in ``fsync`` for the
device to take all of them: copy time plus device time, one after the other, and every byte
dirty in memory at once until the end. Asking the kernel to start writing each completed
window back right away (Linux ``sync_file_range(SYNC_FILE_RANGE_WRITE)``, which does not wait)
lets the device work while later windows are copied, so the closing ``fsync`` finds little
left, and dirty memory stays near one window per open file. The pages stay cached: a load
right after the save (a job rolling back on its own node) reads memory, not the device.

Nothing is written that the save would not write anyway (it fsyncs at the end), so this is
used for every streamed local file that will be fsynced. Where the call does not exist (not
Linux, or no glibc), writes are plain buffered writes.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from typing import BinaryIO

__all__ = ["WRITE_BEHIND_WINDOW", "WriteBehindFile", "start_writeback"]

WRITE_BEHIND_WINDOW = 16 << 20  # bytes between two starts of writeback
_SYNC_FILE_RANGE_WRITE = 2  # <fcntl.h>: start writeback of dirty pages, do not wait


def _load_sync_file_range():
    """libc's ``sync_file_range``, or None where there is none."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        function = ctypes.CDLL(name, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    function.restype = ctypes.c_int
    return function


_sync_file_range = _load_sync_file_range()


def start_writeback(fd: int, offset: int, length: int) -> bool:
    """Ask the kernel to start writing ``length`` bytes at ``offset`` back (no wait); False
    where that cannot be asked (the bytes are then written back by the closing fsync)."""
    if _sync_file_range is None:
        return False
    return _sync_file_range(fd, offset, length, _SYNC_FILE_RANGE_WRITE) == 0


class WriteBehindFile:
    """A buffered write-only file that starts writeback of every :data:`WRITE_BEHIND_WINDOW`
    written; otherwise a plain ``open(path, "wb")`` file (``flush``, ``fileno``, ``close``)."""

    def __init__(self, path: str, window: int = WRITE_BEHIND_WINDOW) -> None:
        self._file: BinaryIO = open(path, "wb")
        self._window = window
        self._written = 0  # bytes handed to write() so far
        self._started = 0  # writeback asked for up to here

    def write(self, data) -> int:
        n = self._file.write(data)
        self._written += n
        if self._written - self._started >= self._window:
            self._file.flush()  # (only the few bytes its buffer still holds)
            if not start_writeback(self._file.fileno(), self._started, self._written - self._started):
                self._window = 1 << 62  # not available here: stop asking
            self._started = self._written
        return n

    def flush(self) -> None:
        self._file.flush()

    def fileno(self) -> int:
        return self._file.fileno()

    def tell(self) -> int:
        return self._written

    def close(self) -> None:
        self._file.close()

    @property
    def closed(self) -> bool:
        return self._file.closed
