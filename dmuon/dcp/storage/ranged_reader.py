"""A data file on object storage (S3, GCS) read as a stream in file order, with ranged GETs
running ahead of the reader, as many in flight as the whole-object calls keep.

The requests go through the filesystem's own ``cat_file`` (its client, credentials, endpoint
and retries), and through the same throttling retries as the S3 writer's
(``s3_transfer.ThrottledRequests``). A request costs far more than the bytes it might skip:
ranges the reader is told of that lie within :data:`MERGE_GAP_BYTES` of each other are fetched
as one.
"""

from __future__ import annotations

import collections
import threading
from concurrent.futures import Future, ThreadPoolExecutor

from .retry import RetryPolicy
from .s3_transfer import S3_PART_BYTES, S3_UPLOAD_CONCURRENCY, ThrottledRequests

__all__ = ["MERGE_GAP_BYTES", "RangedReader"]

# Two told ranges this close are one GET (the bytes between are fetched and dropped). A request
# costs tens of milliseconds, in which a store sends far more than this; kept small all the same,
# since bytes fetched and not used count too (each byte of a checkpoint fetched once per load),
# and in dmuon's own files what one rank reads lies together but for a few small items between.
MERGE_GAP_BYTES = 16 << 10


class RangedReader:
    """A read-only, seekable stream over the object ``path`` that fetches ahead of the reader,
    ``concurrency`` ranged GETs at a time.

    Told what comes next (:meth:`will_need`, the reader's hints: the items this rank reads, in
    file order), it fetches exactly those ranges, in pieces of at most ``block_bytes``, and
    nothing else: a rank that needs one item of another rank's file fetches that item, not the
    file (ranges told within ``merge_gap`` bytes of each other are one GET). Without hints it
    reads ahead ``block_bytes`` blocks from where it reads. A seek outside what is fetched
    drops what lies behind and starts there.
    """

    def __init__(
        self,
        fs,
        path: str,
        size: int,
        block_bytes: int = S3_PART_BYTES,
        concurrency: int = S3_UPLOAD_CONCURRENCY,
        *,
        retry: RetryPolicy | None = None,
        url: str | None = None,
        merge_gap: int = MERGE_GAP_BYTES,
    ):
        self.fs, self.path, self.size = fs, path, size
        self._requests = ThrottledRequests(url or path, retry)
        self.block_bytes, self.concurrency, self.merge_gap = block_bytes, concurrency, merge_gap
        self.closed = False
        self._position = 0
        self.bytes_fetched = 0  # by GETs so far (a range dropped and fetched again counts twice)
        self._count_lock = threading.Lock()
        self._pool = ThreadPoolExecutor(concurrency, thread_name_prefix="dmuon-s3-read")
        # start -> (end, GET in flight or done), in file order
        self._ranges: collections.OrderedDict[int, tuple[int, Future]] = collections.OrderedDict()
        self._hinted: collections.deque[tuple[int, int]] = collections.deque()  # ranges told, not yet asked for
        self._hints = False  # told anything at all: then only what is told (or read) is fetched

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._position

    def seek(self, offset: int, whence: int = 0) -> int:
        base = {0: 0, 1: self._position, 2: self.size}[whence]
        self._position = max(0, base + offset)
        return self._position

    def will_need(self, offset: int, length: int) -> None:
        """``length`` bytes from ``offset`` will be read soon: fetch them (in pieces of at most
        ``block_bytes``, as the concurrency allows), and from now on only what is told."""
        self._hints = True
        start, end = max(offset, 0), min(offset + length, self.size)
        while start < end:
            last = self._hinted[-1] if self._hinted else None
            if last is not None and 0 <= start - last[1] <= self.merge_gap and start - last[0] < self.block_bytes:
                first, _ = self._hinted.pop()  # continues it, or nearly
            else:
                first = start
            stop = min(end, first + self.block_bytes)
            self._hinted.append((first, stop))
            start = stop
        self._schedule()

    def _fetch(self, start: int, end: int) -> bytes:
        data = self._requests(f"reading bytes {start}-{end}", lambda: self.fs.cat_file(self.path, start=start, end=end))
        with self._count_lock:
            self.bytes_fetched += len(data)
        return data

    def _covering(self, position: int) -> int | None:
        for start, (end, _) in self._ranges.items():
            if start <= position < end:
                return start
        return None

    def _schedule(self) -> None:
        """Drop what lies well behind the reader (the range just behind is kept: a reader
        may step back a little, as a partial read of a row range does) and keep
        ``concurrency`` ranges at or after it requested."""
        current = self._covering(self._position)
        keep_from = self._position - self.block_bytes
        for start in [s for s, (end, _) in self._ranges.items() if end <= keep_from and s != current]:
            self._ranges.pop(start)[1].cancel()
        ahead = sum(1 for start, (end, _) in self._ranges.items() if end > self._position)
        if self._hints:
            while self._hinted and ahead < self.concurrency:
                start, end = self._hinted.popleft()
                if end <= self._position:
                    continue  # read already (or skipped): never fetched
                if self._covering(start) is None:
                    self._request(start, end)
                    ahead += 1
            return
        block = self._position - self._position % self.block_bytes
        for start in range(block, min(self.size, block + self.concurrency * self.block_bytes), self.block_bytes):
            if start not in self._ranges and self._covering(start) is None:
                self._request(start, min(start + self.block_bytes, self.size))

    def _request(self, start: int, end: int) -> None:
        self._ranges[start] = (end, self._pool.submit(self._fetch, start, end))
        self._ranges = collections.OrderedDict(sorted(self._ranges.items()))

    def readinto(self, buffer) -> int:
        out = memoryview(buffer).cast("B")
        done = 0
        while done < out.nbytes and self._position < self.size:
            self._schedule()
            start = self._covering(self._position)
            if start is None:  # not told, or told elsewhere: fetch from here
                self._request(self._position, min(self._position + self.block_bytes, self.size))
                start = self._position
            _, future = self._ranges[start]
            block = future.result()
            inside = self._position - start
            n = min(len(block) - inside, out.nbytes - done)
            if n <= 0:
                raise OSError(f"{self.path}: short read at byte {self._position} of {self.size}")
            out[done : done + n] = block[inside : inside + n]
            done += n
            self._position += n
        return done

    def read(self, size: int = -1) -> bytes:
        left = self.size - self._position
        n = left if size is None or size < 0 else min(size, left)
        buffer = bytearray(max(n, 0))
        got = self.readinto(buffer)
        return bytes(buffer[:got])

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for _, future in self._ranges.values():
            future.cancel()
        self._ranges.clear()
        self._pool.shutdown(wait=True)

    def __enter__(self) -> RangedReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
