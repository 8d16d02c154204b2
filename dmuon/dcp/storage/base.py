"""Where bytes live: the store interface, the registry of backends by URL scheme, retries.

A *store* is a flat directory of named files with the few operations a checkpoint needs (list,
stream a file in or out, put a small file atomically, delete). Everything dmuon reads or writes
goes through one, export output included, so a new backend (Azure, HDFS, a test store that
injects faults) is one class registered with :func:`register_store`. Built in: local paths
(``local_store.LocalStore``) and, for any other scheme, fsspec (``fsspec_store.FsspecStore``).

A store knows nothing of DCP or models.
"""

from __future__ import annotations

import builtins
import errno
import json
import logging
import os
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import BinaryIO, Protocol, runtime_checkable

from ..errors import (
    CheckpointError,
    CheckpointExistsError,
    CheckpointIncompleteError,
    CheckpointNotFoundError,
    StorageError,
    UnsafeCheckpointError,
)
from ..format.layout import METADATA

__all__ = [
    "LOCAL_DIRECT_IO_OPTION",
    "BorrowingStream",
    "RetryPolicy",
    "Store",
    "StoreFactory",
    "checked_name",
    "exception_chain",
    "is_remote",
    "open_store",
    "register_store",
    "remove_checkpoint",
    "retrying",
    "storage_options_from_pairs",
    "unregister_store",
]

log = logging.getLogger(__name__)

# The one storage option a local path takes (``LocalStore``'s ``direct_io``).
LOCAL_DIRECT_IO_OPTION = "direct_io"


@dataclass(frozen=True)
class RetryPolicy:
    """How often a whole operation (writing a file, reading one) is tried on this store.

    Object-store clients retry single requests themselves; what they cannot redo is a
    multi-request operation that failed midway (a lost upload session, a body cut short and
    caught by dmuon's checksum). Local filesystems get one attempt: a retry would only hide a
    full disk or a permission error for longer.
    """

    attempts: int = 1
    backoff_s: float = 0.5  # doubled after every failed attempt


@runtime_checkable
class Store(Protocol):
    url: str
    retry: RetryPolicy

    def makedirs(self) -> None: ...

    def is_dir(self) -> bool: ...

    def list(self) -> dict[str, int]:
        """Files directly inside, with their sizes."""
        ...

    def list_dirs(self) -> builtins.list[str]: ...

    def open_write(self, name: str) -> AbstractContextManager[BinaryIO]:
        """A stream that becomes the file when the block exits cleanly; removed otherwise."""
        ...

    def open_read(self, name: str) -> BinaryIO: ...

    def read(self, name: str) -> bytes: ...

    def put(self, name: str, data: bytes, *, exclusive: bool = False) -> None:
        """Atomically: the file appears whole or not at all. ``exclusive`` raises
        ``FileExistsError`` if another writer created it first."""
        ...

    def delete(self, name: str) -> None: ...

    def modified(self, name: str) -> float: ...

    def child(self, name: str) -> Store: ...

    def remove_tree(self) -> None: ...


@runtime_checkable
class BorrowingStream(Protocol):
    """What ``open_write`` may return beyond ``write``: a stream that writes large buffers
    straight from the caller's memory, with no copy (direct I/O from the tensor itself).

    A writer that knows a buffer's address can lay out its file so that the buffer starts at a
    position congruent to that address modulo :attr:`memory_alignment`; then
    :meth:`write_borrowed` hands the aligned middle of the buffer to the device as it is.
    """

    memory_alignment: int  # a buffer whose address == file position (mod this) is written in place
    borrow_min_bytes: int  # smaller buffers are copied as usual: not worth padding the file for

    def write_borrowed(self, data, /) -> int:
        """``write``, except that the stream may go on reading ``data`` after it returns: the
        caller leaves those bytes unchanged until ``flush()`` (or closing) returns."""
        ...


def checked_name(name: str) -> str:
    """A file name inside the store: no separators, no '..', nothing absolute."""
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


# ---------------------------------------------------------------------------------------------
# the registry
# ---------------------------------------------------------------------------------------------
StoreFactory = Callable[[str, "dict | None", "bool | None"], Store]
"""``factory(url, storage_options, sync_files) -> Store``."""

_FACTORIES: dict[str, StoreFactory] = {}


def register_store(scheme: str, factory: StoreFactory) -> None:
    """Make ``open_store`` build ``scheme://...`` URLs with ``factory`` (replaces any earlier one)."""
    _FACTORIES[scheme] = factory


def unregister_store(scheme: str) -> None:
    _FACTORIES.pop(scheme, None)


def is_remote(checkpoint_id: str | os.PathLike) -> bool:
    text = os.fspath(checkpoint_id)
    return "://" in text and not text.startswith("file://")


def open_store(
    checkpoint_id: str | os.PathLike, storage_options: dict | None = None, sync_files: bool | None = None
) -> Store:
    """The store for a local path or URL: a registered factory for its scheme, else a local
    directory (plain paths, ``file://``) or fsspec (any other scheme)."""
    text = os.fspath(checkpoint_id)
    scheme = text.split("://", 1)[0] if "://" in text else ""
    factory = _FACTORIES.get(scheme)
    if factory is not None:
        return factory(text, storage_options, sync_files)
    if not is_remote(text):
        from .local import LocalStore

        path = text[len("file://") :] if text.startswith("file://") else text
        options = dict(storage_options or {})
        direct_io = options.pop(LOCAL_DIRECT_IO_OPTION, None)
        if options:
            raise ValueError(
                f"storage_options {sorted(options)} do not apply to the local path {text}: a local "
                f"directory takes only {LOCAL_DIRECT_IO_OPTION!r} (true, false, or null for automatic)"
            )
        if direct_io not in (None, True, False):
            raise ValueError(f"storage option {LOCAL_DIRECT_IO_OPTION}={direct_io!r}: want true, false or null")
        return LocalStore(path, sync_files=True if sync_files is None else sync_files, direct_io=direct_io)
    if sync_files:
        log.info("sync_files ignored for %s: object stores have no fsync", text)
    from .fsspec_store import FsspecStore

    return FsspecStore(text, storage_options)


def storage_options_from_pairs(pairs: list[str], flag: str = "--storage-option") -> dict | None:
    """``["key=value", ...]`` (command-line ``flag``s) as fsspec storage options; values are
    JSON where they parse as JSON (numbers, booleans, objects), else strings."""
    options = {}
    for pair in pairs or []:
        key, sep, value = pair.partition("=")
        if not sep:
            raise SystemExit(f"{flag} expects key=value, got {pair!r}")
        try:
            options[key] = json.loads(value)
        except ValueError:
            options[key] = value
    return options or None


def remove_checkpoint(store: Store) -> None:
    """Un-commit first (.metadata), then delete: a crash midway leaves an incomplete directory,
    never a committed checkpoint with missing files."""
    store.delete(METADATA)
    store.remove_tree()


# ---------------------------------------------------------------------------------------------
# retries
# ---------------------------------------------------------------------------------------------
# Errors that another attempt cannot fix: what the checkpoint says, what the caller asked for,
# and programming errors. Everything else on an object store (a reset connection, a 5xx the
# client gave up on, a body cut short and caught by its checksum) is worth a fresh attempt.
_PERMANENT = (
    UnsafeCheckpointError,
    CheckpointExistsError,
    CheckpointIncompleteError,
    CheckpointNotFoundError,
    FileExistsError,
    FileNotFoundError,
    PermissionError,
    TypeError,
    AttributeError,
    KeyError,
    AssertionError,
    NotImplementedError,
)
# A write that hits "not found" lost its upload session (GCS resumable uploads): redo it.
_PERMANENT_FOR_WRITES = tuple(e for e in _PERMANENT if e is not FileNotFoundError)
_NO_ROOM = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EFBIG}
_CONNECTION_ERRORS = {"ConnectionError", "HTTPClientError", "ClientConnectionError"}  # builtin, botocore, aiohttp


def exception_chain(exc: BaseException | None, limit: int = 8) -> Iterator[BaseException]:
    """``exc`` and what it wraps, nearest first: clients put the telling error underneath."""
    while exc is not None and limit > 0:
        yield exc
        exc = exc.__cause__ or exc.__context__
        limit -= 1


def endpoint_unreachable(exc: BaseException | None) -> bool:
    """Is this (or what it wraps) a failure to connect or to get a response at all?

    Matched by class names along the MRO so neither botocore nor aiohttp has to be imported.
    """
    return any({cls.__name__ for cls in type(link).__mro__} & _CONNECTION_ERRORS for link in exception_chain(exc))


def retrying(store: Store, what: str, fn, *, writing: bool = False):
    """Call ``fn``; again after a transient failure, as ``store.retry`` allows.

    The last failure is raised as a :class:`StorageError` that says what was being done where.
    """
    attempts = max(1, store.retry.attempts)
    permanent = _PERMANENT_FOR_WRITES if writing else _PERMANENT
    started = time.monotonic()
    for attempt in range(attempts):
        try:
            return fn()
        except permanent:
            raise
        except Exception as exc:
            out_of_space = isinstance(exc, OSError) and exc.errno in _NO_ROOM
            # A connection error reaching us means the client already retried the request to
            # exhaustion: the endpoint is gone, and another round would only multiply the
            # time before the user hears it.
            spent = time.monotonic() - started
            if attempt + 1 == attempts or out_of_space or endpoint_unreachable(exc):
                if isinstance(exc, CheckpointError):
                    raise
                tries = f" after {attempt + 1} attempt(s) in {spent:.0f} s" if attempts > 1 else ""
                raise StorageError(f"{store.url}: {what} failed{tries}: {type(exc).__name__}: {exc}") from exc
            log.warning("%s: %s failed (%s: %s); retrying", store.url, what, type(exc).__name__, exc)
            time.sleep(store.retry.backoff_s * 2**attempt)
    raise AssertionError("unreachable")
