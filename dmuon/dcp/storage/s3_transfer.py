"""Streams to and from S3 that keep several requests in flight.

s3fs's file objects send one multipart part at a time and stop the writer while it travels,
and read ahead one block at a time; a whole-object ``pipe_file``/``cat_file`` instead keeps
many requests in flight, which is what the link and the server are built for. A dmuon data file
is written as a stream (its size is known only at the end) and read as a stream in file order,
so the writer here and the reader of ``s3_reader.py`` give a stream the concurrency of the
whole-object calls: parts are handed to a small thread pool as soon as they are full, and
ranged GETs run ahead of the reader. Memory stays bounded: at most ``concurrency + 1`` parts
per stream.

Only s3fs's public calls are used (``call_s3``, ``cat_file``, ``abort_mpu``); the requests go
through the filesystem's own client, so its retries, credentials and endpoint apply.

Every part and single PUT carries its CRC-32C (``x-amz-checksum-crc32c``), computed here with
the CPU's CRC instruction (about 0.05 CPU-s/GiB), and the server refuses a part whose bytes do
not match: a byte damaged on the way is caught before the checkpoint commits, not at the next
load. Given that checksum, botocore computes none of its own (its default CRC-32 costs about
0.3 CPU-s/GiB in zlib), and with ``payload_signing_enabled=False`` (``fsspec_store.py``) no
SHA-256 of the payload for the request signature either.

A part goes to the HTTP client as a :class:`PartBody`, which hands it over in 1 MiB views of
the part's own buffer, not as one ``bytearray``: aiohttp and asyncio (Python < 3.12.9) copy a
16 MiB body up to four times on the way to the socket (a slice, a join with the headers, the
unsent rest, the transport's buffer), each copy into fresh memory, all on fsspec's one event
loop thread. Parts are filled into buffers that are reused once their upload is done.
"""

from __future__ import annotations

import base64
import collections
import contextlib
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

import crc32c

from .retry import RetryPolicy, current_deadline, throttled

__all__ = [
    "S3_MAX_OBJECT_BYTES",
    "S3_PART_BYTES",
    "S3_UPLOAD_CONCURRENCY",
    "S3ParallelWriter",
    "ThrottledRequests",
    "part_bytes_for",
]

# The first parts of an object: 16 MiB, measured by benchmarks/object_storage.py
# (docs/performance.md). S3 parts are 5 MiB to 5 GiB (except the last) and at most 10,000 per
# object, so a fixed 16 MiB would stop at 156 GiB: see part_bytes_for.
S3_PART_BYTES = 16 << 20
S3_UPLOAD_CONCURRENCY = 4
S3_MAX_PARTS = 10_000
S3_MAX_PART_BYTES = 5 << 30
S3_MAX_OBJECT_BYTES = 5 << 40
#: the part size doubles after every this many parts
PARTS_PER_SIZE = 1_000


def part_bytes_for(number: int, first: int = S3_PART_BYTES, per_size: int = PARTS_PER_SIZE) -> int:
    """The size of part ``number`` (from 1) of a streamed object, whose size is known only at
    its end: ``first`` for the first thousand parts, then twice that for the next thousand, and
    so on, at most 5 GiB. Small objects keep small parts (and the memory of a stream, at most
    ``concurrency + 1`` parts, stays small); any object up to S3's 5 TiB fits in 10,000 parts
    (16 MiB first parts: 15.6 GiB with 16 MiB parts, 234 GiB by 128 MiB parts, 5 TiB by 4 GiB
    parts; ``tests/dcp/storage/test_s3_part_sizes.py``)."""
    return min(first << ((number - 1) // per_size), S3_MAX_PART_BYTES)


def part_checksum(data) -> str:
    """The CRC-32C of ``data`` as S3's ``ChecksumCRC32C`` field wants it (base64, big-endian)."""
    return base64.b64encode(crc32c.crc32c(data).to_bytes(4, "big")).decode("ascii")


def _bucket_and_key(path: str) -> tuple[str, str]:
    bucket, _, key = path.partition("/")
    return bucket, key


T = TypeVar("T")

#: the size of the views a part is handed to the HTTP client in
BODY_PIECE_BYTES = 1 << 20


class PartBody:
    """One part's bytes as a request body that aiohttp sends piece by piece (an async iterable
    of views into ``data``, no copy) and botocore accepts (it has ``read``, ``seek`` and a
    length). botocore asks the server for ``100-continue`` before a body with ``read``: a part
    the server refuses (throttling) is refused before its bytes travel."""

    def __init__(self, data, piece: int = BODY_PIECE_BYTES) -> None:
        self._view = memoryview(data).cast("B")
        self._piece = piece
        self._position = 0

    def __len__(self) -> int:
        return self._view.nbytes

    def __aiter__(self):
        return self._pieces()

    async def _pieces(self):
        for start in range(0, self._view.nbytes, self._piece):
            yield self._view[start : start + self._piece]

    def read(self, size: int = -1) -> bytes:
        end = self._view.nbytes if size is None or size < 0 else min(self._position + size, self._view.nbytes)
        data = bytes(self._view[self._position : end])
        self._position = end
        return data

    def seek(self, offset: int, whence: int = 0) -> int:
        base = {0: 0, 1: self._position, 2: self._view.nbytes}[whence]
        self._position = max(0, base + offset)
        return self._position

    def tell(self) -> int:
        return self._position


class ThrottledRequests:
    """One stream's requests: each sent again, with backoff, while S3 answers that it is
    throttling (``retry.throttled``), until the deadline of the operation that opened the
    stream (or ``policy.deadline_s`` from its opening). Without a policy, sent once (s3fs and
    botocore still retry as they do)."""

    def __init__(self, url: str, policy: RetryPolicy | None) -> None:
        self.url, self.policy = url, policy
        self.deadline = current_deadline()
        if self.deadline is None and policy is not None and policy.deadline_s is not None:
            self.deadline = time.monotonic() + policy.deadline_s

    def __call__(self, what: str, fn: Callable[[], T]) -> T:
        if self.policy is None:
            return fn()
        return throttled(self.url, what, self.policy, fn, deadline=self.deadline)


class S3ParallelWriter:
    """A write-only stream that becomes the object ``path`` on ``close()``.

    Objects smaller than one part go up in one PUT; larger ones as a multipart upload with up
    to ``concurrency`` parts in flight. ``discard()`` aborts the upload (nothing appears).
    """

    def __init__(
        self,
        fs,
        path: str,
        part_bytes: int = S3_PART_BYTES,
        concurrency: int = S3_UPLOAD_CONCURRENCY,
        parts_per_size: int = PARTS_PER_SIZE,
        *,
        retry: RetryPolicy | None = None,
        url: str | None = None,
    ):
        """``part_bytes``: the first parts' size; it doubles every ``parts_per_size`` parts
        (:func:`part_bytes_for`). ``retry``: a throttled request is sent again as it says
        (``url`` names the object in the error when its deadline passes)."""
        self.fs, self.path = fs, path
        self._requests = ThrottledRequests(url or f"s3://{path}", retry)
        self.bucket, self.key = _bucket_and_key(path)
        self.part_bytes, self.concurrency, self.parts_per_size = part_bytes, concurrency, parts_per_size
        self.closed = False
        self._part = bytearray()  # the part being filled: its first _filled bytes
        self._filled = 0
        self._spare: list[bytearray] = []  # part buffers whose upload is done, to fill again
        self._upload_id: str | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._in_flight: collections.deque[Future] = collections.deque()
        self._etags: dict[int, tuple[str, str]] = {}  # part number -> (ETag, CRC-32C), from the upload threads
        self._parts_sent = 0
        self._position = 0

    def writable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._position

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        taken = 0
        while taken < view.nbytes:
            if self._parts_sent >= S3_MAX_PARTS:
                raise OSError(
                    f"{self.path}: larger than an S3 object can be ({S3_MAX_PARTS} parts, "
                    f"{S3_MAX_OBJECT_BYTES >> 40} TiB); nothing was committed"
                )
            size = part_bytes_for(self._parts_sent + 1, self.part_bytes, self.parts_per_size)
            if len(self._part) != size:
                self._part = self._buffer(size)
            n = min(size - self._filled, view.nbytes - taken)
            self._part[self._filled : self._filled + n] = view[taken : taken + n]
            self._filled += n
            taken += n
            if self._filled == size:
                self._send(self._part, size)
                self._part, self._filled = bytearray(), 0
        self._position += view.nbytes
        return view.nbytes

    def flush(self) -> None:
        pass

    def _buffer(self, size: int) -> bytearray:
        """A buffer for the next part: one whose upload is done, if it has the size."""
        while self._in_flight and self._in_flight[0].done():
            self._reclaim(self._in_flight.popleft().result())
        self._spare = [b for b in self._spare if len(b) == size]  # parts only grow: smaller ones are done with
        return self._spare.pop() if self._spare else bytearray(size)

    def _reclaim(self, part: bytearray) -> None:
        if len(self._spare) < self.concurrency:
            self._spare.append(part)

    def _send(self, part: bytearray, size: int) -> None:
        if self._upload_id is None:
            started = self._call("starting the upload", "create_multipart_upload", ChecksumAlgorithm="CRC32C")
            self._upload_id = started["UploadId"]
            self._pool = ThreadPoolExecutor(self.concurrency, thread_name_prefix="dmuon-s3-upload")
        assert self._pool is not None
        while len(self._in_flight) >= self.concurrency:
            self._reclaim(self._in_flight.popleft().result())  # raises the part's error here, in the writer
        self._parts_sent += 1
        self._in_flight.append(self._pool.submit(self._upload_part, self._parts_sent, part, size))

    def _upload_part(self, number: int, part: bytearray, size: int) -> bytearray:
        """Upload the first ``size`` bytes of ``part``; the buffer back, to be filled again."""
        data = memoryview(part)[:size]
        checksum = part_checksum(data)
        answer = self._call(
            f"uploading part {number}",
            "upload_part",
            PartNumber=number,
            UploadId=self._upload_id,
            Body=PartBody(data),
            ChecksumCRC32C=checksum,
        )
        self._etags[number] = (answer["ETag"], checksum)
        return part

    def _call(self, what: str, method: str, **kwargs: Any) -> Any:
        """``method`` on this object, sent again while throttled (:class:`ThrottledRequests`)."""
        return self._requests(what, lambda: self.fs.call_s3(method, Bucket=self.bucket, Key=self.key, **kwargs))

    def close(self) -> None:
        if self.closed:
            return
        try:
            if self._upload_id is None:
                body = bytes(memoryview(self._part)[: self._filled])
                self._call("writing", "put_object", Body=body, ChecksumCRC32C=part_checksum(body))
            else:
                if self._filled:
                    self._send(self._part, self._filled)
                    self._part, self._filled = bytearray(), 0
                while self._in_flight:
                    self._in_flight.popleft().result()
                if sorted(self._etags) != list(range(1, self._parts_sent + 1)):
                    raise OSError(f"{self.path}: parts {sorted(self._etags)} uploaded of {self._parts_sent} sent")
                parts = [
                    {"PartNumber": n, "ETag": etag, "ChecksumCRC32C": checksum}
                    for n, (etag, checksum) in sorted(self._etags.items())
                ]
                self._call(
                    "completing the upload",
                    "complete_multipart_upload",
                    UploadId=self._upload_id,
                    MultipartUpload={"Parts": parts},
                )
        except BaseException:
            self.discard()
            raise
        self._finish()
        self.fs.invalidate_cache(self.path)

    def discard(self, abort_upload: bool = True) -> None:
        """Throw the upload away: no object appears; the server frees the parts, unless
        ``abort_upload=False`` (an unreachable endpoint: asking would only wait out the retries;
        an unfinished upload never becomes an object, and bucket lifecycle rules expire it)."""
        for future in self._in_flight:
            future.cancel()
        for future in self._in_flight:
            with contextlib.suppress(BaseException):
                future.result()
        upload_id, self._upload_id = self._upload_id, None
        self._finish()
        if upload_id is not None and abort_upload:
            with contextlib.suppress(Exception):
                self.fs.abort_mpu(self.bucket, self.key, upload_id)

    def _finish(self) -> None:
        self.closed = True
        self._in_flight.clear()
        self._part, self._filled, self._spare = bytearray(), 0, []
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def __enter__(self) -> S3ParallelWriter:
        return self

    def __exit__(self, *exc) -> None:
        if exc[0] is None:
            self.close()
        else:
            self.discard()
