"""A checkpoint directory on a local or network filesystem.

Each step is made durable: files are fsynced, small files are put atomically (written under a
temporary name, then renamed, or linked for create-if-absent), and the directory is fsynced
after a rename. Streamed files (data files, exports) are written through the page cache, or
past it with direct I/O (:class:`DirectFile`) where asked (``direct_io=True``) or where a save
runs in the background on ext4/XFS (``write_path.py`` has the rule and the measurements).
"""

from __future__ import annotations

import builtins
import contextlib
import errno
import io
import logging
import os
import re
import shutil
import uuid
from collections.abc import Iterator
from typing import BinaryIO, cast

from .base import checked_name, temp_name
from .direct_io import O_DIRECT, DirectFile
from .direct_read import DIRECT_READ_MIN_BYTES, DirectReadFile, is_cached, is_cold
from .retry import RetryPolicy
from .write_behind import WriteBehindFile
from .write_path import DIRECT_IO_FILESYSTEMS, choose_write_path

__all__ = ["DIRECT_IO_FILESYSTEMS", "LOCAL_DIRECT_IO_OPTION", "LocalStore", "filesystem_type", "open_local_store"]

log = logging.getLogger(__name__)

#: The one storage option a local path takes (``LocalStore``'s ``direct_io``).
LOCAL_DIRECT_IO_OPTION = "direct_io"


class LocalStore:
    """A directory on a local or network filesystem; fsync makes each step durable."""

    retry = RetryPolicy(attempts=1)

    def __init__(self, root: str, sync_files: bool = True, direct_io: bool | None = None) -> None:
        """``direct_io``: write streamed files, and read cold ones, past the page cache:
        ``True`` always (an error where the filesystem refuses it); ``False`` never; ``None``
        (the default) by ``write_path.py``'s rule: direct where :attr:`in_background` is set
        on ext4/XFS (falling back to the page cache where ``O_DIRECT`` is refused after all)."""
        self.root = os.path.abspath(root)
        self.url = self.root
        self.sync_files = sync_files
        self.direct_io = direct_io
        #: The saves through this store run behind training (set by the storage writer of an
        #: async save): their CPU is what training feels, not their wall time.
        self.in_background = False
        self._direct: bool | None = None  # resolved on the first streamed write

    def _use_direct_io(self) -> bool:
        if self._direct is None:
            if self.direct_io and not O_DIRECT:
                raise ValueError(f"direct_io=True for {self.root}, but this platform has no O_DIRECT")
            background = self.in_background and self.direct_io is None and bool(O_DIRECT)
            filesystem = filesystem_type(self.root) if background else ""
            self._direct = choose_write_path(
                self.root, self.direct_io, background=background, filesystem=filesystem
            ).direct
        return self._direct

    def _reads_direct(self) -> bool:
        return self.direct_io is True

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
            except OSError as error:  # asked for, a refusal is an error; chosen by the rule, not
                if self.direct_io or error.errno != errno.EINVAL:
                    raise
                log.warning("%s: O_DIRECT refused (%s); writing through the page cache", self.root, error)
                self._direct = False
        if self.sync_files:  # (it is fsynced at the end: start writing it back now)
            return cast(BinaryIO, WriteBehindFile(path))
        return open(path, "wb")

    def open_read(self, name: str, size: int | None = None) -> BinaryIO:
        """A data file none of which is in the page cache is read past the cache
        (``direct_read.py``) where writes go past it too (``direct_io=True``): the same rule
        in every process, whether it saved first or not."""
        path = self._path(name)
        size = os.path.getsize(path)  # (not the manifest's: a file that differs is read as it is)
        if self._reads_direct():
            if size >= DIRECT_READ_MIN_BYTES and is_cold(path, size):
                try:
                    return cast(BinaryIO, DirectReadFile(path))
                except OSError as error:
                    if error.errno != errno.EINVAL:
                        raise  # (EINVAL: O_DIRECT refused after all; read through the cache)
        # a large file already in memory is not hinted: the hints would find every page there
        hints = size < DIRECT_READ_MIN_BYTES or not is_cached(path, size)
        return cast(BinaryIO, LocalReadFile(path, hints=hints))

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

    def settle(self, temporary_name: str, name: str) -> None:
        """A file this directory received under ``temporary_name`` (written and verified by the
        caller) made durable, then put in place under ``name`` atomically."""
        temporary = self._path(temporary_name)
        if self.sync_files:
            fd = os.open(temporary, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        os.replace(temporary, self._path(name))
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
        child = LocalStore(self._path(name), self.sync_files, self.direct_io)
        child.in_background = self.in_background
        return child

    def list_dirs(self) -> builtins.list[str]:
        try:
            return [e.name for e in os.scandir(self.root) if e.is_dir()]
        except FileNotFoundError:
            return []

    def remove_tree(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


class LocalReadFile(io.BufferedReader):
    """A file opened for reading that passes every hint of the reader
    (:class:`~.base.ReadAheadStream`: each item it will read, 64 MiB ahead) on to the kernel
    with ``posix_fadvise(WILLNEED)``.

    Measured on this project's VM (2 ranks, 256 MiB each, pages dropped; interleaved, medians;
    ``docs/performance.md``): the first load of a new process -- a restart -- took 0.43 s with
    every item hinted against 0.78 s with only the file's first 16 MiB hinted and the rest left
    to the kernel's read-ahead (torch's DCP: 0.73 s), at 0.57 CPU-s against 1.29; later loads in
    one process 0.39 s against 0.50-0.54 s. The pages a hint asks for are allocated 4 KiB at a time
    (``/proc/vmstat``: about 106,000 allocations for a 512 MiB load, no huge pages), where the
    kernel's own read-ahead took 2 MiB blocks (252 per load), and this VM hands its large free
    blocks back to its host, slow to take back (``page_reporting_order=11``). (An earlier measurement on this VM
    had the 16 MiB kick-start ahead, 0.30-0.34 s against 0.35-0.41 s for later loads: which
    blocks are free depends on what ran before, and the hints won every interleaved run since.)
    """

    def __init__(self, path: str, hints: bool = True) -> None:
        """``hints=False``: the file is known to be in memory; the hints are dropped (asking
        the kernel for 256 MiB of pages it has costs about 3 ms)."""
        super().__init__(io.FileIO(path, "rb"))
        self._advice = _FADVISE_WILLNEED if hints else None  # None: hints dropped

    def will_need(self, offset: int, length: int) -> None:
        if self._advice is not None and length > 0:
            os.posix_fadvise(self.fileno(), offset, length, self._advice)


_FADVISE_WILLNEED = getattr(os, "POSIX_FADV_WILLNEED", None)  # None: not a POSIX system


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


def open_local_store(url: str, storage_options: dict | None, sync_files: bool | None) -> LocalStore:
    """The registry's factory for plain paths and ``file://`` URLs: a local directory, fsynced
    unless ``sync_files=False``. The only option it takes is ``direct_io`` (true, false, or
    null for the rule of ``write_path.py``); any other is an error rather than silently ignored."""
    path = url[len("file://") :] if url.startswith("file://") else url
    options = dict(storage_options or {})
    direct_io = options.pop(LOCAL_DIRECT_IO_OPTION, None)
    if options:
        raise ValueError(
            f"storage_options {sorted(options)} do not apply to the local path {url}: a local "
            f"directory takes only {LOCAL_DIRECT_IO_OPTION!r} (true, false, or null for automatic)"
        )
    if direct_io not in (None, True, False):
        raise ValueError(f"storage option {LOCAL_DIRECT_IO_OPTION}={direct_io!r}: want true, false or null")
    return LocalStore(path, sync_files=True if sync_files is None else sync_files, direct_io=direct_io)
