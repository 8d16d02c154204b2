"""An in-memory dmuon ``Store`` for the scale simulator: the small files a commit puts (manifest,
``.metadata``) kept as bytes, every read of them counted, and the data files that no rank wrote
listed with the sizes the manifest gives them (what a reader's range checks look at).

Registered under ``dmuonsim://`` (``register_store``), so dmuon's writer and reader reach it
through their ordinary path; a URL with a scheme counts as object storage, as a large job's
checkpoint store usually is.
"""

from __future__ import annotations

import io
import time
from collections import Counter
from typing import Any, BinaryIO

from dmuon.dcp.format.layout import is_manifest_name
from dmuon.dcp.format.manifest import decode_manifest
from dmuon.dcp.storage.retry import RetryPolicy

SCHEME = "dmuonsim"


class SimStore:
    """One simulated directory (see the module docstring); one instance per URL."""

    _open: dict[str, SimStore] = {}

    def __init__(self, url: str) -> None:
        self.url = url
        self.retry = RetryPolicy()
        self.files: dict[str, bytes] = {}
        self.data_sizes: dict[str, int] = {}
        self.bytes_read: Counter[str] = Counter()
        self.stamps: dict[str, float] = {}

    @classmethod
    def factory(cls, url: str, storage_options: Any = None, sync_files: Any = None) -> SimStore:
        return cls.at(url)

    @classmethod
    def at(cls, url: str) -> SimStore:
        url = url.rstrip("/")
        if url not in cls._open:
            cls._open[url] = cls(url)
        return cls._open[url]

    @classmethod
    def drop_all(cls) -> None:
        cls._open.clear()

    def makedirs(self) -> None:
        pass

    def is_dir(self) -> bool:
        return bool(self.files)

    def list(self) -> dict[str, int]:
        listing = dict(self.data_sizes)
        listing.update({name: len(data) for name, data in self.files.items()})
        return listing

    def list_dirs(self) -> list[str]:
        return []

    def open_write(self, name: str):
        raise NotImplementedError("the scale simulator writes no data files")

    def open_read(self, name: str, size: int | None = None) -> BinaryIO:
        return io.BytesIO(self.read(name))

    def read(self, name: str) -> bytes:
        if name not in self.files:
            raise FileNotFoundError(f"{self.url}/{name}")
        self.bytes_read[name] += len(self.files[name])
        return self.files[name]

    def put(self, name: str, data: bytes, *, exclusive: bool = False) -> None:
        if exclusive and name in self.files:
            raise FileExistsError(f"{self.url}/{name}")
        self.files[name] = bytes(data)
        self.stamps[name] = time.time()
        if is_manifest_name(name):
            manifest = decode_manifest(name, data)
            self.data_sizes.update({file: stats.size for file, stats in manifest.files.items()})

    def delete(self, name: str) -> None:
        self.files.pop(name, None)

    def modified(self, name: str) -> float:
        return self.stamps.get(name, time.time())

    def child(self, name: str) -> SimStore:
        return SimStore.at(f"{self.url}/{name}")

    def remove_tree(self) -> None:
        self.files.clear()
        self.data_sizes.clear()
