"""A checkpoint directory on a local or network filesystem.

Each step is made durable: files are fsynced, small files are put atomically (written under a
temporary name, then renamed, or linked for create-if-absent), and the directory is fsynced
after a rename.
"""

from __future__ import annotations

import builtins
import contextlib
import os
import shutil
import uuid
from collections.abc import Iterator
from typing import BinaryIO

from .format import temp_name
from .store import RetryPolicy, checked_name

__all__ = ["LocalStore"]


class LocalStore:
    """A directory on a local or network filesystem; fsync makes each step durable."""

    retry = RetryPolicy(attempts=1)

    def __init__(self, root: str, sync_files: bool = True) -> None:
        self.root = os.path.abspath(root)
        self.url = self.root
        self.sync_files = sync_files

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

    @contextlib.contextmanager
    def open_write(self, name: str) -> Iterator[BinaryIO]:
        path = self._path(name)
        f = open(path, "wb")
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

    def open_read(self, name: str) -> BinaryIO:
        return open(self._path(name), "rb")

    def read(self, name: str) -> bytes:
        with self.open_read(name) as f:
            return f.read()

    def put(self, name: str, data: bytes, *, exclusive: bool = False) -> None:
        """Atomic: the file appears whole or not at all. ``exclusive`` fails if it exists."""
        final = self._path(name)
        tmp = self._path(temp_name(name, uuid.uuid4().hex[:12]))
        with self.open_write(os.path.basename(tmp)) as f:
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
        return LocalStore(self._path(name), self.sync_files)

    def list_dirs(self) -> builtins.list[str]:
        try:
            return [e.name for e in os.scandir(self.root) if e.is_dir()]
        except FileNotFoundError:
            return []

    def remove_tree(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)
