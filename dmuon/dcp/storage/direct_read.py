"""Reading a local file that is not in the page cache past it (``O_DIRECT``).

Why: a cold load (a restart) reads every byte from the device. Through the page cache each
byte lands in a page the kernel must first allocate, and is then copied again into the
tensor; on some VMs a page the kernel has not just freed costs 30 times the CPU of a recycled
one (``benchmarks/page_first_touch.py``), and whichever pages it gets decide the load's time:
on this project's VM the same cold load took 0.19 s or 0.48 s for 128 MiB per rank, by the
order of what ran before it. Read past the cache, the bytes go from the device into a few
reused buffers and from there into the tensors: the cost is the device's, every time.

Only where nothing of the file is cached (:func:`is_cold`): a file a save just wrote through
the page cache, or that another rank of the node has read, is read from memory as before.

:class:`DirectReadFile` is a seekable read-only stream. What the reader says it will read
next (``will_need``, :class:`~.base.ReadAheadStream`) is read ahead by background threads in
aligned requests of up to :data:`CHUNK_BYTES`, :data:`READ_THREADS` requests in flight (one at a time
left the device idle between requests: on this project's VM, 2 ranks reading 512 MiB cold took
0.34-0.49 s with one 8 MiB request at a time, 0.27-0.29 s with two of 16 MiB; four of 8 MiB
read a rank's 256 MiB in 0.13-0.20 s where two of 16 MiB took 0.21-0.29 s, with the same 48
MiB of buffers), and at most
:data:`CHUNKS_AHEAD` chunks held at a time. Only the hinted bytes are read (widened to whole
pages), never the rest of a chunk around them: when the ranks of a cooperative load each read
their share of one file, a rank that read whole 16 MiB chunks around its items also read its
neighbours' (HSDP 2x2 with the exchange on, over 4 ranks: 1.11x the checkpoint's bytes for
128 MiB, 1.44x for 256 MiB; 1.00x now). A read
the hints did not cover (the trailer, a header) is read on the spot, only the aligned pages it
touches. ``bytes_fetched`` counts every byte read from the file, hinted or not.
"""

from __future__ import annotations

import bisect
import collections
import ctypes
import ctypes.util
import io
import mmap
import os
import threading

from .direct_io import DIRECT_IO_ALIGN, O_DIRECT

__all__ = [
    "CHUNKS_AHEAD",
    "CHUNK_BYTES",
    "DIRECT_READ_MIN_BYTES",
    "READ_THREADS",
    "DirectReadFile",
    "is_cached",
    "is_cold",
]

CHUNK_BYTES = 8 << 20  # bytes per read-ahead request (aligned)
CHUNKS_AHEAD = 6  # chunks read ahead or waiting to be consumed, per open file (48 MiB)
READ_THREADS = 4  # read-ahead requests in flight at once
DIRECT_READ_MIN_BYTES = 16 << 20  # smaller files are read through the page cache
_SAMPLES = 8  # pages of a file looked at to tell whether any of it is cached


def is_cold(path: str, size: int) -> bool:
    """True when none of ``_SAMPLES`` pages spread over the file is in the page cache, asked
    of the kernel with ``mincore`` on a mapping of the file (which reads nothing: a read with
    ``RWF_NOWAIT`` would start the kernel's read-ahead around every page it looked at). False
    where that cannot be asked: the page cache is then used, as everywhere else."""
    resident = _resident_samples(path, size)
    return resident is not None and not any(resident)


def is_cached(path: str, size: int) -> bool:
    """True when every one of the ``_SAMPLES`` pages looked at is in the page cache (a file a
    save just wrote through it, or a load read): reading it asks nothing of the device.
    False where that cannot be asked."""
    resident = _resident_samples(path, size)
    return resident is not None and all(resident)


def _resident_samples(path: str, size: int) -> list[bool] | None:
    """Whether each of ``_SAMPLES`` pages spread over the file is in the page cache; None
    where the kernel cannot be asked."""
    if _libc is None or size <= 0:
        return None
    fd = os.open(path, os.O_RDONLY)
    try:
        address = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if address in (None, ctypes.c_void_p(-1).value):
            return None
        try:
            resident, found = ctypes.c_ubyte(), []
            for k in range(_SAMPLES):
                offset = (2 * k + 1) * size // (2 * _SAMPLES) // mmap.PAGESIZE * mmap.PAGESIZE
                if _libc.mincore(ctypes.c_void_p(address + offset), 1, ctypes.byref(resident)) != 0:
                    return None
                found.append(bool(resident.value & 1))
            return found
        finally:
            _libc.munmap(ctypes.c_void_p(address), size)
    finally:
        os.close(fd)


def _load_libc():
    """libc's ``mmap``, ``mincore`` and ``munmap``, typed; None where there are none."""
    name = ctypes.util.find_library("c")
    if name is None or not O_DIRECT:
        return None
    try:
        libc = ctypes.CDLL(name, use_errno=True)
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
        libc.mmap.restype = ctypes.c_void_p
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]
        libc.mincore.restype = ctypes.c_int
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        libc.munmap.restype = ctypes.c_int
    except (OSError, AttributeError):
        return None
    return libc


_libc = _load_libc()


class _Chunk:
    """One aligned request being read, or read, into a buffer of the pool: ``length`` bytes
    of the file from ``start`` (at most :data:`CHUNK_BYTES`)."""

    def __init__(self, start: int, length: int) -> None:
        self.start = start
        self.length = length
        self.buffer = memoryview(b"")  # (given one of the pool's when its read starts)
        self.nbytes = 0  # bytes of the file in it (fewer than ``length`` at the end of the file)
        self.error: BaseException | None = None
        self.done = threading.Event()

    @property
    def end(self) -> int:
        return self.start + self.length


class DirectReadFile(io.RawIOBase):
    """A local file read with ``O_DIRECT`` into reused aligned buffers; see the module."""

    def __init__(self, path: str) -> None:
        super().__init__()
        self.name = path
        self._fd = os.open(path, os.O_RDONLY | O_DIRECT)
        self._size = os.fstat(self._fd).st_size
        self._pos = 0
        self._maps = [mmap.mmap(-1, CHUNK_BYTES) for _ in range(CHUNKS_AHEAD)]
        self._spare = [memoryview(m) for m in self._maps]  # buffers not holding a chunk
        self._chunks: dict[int, _Chunk] = {}  # start -> chunk being read or read
        self._wanted: collections.deque[_Chunk] = collections.deque()  # hinted, not started, in order
        # the byte ranges ever hinted, sorted and disjoint (each byte is read ahead once)
        self._hinted_starts: list[int] = []
        self._hinted_ends: list[int] = []
        self.bytes_fetched = 0  # bytes read from the file so far (read ahead or on the spot)
        self._lock = threading.Condition()
        self._scratch: mmap.mmap | None = None  # for reads the hints did not cover (made on the first)
        self._scratch_view = memoryview(b"")
        self._scratch_range = (0, 0)  # file bytes it holds
        self._stop = False
        self._threads = [
            threading.Thread(target=self._read_ahead, name="dmuon-direct-read", daemon=True)
            for _ in range(READ_THREADS)
        ]
        for thread in self._threads:
            thread.start()

    # -- the stream ------------------------------------------------------------------------
    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self._pos, os.SEEK_END: self._size}[whence]
        if base + offset < 0:
            raise ValueError(f"negative seek position in {self.name}")
        self._pos = base + offset
        return self._pos

    def fileno(self) -> int:
        return self._fd

    def readinto(self, b) -> int:
        """As many bytes as ``b`` holds, or up to the end of the file (never fewer otherwise)."""
        out = memoryview(b).cast("B")
        done = 0
        while done < out.nbytes and self._pos < self._size:
            got = self._copy_from_chunk(out[done:]) or self._copy_from_scratch(out[done:])
            done += got
            self._pos += got
        return done

    def will_need(self, offset: int, length: int) -> None:
        """Queue these bytes (whole pages: O_DIRECT reads no less) for reading ahead, in
        requests of at most a chunk; bytes hinted before are not queued again. Never waits."""
        end_of_file = -(-self._size // DIRECT_IO_ALIGN) * DIRECT_IO_ALIGN
        end = min(-(-(offset + length) // DIRECT_IO_ALIGN) * DIRECT_IO_ALIGN, end_of_file)
        with self._lock:
            for start, stop in self._not_hinted(offset // DIRECT_IO_ALIGN * DIRECT_IO_ALIGN, end):
                last = self._wanted[-1] if self._wanted else None
                if last is not None and last.end == start:  # right after a request not started: it grows
                    grown = min(CHUNK_BYTES - last.length, stop - start)
                    last.length += grown
                    start += grown
                while start < stop:
                    piece = _Chunk(start, min(CHUNK_BYTES, stop - start))
                    self._wanted.append(piece)
                    start = piece.end
            self._lock.notify_all()

    def _not_hinted(self, start: int, stop: int) -> list[tuple[int, int]]:
        """(Lock held.) The parts of [start, stop) not hinted before, in order; all of it is
        hinted from now on."""
        if start >= stop:
            return []
        starts, ends = self._hinted_starts, self._hinted_ends
        first = bisect.bisect_left(ends, start)  # the first range that ends at or after ``start``
        last, gaps, at = first, [], start
        while last < len(starts) and starts[last] <= stop:  # (ranges that touch are merged)
            if starts[last] > at:
                gaps.append((at, starts[last]))
            at = max(at, ends[last])
            last += 1
        if at < stop:
            gaps.append((at, stop))
        if last > first:
            start, stop = min(start, starts[first]), max(stop, ends[last - 1])
        starts[first:last], ends[first:last] = [start], [stop]
        return gaps

    def close(self) -> None:
        if self.closed:
            return
        with self._lock:
            self._stop = True
            self._lock.notify_all()
        for thread in self._threads:
            thread.join()
        os.close(self._fd)
        self._chunks.clear()
        self._spare.clear()
        self._scratch_view.release()
        if self._scratch is not None:
            self._scratch.close()
        for m in self._maps:
            m.close()
        super().close()

    # -- what was read ahead ---------------------------------------------------------------
    def _copy_from_chunk(self, out: memoryview) -> int:
        """Bytes at the position from a chunk read ahead (waiting for it if it is on its
        way); 0 when no chunk holds them. Chunks before the position are given back."""
        pos = self._pos
        with self._lock:
            for old in [k for k, chunk in self._chunks.items() if chunk.end <= pos]:
                self._release(old)
            while self._wanted and self._wanted[0].end <= pos:  # read past (on the spot): not read ahead
                self._wanted.popleft()
            chunk = next((c for c in self._chunks.values() if c.start <= pos < c.end), None)
            if chunk is None:
                chunk = next((c for c in self._wanted if c.start <= pos < c.end), None)
                if chunk is None:
                    return 0
                # the reader got here first: it reads the request itself (from the position on),
                # or, with no buffer free, reads these bytes on the spot
                self._wanted.remove(chunk)
                if not self._spare:
                    return 0
                first = pos // DIRECT_IO_ALIGN * DIRECT_IO_ALIGN
                chunk.start, chunk.length = first, chunk.end - first
                chunk.buffer = self._spare.pop()
                self._chunks[first] = chunk
                mine = True
            else:
                mine = False
        if mine:
            self._fill(chunk)
        chunk.done.wait()
        if chunk.error is not None:
            raise chunk.error
        start = pos - chunk.start
        n = min(out.nbytes, chunk.nbytes - start)
        if n <= 0:
            return 0
        out[:n] = chunk.buffer[start : start + n]
        if start + n == chunk.length:
            with self._lock:
                self._release(chunk.start)
        return n

    def _release(self, start: int) -> None:
        """(Lock held.) The chunk's buffer goes back to the pool once its read has ended."""
        chunk = self._chunks.get(start)
        if chunk is not None and chunk.done.is_set():
            del self._chunks[start]
            self._spare.append(chunk.buffer)
            self._lock.notify_all()

    def _read_ahead(self) -> None:
        while True:
            with self._lock:
                while not self._stop and not (self._wanted and self._spare):
                    self._lock.wait()
                if self._stop:
                    return
                # (not dropped when it lies before the position: the position may be the end of
                # a trailer read before the hints, not yet moved back to the first item)
                chunk = self._wanted.popleft()
                chunk.buffer = self._spare.pop()
                self._chunks[chunk.start] = chunk
            self._fill(chunk)

    def _fill(self, chunk: _Chunk) -> None:
        try:
            chunk.nbytes = self._pread(chunk.buffer[: chunk.length], chunk.start)
        except BaseException as error:  # raised in the reader's thread when it gets there
            chunk.error = error
        chunk.done.set()

    # -- reads on the spot -----------------------------------------------------------------
    def _copy_from_scratch(self, out: memoryview) -> int:
        """Bytes at the position read now, only the aligned pages they touch (up to a chunk);
        kept, since a header is often followed by a read of the bytes just after it."""
        start, stop = self._scratch_range
        if not start <= self._pos < stop:
            first = self._pos // DIRECT_IO_ALIGN * DIRECT_IO_ALIGN
            end = -(-(self._pos + out.nbytes) // DIRECT_IO_ALIGN) * DIRECT_IO_ALIGN
            end = min(end, first + CHUNK_BYTES)
            if self._scratch is None:
                self._scratch = mmap.mmap(-1, CHUNK_BYTES)
                self._scratch_view = memoryview(self._scratch)
            got = self._pread(self._scratch_view[: end - first], first)
            self._scratch_range = start, stop = first, first + got
            if got <= self._pos - first:
                raise OSError(f"{self.name}: short read at byte {self._pos} of {self._size}")
        n = min(out.nbytes, stop - self._pos)
        out[:n] = self._scratch_view[self._pos - start : self._pos - start + n]
        return n

    def _pread(self, buffer: memoryview, offset: int) -> int:
        """Aligned reads into ``buffer`` until it is full or the file ends; bytes read."""
        done = 0
        while done < buffer.nbytes:
            got = os.preadv(self._fd, [buffer[done:]], offset + done)
            if got == 0:
                break
            done += got
            with self._lock:
                self.bytes_fetched += got
            if got % DIRECT_IO_ALIGN:  # (only the file's last, partial page is unaligned)
                break
        return done
