"""A checkpoint directory on any fsspec filesystem: S3, GCS, Azure, memory, ...

Object stores make each upload appear whole when it completes, so nothing here fsyncs. What
this adds over plain fsspec: a conditional create for the commit (S3 ``If-None-Match``, GCS
``ifGenerationMatch=0``) with a read-back that recognises one's own retried write, bounded
client retries on S3, no partial object left by a failed upload, several requests in flight
per S3 stream (``s3_transfer.py``), ranged reads of what is needed on S3 and GCS
(``ranged_reader.py``), and large read-ahead elsewhere.
"""

from __future__ import annotations

import builtins
import contextlib
import errno
import functools
import logging
import os
from collections.abc import Callable, Iterator
from typing import Any, BinaryIO, TypeVar, cast

import fsspec

from .base import checked_name
from .ranged_reader import RangedReader
from .retry import DeadlinePassed, RetryPolicy, endpoint_unreachable, exception_chain, storage_errors, throttled
from .s3_transfer import S3ParallelWriter

__all__ = [
    "DEADLINE_OPTION",
    "DEADLINE_VARIABLE",
    "DEFAULT_DEADLINE_S",
    "S3_REQUEST_RETRIES",
    "FsspecStore",
    "open_fsspec_store",
]

log = logging.getLogger(__name__)


# gcsfs's own setting: when it is not given, gcsfs >= 2026 (on import) picks a client that probes
# a gRPC API on first use, which against emulators and many private endpoints stalls every call
# for minutes
GCSFS_GRPC_VARIABLE = "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"


def _filesystem(url: str, options: dict) -> tuple[Any, str]:
    """fsspec's filesystem for ``url``, and the path on it. For ``gs://``, gcsfs's plain JSON-API
    client unless the user set ``GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT`` themselves: chosen here, for
    this store, instead of writing the setting into the process's environment."""
    if url.split("://", 1)[0] in ("gs", "gcs") and os.environ.get(GCSFS_GRPC_VARIABLE) is None:
        from gcsfs.core import GCSFileSystem

        fs = GCSFileSystem(**{**GCSFileSystem._get_kwargs_from_urls(url), **options})
        return fs, GCSFileSystem._strip_protocol(url)
    return fsspec.core.url_to_fs(url, **options)


READ_BLOCK = 32 * 2**20
_OBJECT_STORES = {"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "oss", "r2"}
_S3 = ("s3", "s3a")
_GCS = ("gs", "gcs")


S3_REQUEST_RETRIES = {"mode": "standard", "max_attempts": 3}

#: the storage option, and the environment variable, that set how long an operation may keep
#: retrying (throttling answers above all); the option wins
DEADLINE_OPTION = "retry_deadline_s"
DEADLINE_VARIABLE = "DMUON_STORAGE_DEADLINE_S"
DEFAULT_DEADLINE_S = 600.0


def _retry_policy(url: str, options: dict) -> tuple[RetryPolicy, dict]:
    """The store's retry policy, with the deadline taken from ``options`` (removed from what
    goes to fsspec) or the environment; and the remaining options."""
    options = dict(options)
    value, where = options.pop(DEADLINE_OPTION, None), f"storage option {DEADLINE_OPTION}"
    if value is None:
        value, where = os.environ.get(DEADLINE_VARIABLE) or None, DEADLINE_VARIABLE
    try:
        deadline = DEFAULT_DEADLINE_S if value is None else float(value)
    except (TypeError, ValueError):
        deadline = -1.0
    if not deadline > 0:
        raise ValueError(f"{url}: {where}={value!r}: want a number of seconds above 0")
    return RetryPolicy(attempts=4, backoff_s=0.5, deadline_s=deadline), options


# S3_REQUEST_RETRIES's keys -> where botocore reads them otherwise (environment, config file)
_RETRY_SETTINGS = {"mode": ("AWS_RETRY_MODE", "retry_mode"), "max_attempts": ("AWS_MAX_ATTEMPTS", "max_attempts")}


def _configured_retry_settings(options: dict) -> set[str]:
    """Which of ``S3_REQUEST_RETRIES``'s keys the user set where botocore looks for them: in
    the environment, or in the config file's section for the profile in use (s3fs's
    ``profile`` or ``session`` option, else ``AWS_PROFILE``)."""
    configured = {key for key, (variable, _) in _RETRY_SETTINGS.items() if os.environ.get(variable)}
    if len(configured) == len(_RETRY_SETTINGS):
        return configured
    try:
        import botocore.session

        session: Any = options.get("session")
        if not hasattr(session, "get_scoped_config"):
            session = botocore.session.Session(profile=options.get("profile"))
        scoped = session.get_scoped_config()
    except Exception:  # no botocore, or a profile that is not there: s3fs reports that itself
        return configured
    return configured | {key for key, (_, name) in _RETRY_SETTINGS.items() if name in scoped}


def _unsigned_s3_payloads(url: str, options: dict) -> dict:
    """No SHA-256 of each request's body for its signature, unless the caller asks for one.

    botocore already leaves it out over HTTPS; over plain HTTP (a local or on-premises server)
    it hashes every byte, about 0.8 CPU-s/GiB. The headers stay signed, and every part carries
    its CRC-32C, which the server checks (``s3_transfer.py``).
    """
    if url.split("://", 1)[0] not in _S3:
        return options
    config = dict(options.get("config_kwargs") or {})
    s3 = dict(config.get("s3") or {})
    if "payload_signing_enabled" in s3:
        return options
    s3["payload_signing_enabled"] = False
    config["s3"] = s3
    return {**options, "config_kwargs": config}


def _bounded_s3_retries(url: str, options: dict) -> dict:
    """Give botocore a retry policy with a known ceiling, unless the caller chose one.

    botocore's default ("legacy") backs off by a random factor, and s3fs repeats each call five
    times around it: a dead endpoint then took anywhere from 30 s to over 60 s to report.
    "standard" mode (AWS's recommendation) still retries throttling, 5xx and resets, and, with
    s3fs's own five, makes 15 tries per call within about half a minute. An explicit
    ``config_kwargs["retries"]`` wins; so does a mode or an attempt count set in the
    environment or the AWS config file (an explicit client setting would override those).
    """
    if url.split("://", 1)[0] not in _S3:
        return options
    config = dict(options.get("config_kwargs") or {})
    if "retries" in config:
        return options
    configured = _configured_retry_settings(options)
    retries = {key: value for key, value in S3_REQUEST_RETRIES.items() if key not in configured}
    if not retries:
        return options
    config["retries"] = retries
    return {**options, "config_kwargs": config}


F = TypeVar("F", bound=Callable[..., Any])


def _client_errors(what: str) -> Callable[[F], F]:
    """A store method whose client's own exceptions come out as a ``StorageError`` naming the
    store's URL (and the file, for a method given one first) and ``what`` was done."""

    def decorate(method: F) -> F:
        @functools.wraps(method)
        def wrapper(self: FsspecStore, *args: Any, **kwargs: Any) -> Any:
            where = f"{self.url}/{args[0]}" if args and isinstance(args[0], str) else self.url

            def call() -> Any:
                with storage_errors(where, what):
                    return method(self, *args, **kwargs)

            return throttled(where, what, self.retry, call)

        return cast(F, wrapper)

    return decorate


class FsspecStore:
    """Any fsspec filesystem. Objects appear whole on close; fsync would add nothing there.

    Every operation lets the client's own exceptions out as a ``StorageError`` naming the URL,
    the original as its cause (``retry.storage_errors``); ``OSError``s pass as they are. A
    throttling answer is retried with backoff until the deadline (``retry_deadline_s``, default
    :data:`DEFAULT_DEADLINE_S`), then a ``DeadlinePassed`` names the server's last answer."""

    retry = RetryPolicy(attempts=4, backoff_s=0.5, deadline_s=DEFAULT_DEADLINE_S)

    def __init__(self, url: str, storage_options: dict | None = None) -> None:
        policy, options = _retry_policy(url, storage_options or {})
        with storage_errors(url, "opening the store"):
            options = _unsigned_s3_payloads(url, _bounded_s3_retries(url, options))
            fs, path = _filesystem(url, options)
        self._attach(fs, path.rstrip("/"), url.rstrip("/"), policy)

    def _attach(self, fs, root: str, url: str, retry: RetryPolicy) -> None:
        self.fs, self.root, self.url, self.retry = fs, root, url, retry
        protocols = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
        self.protocols = set(protocols)
        # s3fs's files send one request at a time; keep several in flight instead
        self.parallel_s3 = bool(self.protocols & set(_S3)) and hasattr(fs, "call_s3")
        # a reader that fetches only the ranges it is told of: a rank reading a few items of
        # another rank's file must not fetch the file (gcsfs's own file reads blocks around them)
        self.ranged_reads = self.parallel_s3 or bool(self.protocols & set(_GCS))

    @classmethod
    def _on(cls, fs, root: str, url: str, retry: RetryPolicy) -> FsspecStore:
        """A store on an already connected filesystem (a child directory)."""
        store = cls.__new__(cls)
        store._attach(fs, root, url, retry)
        return store

    def _path(self, name: str) -> str:
        return f"{self.root}/{checked_name(name)}"

    @_client_errors("creating the directory")
    def makedirs(self) -> None:
        # Object stores have no directories to create, and asking costs a request that, with
        # the endpoint down, adds a whole retry cycle before the error surfaces.
        if self.protocols & _OBJECT_STORES:
            return
        with contextlib.suppress(FileExistsError):
            self.fs.makedirs(self.root, exist_ok=True)

    @_client_errors("listing")
    def is_dir(self) -> bool:
        return bool(self.list()) or self.fs.isdir(self.root)

    @_client_errors("listing")
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
        with storage_errors(f"{self.url}/{name}", "opening for writing"):
            f: Any = (
                S3ParallelWriter(self.fs, path, retry=self.retry, url=f"{self.url}/{name}")
                if self.parallel_s3
                else self.fs.open(path, "wb")
            )
        try:
            yield f
            with storage_errors(f"{self.url}/{name}", "writing"):
                f.close()
        except BaseException as exc:
            # fsspec uploads whatever was buffered on close(); throw it away instead. With the
            # endpoint unreachable, asking it to abort or delete would only wait out the client's
            # retries once more: the leftovers are never committed, and a later save removes them.
            # Past the deadline (a store still refusing), the same: the cleanup would be refused too.
            reachable = not endpoint_unreachable(exc) and not isinstance(exc, DeadlinePassed)
            with contextlib.suppress(Exception):
                if isinstance(f, S3ParallelWriter):
                    f.discard(abort_upload=reachable)
                else:
                    if reachable and hasattr(f, "discard"):
                        f.discard()
                    f.closed = True
            if reachable:
                with contextlib.suppress(Exception):
                    self.fs.rm_file(path)
            raise

    @_client_errors("opening for reading")
    def open_read(self, name: str, size: int | None = None) -> BinaryIO:
        # On S3 and GCS, ranged GETs of what the reader says it will read, several in flight
        # (ranged_reader.py); elsewhere a large read-ahead, which turns items read in file
        # order into a few big requests instead of one per item.
        path = self._path(name)
        if self.ranged_reads:
            size = self.fs.size(path) if size is None else size
            return cast(BinaryIO, RangedReader(self.fs, path, size, retry=self.retry, url=f"{self.url}/{name}"))
        return self.fs.open(path, "rb", block_size=READ_BLOCK, cache_type="readahead")

    @_client_errors("reading")
    def read(self, name: str) -> bytes:
        return self.fs.cat_file(self._path(name))

    @_client_errors("writing")
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

    @_client_errors("deleting")
    def delete(self, name: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(self._path(name))

    @_client_errors("reading the time of")
    def modified(self, name: str) -> float:
        return self.fs.modified(self._path(name)).timestamp()

    def child(self, name: str) -> FsspecStore:
        return FsspecStore._on(self.fs, self._path(name), f"{self.url}/{checked_name(name)}", self.retry)

    @_client_errors("listing")
    def list_dirs(self) -> builtins.list[str]:
        try:
            self.fs.invalidate_cache(self.root)
            entries = self.fs.ls(self.root, detail=True)
        except FileNotFoundError:
            return []
        root = self.root.rstrip("/")
        return [
            e["name"].rstrip("/").rsplit("/", 1)[-1]
            for e in entries
            if e.get("type") == "directory" and e["name"].rstrip("/") != root  # (an empty root lists itself)
        ]

    @_client_errors("deleting")
    def remove_tree(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm(self.root, recursive=True)
        if self.parallel_s3:
            # Some S3 servers (SeaweedFS) keep a prefix whose objects are gone as an empty
            # directory that listings still show: delete its marker too (a no-op elsewhere).
            bucket, key, _ = self.fs.split_path(self.root)
            with contextlib.suppress(FileNotFoundError):
                self.fs.call_s3("delete_object", Bucket=bucket, Key=key.rstrip("/") + "/")
            self.fs.invalidate_cache(self.root)


def open_fsspec_store(url: str, storage_options: dict | None, sync_files: bool | None) -> FsspecStore:
    """The registry's factory for every scheme without a backend of its own: ``storage_options``
    go to fsspec (endpoint, credentials); there is no fsync to ask for."""
    if sync_files:
        log.info("sync_files ignored for %s: object stores have no fsync", url)
    return FsspecStore(url, storage_options)


def _is_precondition_failure(exc: BaseException) -> bool:
    """Did a conditional create fail because the object exists?

    Clients disagree on how to say so: gcsfs puts "precondition" in the message, s3fs maps
    S3's 412 to ``OSError(EINVAL, None)`` and leaves the code only on the botocore error it
    chains (Ceph RGW answers that way; SeaweedFS's message happens to name it). Look at the
    whole chain, at status codes as well as text.
    """
    for link in exception_chain(exc):
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
