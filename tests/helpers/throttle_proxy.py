"""A request-rate throttling HTTP reverse proxy on loopback, in front of a real S3 or GCS server.

Object stores limit the request rate per key prefix (S3: about 3,500 writes and 5,500 reads a
second per prefix) and refuse what comes above it: S3 with ``503 SlowDown``, GCS with ``429``
``rateLimitExceeded``. This proxy does the same in front of the local SeaweedFS or
fake-gcs-server: every request is charged to the prefix of the object key it names (the key up
to its last ``/``, bucket included, or what ``prefix_of`` makes of it), each prefix has a token
bucket that refills at ``rate`` requests a second (``read_rate`` for GET and HEAD, when given)
and holds at most ``burst`` tokens, and a request that finds no token is answered with the
server's own error body instead of being forwarded. Refusals and forwarded requests are counted
per prefix (``refused``, ``forwarded``), for the test to read.

Forwarded requests go on as ``http_proxy.py`` forwards them; ``stop()`` ends the proxy.
"""
from __future__ import annotations

import asyncio
import json
import re
import threading
import time
from collections import Counter
from collections.abc import Callable
from urllib.parse import parse_qs, unquote, urlsplit

from .http_proxy import LoopbackProxy, error_response, headers_of, read_body, read_head, with_connection_close

S3_SLOWDOWN = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
               b"<Message>Please reduce your request rate.</Message>"
               b"<RequestId>THROTTLEPROXY</RequestId><HostId>throttle-proxy</HostId></Error>")
GCS_RATE_LIMITED = json.dumps({"error": {
    "code": 429,
    "message": "The rate of change requests to the object exceeds the rate limit. Please reduce the rate "
               "of create, update, and delete requests (rateLimitExceeded).",
    "errors": [{"domain": "usageLimits", "reason": "rateLimitExceeded",
                "message": "Please reduce your request rate (rateLimitExceeded)."}],
}}).encode()

_GCS_OBJECT = re.compile(r"/b/([^/]+)/o/(.+)$")  # .../b/<bucket>/o/<quoted name>
_GCS_BUCKET = re.compile(r"/b/([^/]+)/o/?$")  # .../b/<bucket>/o (uploads, listings)
_JSON_NAME = re.compile(rb'"name"\s*:\s*"((?:[^"\\]|\\.)*)"')


def parent_prefix(key: str) -> str:
    """S3's partitioning, simplified: ``bucket/dir/sub/file`` -> ``bucket/dir/sub``."""
    return key.rpartition("/")[0] if "/" in key else key


class TokenBucket:
    """``rate`` tokens a second, at most ``burst`` held; a request takes one or is refused."""

    def __init__(self, rate: float, burst: float) -> None:
        self.rate, self.burst = rate, burst
        self.tokens = burst
        self.last = time.monotonic()

    def take(self) -> bool:
        now = time.monotonic()
        self.tokens = min(self.burst, self.tokens + (now - self.last) * self.rate)
        self.last = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return True
        return False


class ThrottleProxy(LoopbackProxy):
    """Throttle ``kind`` ("s3" or "gcs") requests to the server on ``upstream_port``.

    ``rate``: requests a second allowed per prefix (0: none past the burst); ``read_rate``: the
    same for GET and HEAD (default ``rate``); ``burst``: tokens a fresh prefix starts with and
    at most holds (default ``max(1, rate)``); ``prefix_of``: the prefix an object key
    (``bucket/key``) is charged to (default: up to its last ``/``).
    """

    name = "throttle-proxy"

    def __init__(self, upstream_port: int, kind: str, rate: float, *, read_rate: float | None = None,
                 burst: float | None = None, prefix_of: Callable[[str], str] = parent_prefix) -> None:
        if kind not in ("s3", "gcs"):
            raise ValueError(f"kind must be 's3' or 'gcs', not {kind!r}")
        self.kind = kind
        self.rate = rate
        self.read_rate = rate if read_rate is None else read_rate
        self.burst = max(1.0, rate) if burst is None else burst
        self.prefix_of = prefix_of
        self.refused: Counter = Counter()  # prefix -> requests answered with the error
        self.forwarded: Counter = Counter()  # prefix -> requests passed to the server
        self.unknown_targets: list[str] = []  # requests that named no key (charged to "")
        self.reads: Counter = Counter()  # (method, bucket/key) -> GETs and HEADs passed to the server
        self._buckets: dict[tuple[str, bool], TokenBucket] = {}
        self._uploads: dict[str, str] = {}  # GCS resumable upload id -> its object's key
        self._lock = threading.Lock()
        super().__init__(upstream_port)

    # -- what the test reads and sets ------------------------------------------------------

    def total_refused(self) -> int:
        with self._lock:
            return sum(self.refused.values())

    def total_forwarded(self) -> int:
        with self._lock:
            return sum(self.forwarded.values())

    def set_rate(self, rate: float, read_rate: float | None = None, burst: float | None = None) -> None:
        """New limits, from now on, for every prefix (buckets start full again)."""
        with self._lock:
            self.rate = rate
            self.read_rate = rate if read_rate is None else read_rate
            self.burst = max(1.0, rate) if burst is None else burst
            self._buckets.clear()

    def _admit(self, prefix: str, read: bool) -> bool:
        with self._lock:
            bucket = self._buckets.get((prefix, read))
            if bucket is None:
                bucket = TokenBucket(self.read_rate if read else self.rate, self.burst)
                self._buckets[(prefix, read)] = bucket
            admitted = bucket.take()
            (self.forwarded if admitted else self.refused)[prefix] += 1
            return admitted

    # -- which key a request names ---------------------------------------------------------

    def _key(self, target: str, body: bytes) -> str | None:
        parts = urlsplit(target)
        query = parse_qs(parts.query)
        if self.kind == "s3":  # path style: /bucket/key...
            path = unquote(parts.path).lstrip("/")
            if "/" not in path and "prefix" in query:  # a listing: charged to what it lists
                return f"{path}/{query['prefix'][0]}"
            return path or None
        found = _GCS_OBJECT.search(parts.path)
        if found:
            return f"{found.group(1)}/{unquote(found.group(2))}"
        found = _GCS_BUCKET.search(parts.path)
        if not found:
            return None
        bucket = found.group(1)
        if "upload_id" in query:
            return self._uploads.get(query["upload_id"][0])
        if "name" in query:
            return f"{bucket}/{query['name'][0]}"
        named = _JSON_NAME.search(body[:65536])
        if named:
            name = json.loads(b'"' + named.group(1) + b'"')
            return f"{bucket}/{name}"
        if "prefix" in query:
            return f"{bucket}/{query['prefix'][0]}"
        return bucket

    def _remember_upload(self, key: str | None, response_head: bytes) -> None:
        """A GCS resumable upload's later requests name only its id: keep which key it is."""
        location = headers_of(response_head).get("location")
        if key and location:
            upload_id = parse_qs(urlsplit(location).query).get("upload_id")
            if upload_id:
                with self._lock:
                    self._uploads[upload_id[0]] = key

    # -- one connection, one request -------------------------------------------------------

    def _refusal(self) -> bytes:
        if self.kind == "s3":
            return error_response(b"503 Slow Down", b"application/xml", S3_SLOWDOWN)
        return error_response(b"429 Too Many Requests", b"application/json; charset=UTF-8", GCS_RATE_LIMITED)

    async def _one_request(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await read_head(reader)
        headers = headers_of(head)
        method, target = head.split(b" ", 2)[:2]
        expects_continue = "100-continue" in headers.get("expect", "").lower()
        body = b""
        if not expects_continue:  # the server sees the whole request before it answers
            body = await read_body(reader, headers, until_close=False)
        key = self._key(target.decode("latin-1"), body)
        if key is None:
            self.unknown_targets.append(f"{method.decode()} {target.decode('latin-1')}")
        prefix = self.prefix_of(key or "")
        read = method.upper() in (b"GET", b"HEAD")
        if not self._admit(prefix, read=read):
            writer.write(self._refusal())  # a client waiting for 100 Continue gets this instead
            await writer.drain()
            return
        if read:
            with self._lock:
                self.reads[(method.decode().upper(), key or "")] += 1
        if expects_continue:
            writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            await writer.drain()
            body = await read_body(reader, headers, until_close=False)
        response_head, status, response_body = await self.forward(head, body)
        if self.kind == "gcs" and status < 300:
            self._remember_upload(key, response_head)
        writer.write(with_connection_close(response_head) + response_body)
        await writer.drain()
