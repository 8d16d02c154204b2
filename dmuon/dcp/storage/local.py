"""A checkpoint directory on a local or network filesystem.

Each step is made durable: files are fsynced, small files are put atomically (written under a
temporary name, then renamed, or linked for create-if-absent), and the directory is fsynced
after a rename. Streamed files (data files, exports) are written with direct I/O, past the
page cache (:class:`DirectFile`), where that is faster in wall time on the filesystem at hand
(measured once per filesystem, ``write_path.py``), else through the page cache.
"""

from __future__ import annotations

import builtins
import collections
import contextlib
import errno
import logging
import mmap
import os
import queue
import re
import shutil
import threading
import uuid
from collections.abc import Iterator
from typing import BinaryIO, cast

import numpy

from ..format.layout import temp_name
from .base import RetryPolicy, checked_name
from .write_path import choose_write_path

__all__ = ["DIRECT_IO_FILESYSTEMS", "DirectFile", "LocalStore", "filesystem_type"]

log = logging.getLogger(__name__)
_O_DIRECT = getattr(os, "O_DIRECT", 0)  # Linux (and a few others) only


class LocalStore:
    """A directory on a local or network filesystem; fsync makes each step durable."""

    retry = RetryPolicy(attempts=1)

    def __init__(self, root: str, sync_files: bool = True, direct_io: bool | None = None) -> None:
        """``direct_io``: write streamed files past the page cache; ``None`` (the default)
        does it where a probe of the filesystem found it faster (``write_path.py``), ``False``
        never, ``True`` always (an error where the filesystem refuses it)."""
        self.root = os.path.abspath(root)
        self.url = self.root
        self.sync_files = sync_files
        self.direct_io = direct_io
        self._direct: bool | None = None  # resolved on the first streamed write

    def _use_direct_io(self) -> bool:
        if self._direct is None:
            if self.direct_io is None:
                plain = bool(_O_DIRECT) and filesystem_type(self.root) in DIRECT_IO_FILESYSTEMS
                self._direct = choose_write_path(self.root, plain).direct
            elif self.direct_io and not _O_DIRECT:
                raise ValueError(f"direct_io=True for {self.root}, but this platform has no O_DIRECT")
            else:
                self._direct = self.direct_io
        return self._direct

    def _path(self, name: str) -> str:
        return os.path.join(self.root, checked_name(name))

    def makedirs(self) -> None:
        os.makedirs(self.root, exist_ok=True)

    def is_dir(self) -> bool:
        return os.path.isdir(self.root)

    def list(self) -> dict[str, int]:
        try:
            return {e.name: e.stat().st_size for e in os.scandir(self.root) if e.is_file()}
        except FileNotFoundError:
            return {}

    def open_write(self, name: str) -> contextlib.AbstractContextManager[BinaryIO]:
        return self._writing(self._path(name), direct=self._use_direct_io())

    @contextlib.contextmanager
    def _writing(self, path: str, direct: bool) -> Iterator[BinaryIO]:
        f = self._open_for_writing(path, direct)
        try:
            yield f
            f.flush()
            if self.sync_files:
                os.fsync(f.fileno())
            f.close()
        except BaseException:
            f.close()
            with contextlib.suppress(OSError):
                os.remove(path)
            raise

    def _open_for_writing(self, path: str, direct: bool) -> BinaryIO:
        if direct:
            try:
                return cast(BinaryIO, DirectFile(path))
            except OSError as error:
                if self.direct_io or error.errno != errno.EINVAL:
                    raise
                # the filesystem refuses O_DIRECT after all: buffered from now on
                log.info("direct I/O refused under %s (%s); writing through the page cache", self.root, error)
                self._direct = False
        return open(path, "wb")

    def open_read(self, name: str) -> BinaryIO:
        return open(self._path(name), "rb")

    def read(self, name: str) -> bytes:
        with self.open_read(name) as f:
            return f.read()

    def put(self, name: str, data: bytes, *, exclusive: bool = False) -> None:
        """Atomic: the file appears whole or not at all. ``exclusive`` fails if it exists."""
        final = self._path(name)
        tmp = self._path(temp_name(name, uuid.uuid4().hex[:12]))
        with self._writing(tmp, direct=False) as f:  # small: the page cache is the right place
            f.write(data)
        try:
            if exclusive:
                os.link(tmp, final)  # atomic create-if-absent, unlike rename
                os.remove(tmp)
            else:
                os.replace(tmp, final)
        except BaseException:
            with contextlib.suppress(OSError):
                os.remove(tmp)
            raise
        if self.sync_files:
            self._sync_dir()

    def _sync_dir(self) -> None:
        with contextlib.suppress(OSError):
            fd = os.open(self.root, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    def delete(self, name: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.remove(self._path(name))

    def modified(self, name: str) -> float:
        return os.path.getmtime(self._path(name))

    def child(self, name: str) -> LocalStore:
        return LocalStore(self._path(name), self.sync_files, self.direct_io)

    def list_dirs(self) -> builtins.list[str]:
        try:
            return [e.name for e in os.scandir(self.root) if e.is_dir()]
        except FileNotFoundError:
            return []

    def remove_tree(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


# ---------------------------------------------------------------------------------------------
# direct I/O: large files written from an aligned staging buffer, past the page cache
# ---------------------------------------------------------------------------------------------
# Filesystems on a block device whose O_DIRECT is plain (no network or cluster semantics, no
# data checksums that a buffer could race with): there the probe of write_path.py decides.
# Elsewhere (tmpfs, NFS, Lustre, btrfs, ...) files are written through the page cache.
DIRECT_IO_FILESYSTEMS = frozenset({"ext4", "xfs"})
DIRECT_IO_ALIGN = 4096  # offset, length and address alignment O_DIRECT needs (>= logical block size)
STAGING_BYTES = 8 << 20  # per staging buffer; two per open file
# Borrowed writes (DirectFile.write_borrowed): below this size a buffer is copied, since lining
# it up costs the writer up to DIRECT_IO_ALIGN bytes of padding in the file (<= 0.4% here).
BORROW_MIN_BYTES = 1 << 20
# Caller memory the background thread may still be reading: bounds how much a caller's
# temporary buffers (a GPU tensor's CPU copy, say) are kept alive by writes in flight.
MAX_BORROWED_BYTES = 64 << 20


def filesystem_type(path: str) -> str:
    """The type of the filesystem mounted at the deepest mount point above ``path`` (Linux,
    from ``/proc/self/mounts``); "" where that cannot be told."""
    path = os.path.realpath(path)
    best, kind = "", ""
    try:
        with open("/proc/self/mounts", encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return ""
    for line in lines:
        fields = line.split()
        if len(fields) < 3:
            continue
        # mount points escape blanks and backslashes as octal (\040, \134)
        point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[1])
        inside = path == point or path.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best):
            best, kind = point, fields[2]
    return kind


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
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | _O_DIRECT, 0o644)
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
