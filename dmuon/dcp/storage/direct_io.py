"""Writing a file past the page cache (``O_DIRECT``), from aligned staging buffers or straight
from the caller's memory (:class:`DirectFile`).

``local.LocalStore`` uses it by default on filesystems whose ``O_DIRECT`` is plain, and where
``direct_io=True`` asks for it (``write_path.py``).
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

__all__ = [
    "BATCH_BYTES",
    "BORROW_MIN_BYTES",
    "DIRECT_IO_ALIGN",
    "MAX_BORROWED_BYTES",
    "O_DIRECT",
    "STAGING_BYTES",
    "DirectFile",
]

O_DIRECT = getattr(os, "O_DIRECT", 0)  # Linux (and a few others) only; 0 where there is none
DIRECT_IO_ALIGN = 4096  # offset, length and address alignment O_DIRECT needs (>= logical block size)
STAGING_BYTES = 8 << 20  # per staging buffer; two per open file
# Borrowed writes (DirectFile.write_borrowed): below this size a buffer is copied, since lining
# it up costs the writer up to DIRECT_IO_ALIGN bytes of padding in the file (<= 0.4% here).
BORROW_MIN_BYTES = 1 << 20
# Bytes gathered into one request to the device before it is queued (staged and borrowed).
BATCH_BYTES = 16 << 20
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
        self._segment = 0  # where in it the staged bytes not yet in a pending request start
        self._segment_at = 0  # file offset of self._filling[self._segment]; always aligned
        # The next request, gathered until it holds BATCH_BYTES: pieces of the staging buffer
        # and borrowed buffers, in file order from self._pending_at, and the Events of the
        # borrowed ones (set once written).
        self._pending: list[memoryview] = []
        self._pending_at = 0
        self._pending_done: list[threading.Event] = []
        self._free: queue.SimpleQueue = queue.SimpleQueue()
        self._free.put(self._views[1])
        # (buffers written as one, file offset, staging buffer to hand back or None, Events to
        # set when written); None stops the thread. Jobs run in order, one at a time, so a
        # staging buffer handed back with a job is no longer read by any.
        self._jobs: queue.Queue = queue.Queue()
        self._borrowed: collections.deque = collections.deque()  # (Event, nbytes) of borrowed jobs
        self._borrowed_bytes = 0
        self.in_place_bytes = 0  # bytes handed to the device straight from callers' memory
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._write_jobs, name="dmuon-direct-write", daemon=True)
        self._thread.start()

    def fileno(self) -> int:
        return self._fd

    def _position(self) -> int:
        """The file offset the next byte written goes to."""
        return self._segment_at + self._filled - self._segment

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        total = view.nbytes
        while view.nbytes:
            take = min(STAGING_BYTES - self._filled, view.nbytes)
            self._filling[self._filled : self._filled + take] = view[:take]
            self._filled += take
            view = view[take:]
            if self._filled == STAGING_BYTES:
                self._add_segment()
                self._submit(hand_back_staging=True)
        return total

    def write_borrowed(self, data) -> int:
        """:meth:`write`, but a large buffer lined up with the file (address congruent to the
        file position modulo :data:`DIRECT_IO_ALIGN`) is written from its own memory by the
        background thread: the caller must leave it unchanged until :meth:`flush` returns."""
        view = memoryview(data).cast("B")
        to_boundary = -self._position() % DIRECT_IO_ALIGN
        in_place = (view.nbytes - to_boundary) // DIRECT_IO_ALIGN * DIRECT_IO_ALIGN
        # (by the buffer's size, as the writer decides what to pad: a 1 MiB FSDP shard is
        # padded, and must then go out in place although its aligned middle is under 1 MiB)
        if view.nbytes < self.borrow_min_bytes or in_place <= 0 or (_address(view) + to_boundary) % DIRECT_IO_ALIGN:
            return self.write(view)
        self.write(view[:to_boundary])  # the file position is now aligned, and so is the rest
        while self._borrowed and self._borrowed_bytes + in_place > MAX_BORROWED_BYTES:
            done, nbytes = self._borrowed.popleft()
            if not done.is_set() and any(done is pending for pending in self._pending_done):
                self._submit(hand_back_staging=False)  # (it waits in the request being gathered)
            done.wait()
            self._borrowed_bytes -= nbytes
        done = threading.Event()
        self._borrowed.append((done, in_place))
        self._borrowed_bytes += in_place
        self.in_place_bytes += in_place
        # What is staged goes out in the same request as the borrowed bytes after it, and
        # requests are gathered up to BATCH_BYTES: this project's virtual disk took 16 MiB
        # requests at 1.5x the rate of 4 MiB ones when two ranks wrote at once.
        self._add_segment()
        self._pend(view[to_boundary : to_boundary + in_place])
        self._pending_done.append(done)
        if sum(piece.nbytes for piece in self._pending) >= BATCH_BYTES:
            self._submit(hand_back_staging=False)
        self.write(view[to_boundary + in_place :])
        return view.nbytes

    def _add_segment(self, stop: int | None = None) -> None:
        """The staged bytes from the segment's start to ``stop`` (default: all filled; an
        aligned length) join the pending request."""
        stop = self._filled if stop is None else stop
        if stop > self._segment:
            self._pend(self._filling[self._segment : stop])
            self._segment = stop

    def _pend(self, piece: memoryview) -> None:
        """``piece`` is the next bytes of the file: it joins the pending request (which then
        starts at the current position if it was empty); the position moves past it."""
        if not self._pending:
            self._pending_at = self._segment_at
        self._pending.append(piece)
        self._segment_at += piece.nbytes

    def _submit(self, hand_back_staging: bool) -> None:
        """Queue the pending request. ``hand_back_staging``: the staging buffer is full; it
        goes with this request, and the other one is taken once the thread has written it."""
        if self._pending:
            staging = self._filling if hand_back_staging else None
            self._jobs.put((self._pending, self._pending_at, staging, self._pending_done))
            self._pending, self._pending_done = [], []
        elif hand_back_staging:
            self._free.put(self._filling)  # (nothing of it is waiting to be written)
        if hand_back_staging:
            self._filling, self._filled, self._segment = self._free.get(), 0, 0
        self._raise_failure()

    def flush(self) -> None:
        """Everything written so far is in the file (durable after an fsync)."""
        aligned = self._filled - self._filled % DIRECT_IO_ALIGN
        self._add_segment(max(aligned, self._segment))
        self._submit(hand_back_staging=False)
        self._jobs.join()
        self._borrowed.clear()  # all written: the caller may change those buffers again
        self._borrowed_bytes = 0
        self._raise_failure()
        tail = self._filling[self._segment : self._filled]
        if tail.nbytes:
            _pwrite_all(self._buffered_fd(), tail, self._segment_at)
        # nothing is in flight: the tail moves to the front, to be rewritten whole with what
        # follows it (its file offset stays aligned)
        self._filling[: tail.nbytes] = tail
        self._filled, self._segment = tail.nbytes, 0
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
                buffers, offset, staging, dones = job
                if self._error is None:
                    try:
                        self._write_direct(buffers, offset)
                    except BaseException as error:  # raised in the caller's thread
                        self._error = error
                for buffer in buffers:
                    buffer.release()
                if staging is not None:
                    self._free.put(staging)
                for done in dones:
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
