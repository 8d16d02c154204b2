"""The storage limit, measured as well as dmuon's own I/O is: several ways to write and read the
same bytes, each rank its own file, so that a checkpoint is compared with the best of them.

    python benchmarks/raw_io.py [--mib 512] [--ranks 4] [--repeats 5] [--dir DIR]

run alone, it prints the device's sequential bandwidth (one process, ``O_DIRECT``), then times
every write and read method below with ``--ranks`` processes, each writing and reading its own
``--mib / --ranks`` MiB file, methods interleaved, order rotated, min and median of wall time
(slowest process, barrier to barrier) and CPU. ``save_load.py`` imports the same functions and
runs them inside its ranks, interleaved with dmuon's and torch's saves.

Writes (every one ends with ``fsync``; the bytes are durable when it returns):

  plain      ``write`` of 4 MiB at a time into the page cache, then ``fsync``: every byte is
             dirty until the end, and ``fsync`` waits for the device to take all of them
  behind     the same writes, and every ``window`` bytes ``sync_file_range(WRITE)`` starts
             writing the window back without waiting, so the device works while later bytes
             are copied (dirty memory stays near a window); ``fsync`` at the end
  threads    ``pwrite`` of disjoint ranges from several threads (the GIL is released in the
             call), writeback started per window as in ``behind``, then ``fsync``
  direct     ``O_DIRECT`` from page-aligned memory in large aligned writes (an unaligned tail,
             if any, through a second buffered descriptor), then ``fsync``

Reads (into one reused buffer, so no tensor memory is written: the limit of a load):

  plain      ``readinto`` 4 MiB at a time through the page cache
  seq        the same with ``posix_fadvise(SEQUENTIAL)`` and 16 MiB reads (larger read-ahead)
  threads    ``preadv`` of disjoint 16 MiB ranges from several threads, ``posix_fadvise(SEQUENTIAL)``
  direct     ``O_DIRECT`` 16 MiB at a time into page-aligned memory, past the page cache

Cold reads drop the file's pages first (``fsync``, then ``posix_fadvise(DONTNEED)``: no root).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import mmap
import os
import statistics
import sys
import tempfile
import time

from dmuon.dcp.storage.write_behind import start_writeback  # (the writer's own writeback kick)

O_DIRECT = getattr(os, "O_DIRECT", 0)
ALIGN = 4096
BLOCK = 4 << 20  # bytes per write/read call of the plain methods
BIG_BLOCK = 16 << 20  # bytes per call of the sequential and direct methods
WINDOW = 16 << 20  # bytes between two starts of writeback
THREADS = 2

WRITES = ("plain", "behind", "threads", "direct")
READS = ("plain", "seq", "threads", "direct")




def aligned_buffer(nbytes: int, fill: bytes | None = None) -> mmap.mmap:
    """Page-aligned memory (what ``O_DIRECT`` needs), filled with ``fill`` repeated if given."""
    size = max(ALIGN, -(-nbytes // ALIGN) * ALIGN)
    buffer = mmap.mmap(-1, size)
    if fill:
        view = memoryview(buffer)
        for start in range(0, size, len(fill)):
            n = min(len(fill), size - start)
            view[start : start + n] = fill[:n]
        view.release()
    return buffer


class Source:
    """The bytes every method writes: ``BIG_BLOCK`` of random data in page-aligned memory,
    repeated (random so that no layer below can compress or deduplicate them)."""

    def __init__(self) -> None:
        self.buffer = aligned_buffer(BIG_BLOCK, os.urandom(1 << 20))
        self.view = memoryview(self.buffer)
        self.read_buffer = aligned_buffer(BIG_BLOCK)
        self.read_view = memoryview(self.read_buffer)


# ---------------------------------------------------------------------------------------------
# writes
# ---------------------------------------------------------------------------------------------
def write_plain(path: str, nbytes: int, source: Source, block: int = BLOCK) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        left = nbytes
        while left > 0:
            left -= os.write(fd, source.view[: min(left, block)])
        os.fsync(fd)
    finally:
        os.close(fd)


def write_behind(path: str, nbytes: int, source: Source, window: int = WINDOW, block: int = BLOCK) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        done = started = 0
        while done < nbytes:
            done += os.write(fd, source.view[: min(nbytes - done, block)])
            if done - started >= window:
                start_writeback(fd, started, done - started)
                started = done
        os.fsync(fd)
    finally:
        os.close(fd)


def write_threads(path: str, nbytes: int, source: Source, threads: int = THREADS, window: int = WINDOW) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.ftruncate(fd, nbytes)
        chunks = [(start, min(window, nbytes - start)) for start in range(0, nbytes, window)]

        def one(chunk):
            start, length = chunk
            done = 0
            while done < length:
                n = min(length - done, len(source.view))
                done += os.pwrite(fd, source.view[:n], start + done)
            start_writeback(fd, start, length)

        with concurrent.futures.ThreadPoolExecutor(threads) as pool:
            list(pool.map(one, chunks))
        os.fsync(fd)
    finally:
        os.close(fd)


def write_direct(path: str, nbytes: int, source: Source, block: int = BIG_BLOCK) -> None:
    aligned = nbytes // ALIGN * ALIGN
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | O_DIRECT, 0o644)
    try:
        done = 0
        while done < aligned:
            done += os.pwrite(fd, source.view[: min(aligned - done, block)], done)
        if nbytes > aligned:  # the unaligned tail, buffered
            tail = os.open(path, os.O_WRONLY)
            try:
                os.pwrite(tail, source.view[aligned % BIG_BLOCK :][: nbytes - aligned], aligned)
                os.fsync(tail)
            finally:
                os.close(tail)
        os.fsync(fd)  # (the file's size and block map)
    finally:
        os.close(fd)


def write(method: str, path: str, nbytes: int, source: Source) -> None:
    {"plain": write_plain, "behind": write_behind, "threads": write_threads, "direct": write_direct}[method](
        path, nbytes, source
    )


# ---------------------------------------------------------------------------------------------
# reads
# ---------------------------------------------------------------------------------------------
def read_plain(path: str, source: Source, block: int = BLOCK, sequential: bool = False) -> int:
    fd = os.open(path, os.O_RDONLY)
    try:
        if sequential:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        return _read_to_end(fd, source.read_view[:block])
    finally:
        os.close(fd)


def _read_to_end(fd: int, view: memoryview, direct: bool = False) -> int:
    """Read ``fd`` from its position to its end, every call into the same ``view``; bytes read.
    ``direct``: a short read is the end (``O_DIRECT`` reads the last, partial page short)."""
    total = 0
    while n := os.readv(fd, [view]):
        total += n
        if direct and n < view.nbytes:
            break
    return total


def read_direct(path: str, source: Source, block: int = BIG_BLOCK) -> int:
    try:
        fd = os.open(path, os.O_RDONLY | O_DIRECT)
    except OSError:
        return read_plain(path, source, block)
    try:
        return _read_to_end(fd, source.read_view[:block], direct=True)
    finally:
        os.close(fd)


def read_threads(path: str, source: Source, threads: int = THREADS, block: int = BIG_BLOCK) -> int:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        size = os.fstat(fd).st_size
        width = block // threads  # each thread its own part of the one buffer

        def one(index):
            view, total = source.read_view[index * width : (index + 1) * width], 0
            for offset in range(index * width, size, width * threads):
                total += os.preadv(fd, [view[: min(width, size - offset)]], offset)
            return total

        with concurrent.futures.ThreadPoolExecutor(threads) as pool:
            return sum(pool.map(one, range(threads)))
    finally:
        os.close(fd)


def read(method: str, path: str, source: Source) -> int:
    if method == "threads":
        return read_threads(path, source)
    if method == "plain":
        return read_plain(path, source)
    if method == "seq":
        return read_plain(path, source, BIG_BLOCK, sequential=True)
    return read_direct(path, source)


def drop(path: str) -> None:
    """``path`` out of the page cache (written back first); no root needed."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


# ---------------------------------------------------------------------------------------------
# the device
# ---------------------------------------------------------------------------------------------
def device_bandwidth(directory: str, nbytes: int = 1 << 30, block: int = 64 << 20) -> dict:
    """One process, one file: ``nbytes`` written with ``O_DIRECT`` (+ fsync) and read back with
    ``O_DIRECT``, ``block`` per call: the device's sequential write and read bandwidth, GiB/s."""
    buffer = aligned_buffer(block, os.urandom(1 << 20))
    view = memoryview(buffer)
    fd_path = tempfile.mkstemp(prefix="dmuon-raw-bandwidth-", dir=directory)
    os.close(fd_path[0])
    path = fd_path[1]
    try:
        fd = os.open(path, os.O_WRONLY | os.O_TRUNC | O_DIRECT)
        start = time.perf_counter()
        for offset in range(0, nbytes, block):
            os.pwrite(fd, view, offset)
        os.fsync(fd)
        write_s = time.perf_counter() - start
        os.close(fd)
        drop(path)
        fd = os.open(path, os.O_RDONLY | O_DIRECT)
        start = time.perf_counter()
        total = 0
        while n := os.readv(fd, [view]):
            total += n
        read_s = time.perf_counter() - start
        os.close(fd)
    finally:
        os.remove(path)
        view.release()
        buffer.close()
    return {
        "bytes": nbytes,
        "write_s": write_s,
        "read_s": read_s,
        "write_gib_s": nbytes / 2**30 / write_s,
        "read_gib_s": total / 2**30 / read_s,
    }


def cpu_seconds() -> float:
    import resource

    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


# ---------------------------------------------------------------------------------------------
# alone: processes and a barrier, no torch
# ---------------------------------------------------------------------------------------------
def _rank(rank, directory, nbytes, repeats, barrier, out):
    source = Source()
    path = f"{directory}/{rank}.bin"
    samples: dict = {}
    ops = [("write", m) for m in WRITES]
    for repeat in range(-1, repeats):
        k = repeat % len(ops)
        for _kind, method in ops[k:] + ops[:k]:
            barrier.wait()
            start, cpu = time.perf_counter(), cpu_seconds()
            write(method, path, nbytes, source)
            row = [("write-" + method, time.perf_counter() - start, cpu_seconds() - cpu)]
            barrier.wait()
            for reader in READS:
                drop(path)
                barrier.wait()
                start, cpu = time.perf_counter(), cpu_seconds()
                read(reader, path, source)
                row.append((f"read-cold-{reader}", time.perf_counter() - start, cpu_seconds() - cpu))
                barrier.wait()
            os.remove(path)
            barrier.wait()
            if repeat >= 0:
                for name, wall, cpu in row:
                    samples.setdefault(name, []).append((wall, cpu))
    out.put((rank, samples))


def main(argv=None) -> None:
    import multiprocessing

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=512, help="bytes of all ranks together, MiB (default 512)")
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dir", default=None, help="where to write (default: the repository's parent)")
    args = parser.parse_args(argv)
    directory = tempfile.mkdtemp(
        prefix="dmuon-raw-", dir=args.dir or os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    )
    try:
        bw = device_bandwidth(directory)
        print(
            f"device, one process, O_DIRECT 64 MiB calls, 1 GiB: write+fsync {bw['write_gib_s']:.2f} GiB/s, "
            f"read {bw['read_gib_s']:.2f} GiB/s"
        )
        nbytes = args.mib * 2**20 // args.ranks
        context = multiprocessing.get_context("spawn")
        barrier, out = context.Barrier(args.ranks), context.Queue()
        procs = [
            context.Process(target=_rank, args=(r, directory, nbytes, args.repeats, barrier, out))
            for r in range(args.ranks)
        ]
        for p in procs:
            p.start()
        results = dict(out.get(timeout=3600) for _ in procs)
        for p in procs:
            p.join()
        print(f"{args.ranks} processes x {nbytes / 2**20:.0f} MiB, {args.repeats} repeats, interleaved")
        print(f"  {'':<20}{'wall min':>10}{'median':>9}{'CPU-s med':>11}{'GiB/s (med)':>13}")
        for name in results[0]:
            walls = [max(results[r][name][i][0] for r in results) for i in range(args.repeats)]
            cpus = [sum(results[r][name][i][1] for r in results) for i in range(args.repeats)]
            med = statistics.median(walls)
            print(
                f"  {name:<20}{min(walls):>10.3f}{med:>9.3f}{statistics.median(cpus):>11.3f}"
                f"{args.mib / 1024 / med:>13.2f}"
            )
    finally:
        import shutil

        shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
