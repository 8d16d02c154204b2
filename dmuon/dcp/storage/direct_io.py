"""Writing a file past the page cache (``O_DIRECT``), from aligned staging buffers or straight
from the caller's memory (:class:`DirectFile`).

Whether that beats the page cache on a given filesystem is measured (``write_path.py``), and
``local.LocalStore`` uses it only there.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import mmap
import os
import queue
import threading

import numpy

__all__ = ["BORROW_MIN_BYTES", "DIRECT_IO_ALIGN", "MAX_BORROWED_BYTES", "O_DIRECT", "STAGING_BYTES", "DirectFile"]

O_DIRECT = getattr(os, "O_DIRECT", 0)  # Linux (and a few others) only; 0 where there is none
DIRECT_IO_ALIGN = 4096  # offset, length and address alignment O_DIRECT needs (>= logical block size)
STAGING_BYTES = 8 << 20  # per staging buffer; two per open file
# Borrowed writes (DirectFile.write_borrowed): below this size a buffer is copied, since lining
# it up costs the writer up to DIRECT_IO_ALIGN bytes of padding in the file (<= 0.4% here).
BORROW_MIN_BYTES = 1 << 20
# Caller memory the background thread may still be reading: bounds how much a caller's
# temporary buffers (a GPU tensor's CPU copy, say) are kept alive by writes in flight.
MAX_BORROWED_BYTES = 64 << 20


class DirectFile:
    """A write-only file that bypasses the page cache (``O_DIRECT``), for checkpoint data.

    Why: a buffered write copies every byte into page-cache pages the kernel must allocate and
    later write back; on many machines (VMs above all) that costs several times the CPU of the
    write itself, and the pages then evict the training job's own cache.

    Two ways in. :meth:`write` copies the caller's bytes into one of two page-aligned staging
    buffers while a background thread writes the other one to the device (``os.pwrite``
    releases the GIL), so the copy, the caller's checksum and the device overlap.
    :meth:`write_borrowed` skips the copy where it can: when the buffer's address and the
    file position are congruent modulo :data:`DIRECT_IO_ALIGN` (the writer pads its file to
    make them so), the aligned middle of the buffer goes to the device straight from the
    caller's memory, and only the unaligned ends are staged. Either way data goes out at
    aligned offsets in aligned lengths; ``flush()`` writes the unaligned tail through a second,
    buffered descriptor and keeps it staged, so a later write continues from an aligned
    offset. A write that failed in the background is raised by the next ``write`` or
    ``flush``.
    """

    memory_alignment = DIRECT_IO_ALIGN
    borrow_min_bytes = BORROW_MIN_BYTES

    def __init__(self, path: str) -> None:
        self._path = path
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | O_DIRECT, 0o644)
        self._tail_fd: int | None = None
        self._maps = [mmap.mmap(-1, STAGING_BYTES) for _ in range(2)]
        self._views = [memoryview(staging) for staging in self._maps]
        self._filling, self._filled = self._views[0], 0  # the buffer being filled, bytes in it
        self._base = 0  # file offset of self._filling[0]; always aligned
        self._free: queue.SimpleQueue = queue.SimpleQueue()
        self._free.put(self._views[1])
        # (buffers written as one, file offset, staging buffer to hand back or None, Event set
        # when written or None); None stops the thread. Jobs run in order, one at a time.
        self._jobs: queue.Queue = queue.Queue()
        self._borrowed: collections.deque = collections.deque()  # (Event, nbytes) of borrowed jobs
        self._borrowed_bytes = 0
        self.in_place_bytes = 0  # bytes handed to the device straight from callers' memory
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._write_jobs, name="dmuon-direct-write", daemon=True)
        self._thread.start()

    def fileno(self) -> int:
        return self._fd

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        total = view.nbytes
        while view.nbytes:
            take = min(STAGING_BYTES - self._filled, view.nbytes)
            self._filling[self._filled : self._filled + take] = view[:take]
            self._filled += take
            view = view[take:]
            if self._filled == STAGING_BYTES:
                self._hand_over_staging()
        return total

    def write_borrowed(self, data) -> int:
        """:meth:`write`, but a large buffer lined up with the file (address congruent to the
        file position modulo :data:`DIRECT_IO_ALIGN`) is written from its own memory by the
        background thread: the caller must leave it unchanged until :meth:`flush` returns."""
        view = memoryview(data).cast("B")
        to_boundary = -(self._base + self._filled) % DIRECT_IO_ALIGN
        in_place = (view.nbytes - to_boundary) // DIRECT_IO_ALIGN * DIRECT_IO_ALIGN
        if in_place < self.borrow_min_bytes or (_address(view) + to_boundary) % DIRECT_IO_ALIGN:
            return self.write(view)
        self.write(view[:to_boundary])  # the file position is now aligned, and so is the rest
        while self._borrowed and self._borrowed_bytes + in_place > MAX_BORROWED_BYTES:
            done, nbytes = self._borrowed.popleft()
            done.wait()
            self._borrowed_bytes -= nbytes
        done = threading.Event()
        self._borrowed.append((done, in_place))
        self._borrowed_bytes += in_place
        self.in_place_bytes += in_place
        # what is staged goes out in the same request: a small write of its own would wait
        # behind other writers' large ones in the device's queue
        self._hand_over_staging(view[to_boundary : to_boundary + in_place], done)
        self.write(view[to_boundary + in_place :])
        return view.nbytes

    def _hand_over_staging(self, borrowed: memoryview | None = None, done: threading.Event | None = None) -> None:
        """Queue the filled part of the staging buffer (an aligned length), followed in the
        file by ``borrowed`` if given, and take the other buffer back once the thread has
        written it."""
        buffers = [self._filling[: self._filled]] if self._filled else []
        if borrowed is not None:
            buffers.append(borrowed)
        self._jobs.put((buffers, self._base, self._filling if self._filled else None, done))
        self._base += sum(buffer.nbytes for buffer in buffers)
        if self._filled:
            self._filling, self._filled = self._free.get(), 0
        self._raise_failure()

    def flush(self) -> None:
        """Everything written so far is in the file (durable after an fsync)."""
        aligned = self._filled - self._filled % DIRECT_IO_ALIGN
        if aligned:
            self._jobs.put(([self._filling[:aligned]], self._base, None, None))
        self._jobs.join()
        self._borrowed.clear()  # all written: the caller may change those buffers again
        self._borrowed_bytes = 0
        self._raise_failure()
        tail = self._filling[aligned : self._filled]
        if tail.nbytes:
            _pwrite_all(self._buffered_fd(), tail, self._base + aligned)
        if aligned:
            self._filling[: tail.nbytes] = tail
            self._base += aligned
            self._filled = tail.nbytes
        tail.release()

    def _buffered_fd(self) -> int:
        """A second descriptor without O_DIRECT, for writes that cannot be aligned."""
        if self._tail_fd is None:
            self._tail_fd = os.open(self._path, os.O_WRONLY)
        return self._tail_fd

    def _write_direct(self, buffers: list[memoryview], offset: int) -> None:
        """Near a limit (disk full, file-size limit) the kernel shortens a write to an
        unaligned length, which O_DIRECT refuses (EINVAL) or leaves an unaligned rest; the
        buffered descriptor then writes what it can and raises the real error."""
        try:
            written = os.pwritev(self._fd, buffers, offset)
        except OSError as error:
            if error.errno != errno.EINVAL:
                raise
            written = 0
        for buffer in buffers:
            if written < buffer.nbytes:
                _pwrite_all(self._buffered_fd(), buffer[written:], offset + written)
            offset += buffer.nbytes
            written = max(written - buffer.nbytes, 0)

    def _write_jobs(self) -> None:
        while True:
            job = self._jobs.get()
            try:
                if job is None:
                    return
                buffers, offset, staging, done = job
                if self._error is None:
                    try:
                        self._write_direct(buffers, offset)
                    except BaseException as error:  # raised in the caller's thread
                        self._error = error
                for buffer in buffers:
                    buffer.release()
                if staging is not None:
                    self._free.put(staging)
                if done is not None:
                    done.set()
            finally:
                self._jobs.task_done()

    def _raise_failure(self) -> None:
        error = self._error
        if isinstance(error, OSError):
            raise OSError(error.errno, f"{error.strerror or error} (writing {self._path})") from error
        if error is not None:
            raise error

    def close(self) -> None:
        """Stops the background thread and frees the staging buffers; writes nothing more."""
        if self._thread.is_alive():
            self._jobs.put(None)
            self._thread.join()
        self._borrowed.clear()
        for fd in (self._fd, self._tail_fd):
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self._tail_fd = None
        for view in self._views:
            view.release()
        for staging in self._maps:
            with contextlib.suppress(BufferError):  # a slice still referenced somewhere
                staging.close()


def _address(view: memoryview) -> int:
    """Where a buffer's first byte lies in memory."""
    return int(numpy.frombuffer(view, dtype=numpy.uint8).ctypes.data)


def _pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    while view.nbytes:
        written = os.pwrite(fd, view, offset)
        view, offset = view[written:], offset + written
