"""Retrying a whole storage operation after a transient failure, as each store allows.

Object-store clients retry single requests themselves; what they cannot redo is a
multi-request operation that failed midway (a lost upload session, a body cut short and caught
by dmuon's checksum). :func:`retrying` redoes such an operation from its start, as often as the
store's :class:`RetryPolicy` says, and raises the last failure as a :class:`StorageError` that
says what was being done where.

Throttling is different: an answer that asks for a lower request rate (S3's ``503 SlowDown``,
GCS's ``429``/``503``) says nothing is wrong but the pace. It is retried with exponential
backoff and full jitter, without counting against the attempts, until the policy's deadline
(``deadline_s``, counted from the start of the outermost operation on this thread) passes;
then :class:`DeadlinePassed` names the URL, what was being done and the server's last answer.
:func:`throttled` does the same for one request inside an operation (an S3 part, a ranged
read), so that a refused part is sent again instead of the whole file.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import random
import threading
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

__all__ = [
    "DeadlinePassed",
    "RetryPolicy",
    "current_deadline",
    "endpoint_unreachable",
    "exception_chain",
    "is_throttling",
    "retrying",
    "server_answer",
    "storage_errors",
    "throttled",
]

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
    #: how long an operation may keep retrying, from its start; None: only ``attempts`` bound it
    deadline_s: float | None = None
    #: the longest wait after a throttling answer (the first is ``throttle_first_s``, doubled
    #: after each refusal in a row; the wait is drawn uniformly below it: full jitter)
    throttle_first_s: float = 0.2
    throttle_max_s: float = 5.0


class DeadlinePassed(StorageError):
    """An operation still failed (refused, most often) when its deadline passed; the message
    names the URL, what was being done and the server's last answer."""


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


# Error codes that ask for a lower request rate (S3 and S3-compatible servers, botocore's list)
_THROTTLE_CODES = {
    "SlowDown",
    "Throttling",
    "ThrottlingException",
    "ThrottledException",
    "RequestThrottledException",
    "TooManyRequestsException",
    "RequestLimitExceeded",
    "RequestThrottled",
    "BandwidthLimitExceeded",
    "rateLimitExceeded",
    "userRateLimitExceeded",
}
_THROTTLE_STATUS = {429, 503}
_THROTTLE_TEXT = ("slowdown", "slow down", "reduce your request rate", "ratelimitexceeded", "too many requests")


def _status_and_code(link: BaseException) -> tuple[int | None, str | None, str]:
    """(HTTP status, error code, message) a client's exception carries: botocore's
    ``response`` dict, or gcsfs's / aiohttp's ``code`` / ``status``."""
    response = getattr(link, "response", None)
    if isinstance(response, dict):
        error = response.get("Error") or {}
        status = (response.get("ResponseMetadata") or {}).get("HTTPStatusCode")
        return status, error.get("Code"), str(error.get("Message") or "")
    for name in ("code", "status"):
        value = getattr(link, name, None)
        if isinstance(value, str) and value.isdigit():
            value = int(value)
        if isinstance(value, int) and 100 <= value < 600:
            return value, None, str(getattr(link, "message", "") or link)
    return None, None, str(link)


def is_throttling(exc: BaseException | None) -> bool:
    """Does this failure (or what it wraps) ask for a lower request rate? S3's ``503 SlowDown``
    and its kin, GCS's ``429`` and ``503``."""
    for link in exception_chain(exc):
        status, code, _ = _status_and_code(link)
        if code in _THROTTLE_CODES or status in _THROTTLE_STATUS:
            return True
        text = str(link).lower()
        if any(phrase in text for phrase in _THROTTLE_TEXT):
            return True
    return False


def server_answer(exc: BaseException) -> str:
    """The server's answer inside a client's exception, as a line: ``503 SlowDown: Please
    reduce your request rate.``; else the exception itself."""
    for link in exception_chain(exc):
        status, code, message = _status_and_code(link)
        if status is not None or code is not None:
            head = " ".join(str(part) for part in (status, code) if part is not None)
            return f"{head}: {message}" if message else head
    return f"{type(exc).__name__}: {exc}"


_scope = threading.local()


def current_deadline() -> float | None:
    """The deadline (``time.monotonic()``) of the operation running on this thread, if any."""
    return getattr(_scope, "deadline", None)


@contextlib.contextmanager
def _deadline_scope(deadline: float | None) -> Iterator[float | None]:
    """Run under ``deadline``, or under the enclosing operation's if that is sooner: an
    operation inside another (a put inside a commit) never outlives the outer one."""
    outer = current_deadline()
    if deadline is None or (outer is not None and outer < deadline):
        deadline = outer
    _scope.deadline = deadline
    try:
        yield deadline
    finally:
        _scope.deadline = outer


def _deadline_for(policy: RetryPolicy, started: float) -> float | None:
    return None if policy.deadline_s is None else started + policy.deadline_s


def _throttle_wait(policy: RetryPolicy, refusals: int, deadline: float | None) -> float:
    """Full jitter: uniform below an exponentially growing cap, never past the deadline."""
    cap = min(policy.throttle_max_s, policy.throttle_first_s * 2 ** min(refusals, 30))
    wait = random.uniform(0.0, cap)
    return wait if deadline is None else max(0.0, min(wait, deadline - time.monotonic()))


def _deadline_error(url: str, what: str, policy: RetryPolicy, exc: BaseException) -> DeadlinePassed:
    limit = f"{policy.deadline_s:g} s" if policy.deadline_s is not None else "its enclosing operation's"
    return DeadlinePassed(
        f"{url}: {what} failed: still refused when the storage deadline ({limit}; storage option "
        f"'retry_deadline_s', or DMUON_STORAGE_DEADLINE_S) passed; the server's last answer: "
        f"{server_answer(exc)}"
    )


def throttled(url: str, what: str, policy: RetryPolicy, fn: Callable[[], T], *, deadline: float | None = None) -> T:
    """Call ``fn`` (one request, or one call of a client that retries it a few times); again,
    with backoff, while the answer is throttling, until ``deadline`` (default: the enclosing
    operation's, or ``policy.deadline_s`` from now). Any other failure is raised as it is."""
    started = time.monotonic()
    if deadline is None:
        deadline = current_deadline() or _deadline_for(policy, started)
    refusals = 0
    while True:
        try:
            return fn()
        except Exception as exc:
            if not is_throttling(exc) or isinstance(exc, DeadlinePassed):
                raise
            if deadline is not None and time.monotonic() >= deadline:
                raise _deadline_error(url, what, policy, exc) from exc
            log.debug("%s: %s throttled (%s); retrying", url, what, server_answer(exc))
            time.sleep(_throttle_wait(policy, refusals, deadline))
            refusals += 1


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
    """Call ``fn``; again after a transient failure, as ``store.retry`` allows: throttling
    answers until the policy's deadline, other transient failures ``attempts`` times in all.

    The last failure is raised as a :class:`StorageError` that says what was being done where.
    """
    policy = store.retry
    attempts = max(1, policy.attempts)
    permanent = _PERMANENT_FOR_WRITES if writing else _PERMANENT
    started = time.monotonic()
    with _deadline_scope(_deadline_for(policy, started)) as deadline:
        attempt = refusals = 0
        while True:
            try:
                return fn()
            except permanent:
                raise
            except DeadlinePassed:
                raise
            except Exception as exc:
                late = deadline is not None and time.monotonic() >= deadline
                if is_throttling(exc) and attempts > 1:
                    if late:
                        raise _deadline_error(store.url, what, policy, _client_error(exc) or exc) from exc
                    log.info("%s: %s throttled (%s); retrying", store.url, what, server_answer(exc))
                    time.sleep(_throttle_wait(policy, refusals, deadline))
                    refusals += 1
                    continue
                _give_up_unless_transient(store, what, exc, attempt, attempts, started, late)
                log.warning("%s: %s failed (%s: %s); retrying", store.url, what, type(exc).__name__, exc)
                wait = policy.backoff_s * 2**attempt
                time.sleep(wait if deadline is None else max(0.0, min(wait, deadline - time.monotonic())))
                attempt += 1


def _give_up_unless_transient(
    store: _Retried, what: str, exc: Exception, attempt: int, attempts: int, started: float, late: bool
) -> None:
    """Raise the failure of ``attempt`` (from 0) as the caller should see it, unless another
    attempt may fix it: attempts are left, the deadline has not passed, the disk is not full
    and the endpoint still answers (a connection error reaching us means the client already
    retried the request to exhaustion: another round would only delay the error)."""
    out_of_space = isinstance(exc, OSError) and exc.errno in _NO_ROOM
    if not (attempt + 1 >= attempts or late or out_of_space or endpoint_unreachable(exc)):
        return
    original = _client_error(exc) or exc
    if isinstance(original, CheckpointError) or (original is not exc and attempts == 1):
        raise exc
    spent = time.monotonic() - started
    tries = f" after {attempt + 1} attempt(s) in {spent:.0f} s" if attempts > 1 else ""
    raise StorageError(f"{store.url}: {what} failed{tries}: {type(original).__name__}: {original}") from original
