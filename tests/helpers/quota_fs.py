"""A real fsspec filesystem (local files underneath) that runs out of space or permission.

``quota://`` behaves like ``file://`` until this process has written ``DMUON_QUOTA_BYTES``
bytes (then ENOSPC, "No space left on device") or created ``DMUON_QUOTA_FILES`` files (then
EACCES, "Permission denied"). Limits are per process, read from the environment.
"""
from __future__ import annotations

import errno
import os

from fsspec.implementations.local import LocalFileOpener, LocalFileSystem
from fsspec.registry import register_implementation

_written = 0
_created = 0


def _limit(name: str) -> int | None:
    value = os.environ.get(name)
    return int(value) if value else None


class _QuotaFile(LocalFileOpener):
    def write(self, data):
        global _written
        limit = _limit("DMUON_QUOTA_BYTES")
        size = memoryview(data).nbytes
        if limit is not None and _written + size > limit:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), self.path)
        _written += size
        return super().write(data)


class QuotaFileSystem(LocalFileSystem):
    protocol = "quota"

    def _open(self, path, mode="rb", block_size=None, **kwargs):
        global _created
        path = self._strip_protocol(path)
        if "w" in mode or "x" in mode:
            limit = _limit("DMUON_QUOTA_FILES")
            if limit is not None and _created >= limit:
                raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), path)
            _created += 1
            if self.auto_mkdir:
                self.makedirs(self._parent(path), exist_ok=True)
            return _QuotaFile(path, mode, fs=self, **kwargs)
        return super()._open(path, mode, block_size=block_size, **kwargs)

    @classmethod
    def _strip_protocol(cls, path):
        path = str(path)
        if path.startswith("quota://"):
            path = path[len("quota://"):]
        return super()._strip_protocol(path)


def register() -> None:
    register_implementation("quota", QuotaFileSystem, clobber=True)
