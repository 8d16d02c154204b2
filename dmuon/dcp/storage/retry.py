"""Retrying a whole storage operation after a transient failure, as each store allows.

Object-store clients retry single requests themselves; what they cannot redo is a
multi-request operation that failed midway (a lost upload session, a body cut short and caught
by dmuon's checksum). :func:`retrying` redoes such an operation from its start, as often as the
store's :class:`RetryPolicy` says, and raises the last failure as a :class:`StorageError` that
says what was being done where.
"""

from __future__ import annotations

import contextlib
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

__all__ = ["RetryPolicy", "endpoint_unreachable", "exception_chain", "retrying", "storage_errors"]

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


# What a store operation lets through as it is: dmuon's own errors, the OS's (``FileNotFoundError``
# and ``FileExistsError`` are answers of the Store protocol; a full disk and a refused
# permission are decided on by type above) and programming errors. Everything else is a
# client library's own exception (botocore's EndpointConnectionError, google-auth's, ...).
_OWN_TYPES = (CheckpointError, OSError, TypeError, AttributeError, KeyError, AssertionError, NotImplementedError)


@contextlib.contextmanager
def storage_errors(url: str, what: str) -> Iterator[None]:
    """Around a call into a storage client: its own exception types come out as a
    :class:`StorageError` naming ``url`` and what was being done, the original as its cause,
    so that a caller of any door catches one type and reads where it failed."""
    try:
        yield
    except _OWN_TYPES:
        raise
    except Exception as exc:
        raise StorageError(f"{url}: {what} failed: {type(exc).__name__}: {exc}") from exc


def _client_error(exc: BaseException) -> BaseException | None:
    """The client's exception :func:`storage_errors` wrapped in ``exc``, if it did."""
    cause = exc.__cause__
    if type(exc) is StorageError and cause is not None and not isinstance(cause, _OWN_TYPES):
        return cause
    return None


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
                original = _client_error(exc) or exc
                if isinstance(original, CheckpointError) or (original is not exc and attempts == 1):
                    raise
                tries = f" after {attempt + 1} attempt(s) in {spent:.0f} s" if attempts > 1 else ""
                raise StorageError(
                    f"{store.url}: {what} failed{tries}: {type(original).__name__}: {original}"
                ) from original
            log.warning("%s: %s failed (%s: %s); retrying", store.url, what, type(exc).__name__, exc)
            time.sleep(store.retry.backoff_s * 2**attempt)
    raise AssertionError("unreachable")
