"""A checkpoint directory on a local or network filesystem.

Each step is made durable: files are fsynced, small files are put atomically (written under a
temporary name, then renamed, or linked for create-if-absent), and the directory is fsynced
after a rename. Streamed files (data files, exports) on a local block-device filesystem are
written with direct I/O, past the page cache (:class:`DirectFile`).
"""

from __future__ import annotations

import builtins
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

from .format import temp_name
from .store import RetryPolicy, checked_name

__all__ = ["DIRECT_IO_FILESYSTEMS", "DirectFile", "LocalStore", "filesystem_type"]

log = logging.getLogger(__name__)
_O_DIRECT = getattr(os, "O_DIRECT", 0)  # Linux (and a few others) only


class LocalStore:
    """A directory on a local or network filesystem; fsync makes each step durable."""

    retry = RetryPolicy(attempts=1)

    def __init__(self, root: str, sync_files: bool = True, direct_io: bool | None = None) -> None:
        """``direct_io``: write streamed files past the page cache; ``None`` (the default)
        does it where the filesystem is one of :data:`DIRECT_IO_FILESYSTEMS`, ``False``
        never, ``True`` always (an error where the filesystem refuses it)."""
        self.root = os.path.abspath(root)
        self.url = self.root
        self.sync_files = sync_files
        self.direct_io = direct_io
        self._direct: bool | None = None  # resolved on the first streamed write

    def _use_direct_io(self) -> bool:
        if self._direct is None:
            if self.direct_io is None:
                self._direct = bool(_O_DIRECT) and filesystem_type(self.root) in DIRECT_IO_FILESYSTEMS
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
# data checksums that a buffer could race with). Elsewhere (tmpfs, NFS, Lustre, btrfs, ...)
# files are written through the page cache.
DIRECT_IO_FILESYSTEMS = frozenset({"ext4", "xfs"})
DIRECT_IO_ALIGN = 4096  # offset, length and address alignment O_DIRECT needs (>= logical block size)
STAGING_BYTES = 8 << 20  # per staging buffer; two per open file


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
    write itself, and the pages then evict the training job's own cache. Here the caller's
    bytes are copied once into one of two page-aligned staging buffers while a background
    thread writes the other one to the device (``os.pwrite`` releases the GIL), so the copy,
    the caller's checksum and the device overlap. Data goes out in aligned buffers at aligned
    offsets; ``flush()`` writes the unaligned tail through a second, buffered descriptor and
    keeps it staged, so a later write continues from an aligned offset. A write that failed
    in the background is raised by the next ``write`` or ``flush``.
    """

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
        self._jobs: queue.Queue = queue.Queue()  # (buffer, nbytes, offset); None stops the thread
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
            if self._filled == STAGING_BYTES:  # hand it over, take the other one back
                self._jobs.put((self._filling, STAGING_BYTES, self._base))
                self._base += STAGING_BYTES
                self._filling, self._filled = self._free.get(), 0
                self._raise_failure()
        return total

    def flush(self) -> None:
        """Everything written so far is in the file (durable after an fsync)."""
        aligned = self._filled - self._filled % DIRECT_IO_ALIGN
        if aligned:
            self._jobs.put((self._filling, aligned, self._base))
        self._jobs.join()
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

    def _write_direct(self, view: memoryview, offset: int) -> None:
        """Near a limit (disk full, file-size limit) the kernel shortens a write to an
        unaligned length, which O_DIRECT refuses (EINVAL) or leaves an unaligned rest; the
        buffered descriptor then writes what it can and raises the real error."""
        try:
            written = os.pwrite(self._fd, view, offset)
        except OSError as error:
            if error.errno != errno.EINVAL:
                raise
            written = 0
        if written < view.nbytes:
            _pwrite_all(self._buffered_fd(), view[written:], offset + written)

    def _write_jobs(self) -> None:
        while True:
            job = self._jobs.get()
            try:
                if job is None:
                    return
                buffer, nbytes, offset = job
                if self._error is None:
                    try:
                        self._write_direct(buffer[:nbytes], offset)
                    except BaseException as error:  # raised in the caller's thread
                        self._error = error
                if nbytes == STAGING_BYTES:  # a partial one (flush) stays with the caller
                    self._free.put(buffer)
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


def _pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    while view.nbytes:
        written = os.pwrite(fd, view, offset)
        view, offset = view[written:], offset + written
