"""Where bytes live: a local directory or any fsspec filesystem, behind one small interface.

A *store* is a flat directory of named files. ``LocalStore`` makes each step durable (fsync,
atomic rename, exclusive ``link`` for create-if-absent); ``FsspecStore`` relies on object
stores making each PUT appear whole (``s3://``, ``gs://``, ``memory://``...). Object-store
calls are retried at whole-file granularity by :func:`retrying`. Knows nothing of DCP.
"""
from __future__ import annotations

import contextlib
import errno
import logging
import os
import time
import uuid
from collections.abc import Iterator
from typing import BinaryIO

# gcsfs >= 2026 probes a gRPC API on first use unless told not to; against emulators and
# many private endpoints that stalls every call for minutes. Respect an explicit setting.
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")

from .errors import (  # noqa: E402
    CheckpointError,
    CheckpointExistsError,
    CheckpointIncompleteError,
    CheckpointNotFoundError,
    StorageError,
    UnsafeCheckpointError,
)

log = logging.getLogger(__name__)

METADATA = ".metadata"  # the commit marker of a checkpoint directory


def checked_name(name: str) -> str:
    """A file name inside the checkpoint: no separators, no '..', nothing absolute."""
    if (
        not isinstance(name, str)
        or not name
        or name in (".", "..")
        or "/" in name
        or "\\" in name
        or "\x00" in name
        or os.path.isabs(name)
    ):
        raise UnsafeCheckpointError(f"storage path {name!r} leaves the checkpoint directory; refused")
    return name


class LocalStore:
    """A directory on a local or network filesystem; fsync makes each step durable."""

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
        tmp = self._path(f"{name}.tmp-{uuid.uuid4().hex[:12]}")
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

    def child(self, name: str) -> "LocalStore":
        return LocalStore(self._path(name), self.sync_files)

    def list_dirs(self) -> list[str]:
        try:
            return [e.name for e in os.scandir(self.root) if e.is_dir()]
        except FileNotFoundError:
            return []

    def remove_tree(self) -> None:
        import shutil

        shutil.rmtree(self.root, ignore_errors=True)


READ_BLOCK = 32 * 2**20
_OBJECT_STORES = {"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "oss", "r2"}


S3_REQUEST_RETRIES = {"mode": "standard", "max_attempts": 3}


def _bounded_s3_retries(url: str, options: dict) -> dict:
    """Give botocore a retry policy with a known ceiling, unless the caller chose one.

    botocore's default ("legacy") backs off by a random factor, and s3fs repeats each call five
    times around it: a dead endpoint then took anywhere from 30 s to over 60 s to report.
    "standard" mode (AWS's recommendation) still retries throttling, 5xx and resets, and, with
    s3fs's own five, makes 15 tries per call within about half a minute. An explicit
    ``config_kwargs["retries"]`` wins.
    """
    if url.split("://", 1)[0] not in ("s3", "s3a"):
        return options
    config = dict(options.get("config_kwargs") or {})
    if "retries" in config:
        return options
    config["retries"] = dict(S3_REQUEST_RETRIES)
    return {**options, "config_kwargs": config}


class FsspecStore:
    """Any fsspec filesystem. Objects appear whole on close; fsync would add nothing there."""

    def __init__(self, url: str, storage_options: dict | None = None) -> None:
        import fsspec

        self.fs, path = fsspec.core.url_to_fs(url, **_bounded_s3_retries(url, storage_options or {}))
        self.root = path.rstrip("/")
        self.url = url.rstrip("/")

    def _path(self, name: str) -> str:
        return f"{self.root}/{checked_name(name)}"

    def makedirs(self) -> None:
        # Object stores have no directories to create, and asking costs a request that, with
        # the endpoint down, adds a whole retry cycle before the error surfaces.
        protocols = self.fs.protocol if isinstance(self.fs.protocol, (tuple, list)) else (self.fs.protocol,)
        if set(protocols) & _OBJECT_STORES:
            return
        with contextlib.suppress(FileExistsError):
            self.fs.makedirs(self.root, exist_ok=True)

    def is_dir(self) -> bool:
        return bool(self.list()) or self.fs.isdir(self.root)

    def list(self) -> dict[str, int]:
        try:
            self.fs.invalidate_cache(self.root)
            entries = self.fs.ls(self.root, detail=True)
        except FileNotFoundError:
            return {}
        out = {}
        for entry in entries:
            if entry.get("type") == "file":
                out[entry["name"].rstrip("/").rsplit("/", 1)[-1]] = int(entry.get("size") or 0)
        return out

    @contextlib.contextmanager
    def open_write(self, name: str) -> Iterator[BinaryIO]:
        path = self._path(name)
        f = self.fs.open(path, "wb")
        try:
            yield f
            f.close()
        except BaseException as exc:
            # fsspec uploads whatever was buffered on close(); throw it away instead. With the
            # endpoint unreachable, asking it to abort or delete would only wait out the client's
            # retries once more: the leftovers are never committed, and a later save removes them.
            reachable = not _endpoint_unreachable(exc)
            with contextlib.suppress(Exception):
                if reachable and hasattr(f, "discard"):
                    f.discard()
                f.closed = True
            if reachable:
                with contextlib.suppress(Exception):
                    self.fs.rm_file(path)
            raise

    def open_read(self, name: str) -> BinaryIO:
        # Items are read in file order: a large read-ahead turns them into a few big GETs
        # instead of one request per item (gcsfs's default makes hundreds per file).
        return self.fs.open(self._path(name), "rb", block_size=READ_BLOCK, cache_type="readahead")

    def read(self, name: str) -> bytes:
        return self.fs.cat_file(self._path(name))

    def put(self, name: str, data: bytes, *, exclusive: bool = False) -> None:
        """One PUT: object stores make it appear whole or not at all.

        ``exclusive`` is a conditional create (S3 ``If-None-Match``, GCS ``ifGenerationMatch=0``
        through fsspec's ``mode="create"``). A refusal is checked by reading the object back:
        when a retried request finds its own earlier, acknowledged-but-unanswered write there,
        the commit did happen; anything else there means another writer won.
        """
        path = self._path(name)
        if not exclusive:
            self.fs.pipe_file(path, data)
            return
        try:
            try:
                self.fs.pipe_file(path, data, mode="create")
            except (TypeError, NotImplementedError):  # no conditional create: check, then PUT
                if self.fs.exists(path):
                    raise FileExistsError(path) from None
                self.fs.pipe_file(path, data)
        except FileExistsError:
            self._raise_unless_ours(path, data)
        except OSError as exc:
            if _is_precondition_failure(exc):
                self._raise_unless_ours(path, data)
            else:
                raise

    def _raise_unless_ours(self, path: str, data: bytes) -> None:
        self.fs.invalidate_cache(self.root)
        try:
            if self.fs.cat_file(path) == data:
                return
        except FileNotFoundError:
            pass
        raise FileExistsError(f"{path}: another writer committed first")

    def delete(self, name: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(self._path(name))

    def modified(self, name: str) -> float:
        return self.fs.modified(self._path(name)).timestamp()

    def child(self, name: str) -> "FsspecStore":
        child = object.__new__(FsspecStore)
        child.fs, child.root, child.url = self.fs, self._path(name), f"{self.url}/{checked_name(name)}"
        return child

    def list_dirs(self) -> list[str]:
        try:
            self.fs.invalidate_cache(self.root)
            entries = self.fs.ls(self.root, detail=True)
        except FileNotFoundError:
            return []
        return [e["name"].rstrip("/").rsplit("/", 1)[-1] for e in entries if e.get("type") == "directory"]

    def remove_tree(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm(self.root, recursive=True)


def _is_precondition_failure(exc: BaseException) -> bool:
    """Did a conditional create fail because the object exists?

    Clients disagree on how to say so: gcsfs puts "precondition" in the message, s3fs maps
    S3's 412 to ``OSError(EINVAL, None)`` and leaves the code only on the botocore error it
    chains (Ceph RGW answers that way; SeaweedFS's message happens to name it). Look at the
    whole chain, at status codes as well as text.
    """
    for link in _exception_chain(exc):
        if isinstance(link, OSError) and link.errno == errno.EEXIST:
            return True
        text = str(link).lower()
        if "pre-condition" in text or "precondition" in text:
            return True
        response = getattr(link, "response", None)
        if isinstance(response, dict):
            error = response.get("Error") or {}
            status = (response.get("ResponseMetadata") or {}).get("HTTPStatusCode")
            if error.get("Code") in ("PreconditionFailed", "412") or status == 412:
                return True
        if getattr(link, "code", None) == 412 or getattr(link, "status", None) == 412:
            return True
    return False


def _exception_chain(exc: BaseException | None, limit: int = 8) -> Iterator[BaseException]:
    """``exc`` and what it wraps, nearest first: clients put the telling error underneath."""
    while exc is not None and limit > 0:
        yield exc
        exc = exc.__cause__ or exc.__context__
        limit -= 1


def remove_checkpoint(store: "Store") -> None:
    """Un-commit first (.metadata), then delete: a crash midway leaves an incomplete directory,
    never a committed checkpoint with missing files."""
    store.delete(METADATA)
    store.remove_tree()


Store = LocalStore | FsspecStore


def is_remote(checkpoint_id: str | os.PathLike) -> bool:
    text = os.fspath(checkpoint_id)
    return "://" in text and not text.startswith("file://")


def open_store(checkpoint_id: str | os.PathLike, storage_options: dict | None = None,
               sync_files: bool | None = None) -> Store:
    text = os.fspath(checkpoint_id)
    if not is_remote(text):
        path = text[len("file://"):] if text.startswith("file://") else text
        return LocalStore(path, sync_files=True if sync_files is None else sync_files)
    if sync_files:
        log.info("sync_files ignored for %s: object stores have no fsync", text)
    return FsspecStore(text, storage_options)



# ---------------------------------------------------------------------------------------------
# retries
# ---------------------------------------------------------------------------------------------
# ---------------------------------------------------------------------------------------------
# Errors that another attempt cannot fix: what the checkpoint says, what the caller asked for,
# and programming errors. Everything else on an object store (a reset connection, a 5xx the
# client gave up on, a body cut short and caught by its checksum) is worth a fresh attempt.
_PERMANENT = (UnsafeCheckpointError, CheckpointExistsError, CheckpointIncompleteError, CheckpointNotFoundError,
              FileExistsError, FileNotFoundError, PermissionError, TypeError, AttributeError, KeyError,
              AssertionError, NotImplementedError)
# A write that hits "not found" lost its upload session (GCS resumable uploads): redo it.
_PERMANENT_FOR_WRITES = tuple(e for e in _PERMANENT if e is not FileNotFoundError)
REMOTE_ATTEMPTS = 4
_NO_ROOM = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EFBIG}


_CONNECTION_ERRORS = {"ConnectionError", "HTTPClientError", "ClientConnectionError"}  # builtin, botocore, aiohttp


def _endpoint_unreachable(exc: BaseException | None) -> bool:
    """Is this (or what it wraps) a failure to connect or to get a response at all?

    Matched by class names along the MRO so neither botocore nor aiohttp has to be imported.
    """
    return any({cls.__name__ for cls in type(link).__mro__} & _CONNECTION_ERRORS for link in _exception_chain(exc))


def retrying(store: "Store", what: str, fn, *, writing: bool = False):
    """Call ``fn``; on an object store, again after a transient failure (whole-file granularity).

    The last failure is raised as a :class:`StorageError` that says what was being done where.
    """
    attempts = REMOTE_ATTEMPTS if isinstance(store, FsspecStore) else 1
    permanent = _PERMANENT_FOR_WRITES if writing else _PERMANENT
    started = time.monotonic()
    for attempt in range(attempts):
        try:
            return fn()
        except permanent:
            raise
        except Exception as exc:  # noqa: BLE001 - classified above
            out_of_space = isinstance(exc, OSError) and exc.errno in _NO_ROOM
            # Whole-file retries are for what the client cannot retry itself (a lost upload
            # session, a body caught short by our checksum). A connection error reaching us
            # means the client already retried the request to exhaustion: the endpoint is
            # gone, and another round would only multiply the time before the user hears it.
            spent = time.monotonic() - started
            if attempt + 1 == attempts or out_of_space or _endpoint_unreachable(exc):
                if isinstance(exc, CheckpointError):
                    raise
                tries = f" after {attempt + 1} attempt(s) in {spent:.0f} s" if attempts > 1 else ""
                raise StorageError(f"{store.url}: {what} failed{tries}: {type(exc).__name__}: {exc}") from exc
            log.warning("%s: %s failed (%s: %s); retrying", store.url, what, type(exc).__name__, exc)
            time.sleep(0.5 * 2**attempt)
    raise AssertionError("unreachable")
