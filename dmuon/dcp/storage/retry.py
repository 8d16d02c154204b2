"""Retrying a whole storage operation after a transient failure, as each store allows.

Object-store clients retry single requests themselves; what they cannot redo is a
multi-request operation that failed midway (a lost upload session, a body cut short and caught
by dmuon's checksum). :func:`retrying` redoes such an operation from its start, as often as the
store's :class:`RetryPolicy` says, and raises the last failure as a :class:`StorageError` that
says what was being done where.
"""

from __future__ import annotations

import errno
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol, TypeVar

from ..errors import (
    CheckpointError,
    CheckpointExistsError,
    CheckpointIncompleteError,
    CheckpointNotFoundError,
    StorageError,
    UnsafeCheckpointError,
)

__all__ = ["RetryPolicy", "endpoint_unreachable", "exception_chain", "retrying"]

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True)
class RetryPolicy:
    """How often a whole operation (writing a file, reading one) is tried on this store.

    Local filesystems get one attempt: a retry would only hide a full disk or a permission
    error for longer.
    """

    attempts: int = 1
    backoff_s: float = 0.5  # doubled after every failed attempt


class _Retried(Protocol):
    """What :func:`retrying` needs of a store."""

    url: str
    retry: RetryPolicy


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


def retrying(store: _Retried, what: str, fn: Callable[[], T], *, writing: bool = False) -> T:
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
