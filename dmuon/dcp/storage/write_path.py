"""Direct or buffered writes for a local checkpoint directory: chosen by timing both there.

Neither is faster everywhere. Direct I/O (``O_DIRECT``) skips the page cache: less CPU, and the
training job's cache is left alone, but each write waits for the device, and a load right
after the save (a job rolling back on the same node) reads the device again. Buffered writes
end in one ``fsync`` and leave the file in memory for that load. Which costs less wall time
depends on the device, the kernel and the VM, not on the filesystem's name, so the first
streamed write into a filesystem times both, with the same bytes, alternately, and keeps the
answer for that filesystem in this process:

* ``PROBE_BYTES`` are written and fsynced twice each way into a temporary file of the
  checkpoint directory (removed after); the minimum of each way is kept;
* direct I/O is chosen only when it takes at most ``DIRECT_MARGIN`` of the buffered wall time
  (a buffered write also leaves the data cached for a load right after);
* a filesystem that refuses ``O_DIRECT``, or whose ``O_DIRECT`` is not plain (tmpfs, network
  and cluster filesystems, btrfs: ``local.DIRECT_IO_FILESYSTEMS``), gets buffered
  writes without a probe.

The explicit ``direct_io=`` storage option skips all this and wins. Each choice is logged once
(logger ``dmuon.dcp.storage.write_path``, INFO) with both timings; :func:`known_choices` lists them
and :func:`forget_choices` drops them (the next write probes again).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import mmap
import os
import threading
import time
import uuid
from dataclasses import dataclass

from .direct_io import O_DIRECT

__all__ = ["DIRECT_MARGIN", "PROBE_BYTES", "WritePathChoice", "choose_write_path", "forget_choices", "known_choices"]

log = logging.getLogger(__name__)

PROBE_BYTES = 32 << 20
DIRECT_MARGIN = 0.85
_CHUNK = 256 << 10  # page-aligned (mmap): what O_DIRECT needs of memory
_PROBE_PREFIX = ".dmuon-write-probe-"


@dataclass(frozen=True)
class WritePathChoice:
    """What was chosen for one filesystem, and the measurement behind it."""

    direct: bool
    buffered_s: float | None
    direct_s: float | None
    reason: str

    def describe(self) -> str:
        way = "direct I/O" if self.direct else "buffered writes"
        if self.buffered_s is None or self.direct_s is None:
            return f"{way} ({self.reason})"
        mib = PROBE_BYTES >> 20
        return (
            f"{way}: {mib} MiB + fsync took {self.buffered_s * 1e3:.0f} ms buffered, "
            f"{self.direct_s * 1e3:.0f} ms direct ({self.reason})"
        )


# st_dev of a filesystem -> the choice made for it in this process (see known_choices)
_choices: dict[int, WritePathChoice] = {}
_lock = threading.Lock()


def known_choices() -> dict[int, WritePathChoice]:
    """The choices made so far in this process, by filesystem (``st_dev``)."""
    with _lock:
        return dict(_choices)


def forget_choices() -> None:
    """Drop every cached choice: the next streamed write into each filesystem probes again."""
    with _lock:
        _choices.clear()


def choose_write_path(root: str, direct_possible: bool) -> WritePathChoice:
    """Direct or buffered for streamed files under the existing directory ``root``.

    ``direct_possible``: whether direct I/O is an option here at all (a plain ``O_DIRECT``).
    One probe per filesystem per process; concurrent callers wait for it.
    """
    device = os.stat(root).st_dev
    with _lock:
        known = _choices.get(device)
        if known is None:
            known = _probe(root) if direct_possible else _NOT_AN_OPTION
            _choices[device] = known
            log.info("%s: %s", root, known.describe())
    return known


_NOT_AN_OPTION = WritePathChoice(False, None, None, "direct I/O is not an option on this filesystem")


def _probe(root: str) -> WritePathChoice:
    """Both ways from one page-aligned 256 KiB buffer (about all the memory a probe may take:
    it runs inside the first save, whose peak memory is bounded)."""
    chunk = mmap.mmap(-1, _CHUNK)
    chunk.write(os.urandom(_CHUNK))  # (incompressible, whatever the filesystem does with zeros)
    path = os.path.join(root, f"{_PROBE_PREFIX}{uuid.uuid4().hex}")
    timings: dict[bool, list[float]] = {False: [], True: []}
    try:
        for _ in range(2):
            for direct in (False, True):
                try:
                    timings[direct].append(_timed_write(path, memoryview(chunk), direct))
                except OSError as error:
                    if direct and error.errno == errno.EINVAL:
                        return WritePathChoice(False, None, None, "the filesystem refuses O_DIRECT")
                    raise
    finally:
        chunk.close()
        with contextlib.suppress(OSError):
            os.remove(path)
    buffered_s, direct_s = min(timings[False]), min(timings[True])
    if direct_s <= DIRECT_MARGIN * buffered_s:
        return WritePathChoice(True, buffered_s, direct_s, f"direct took <= {DIRECT_MARGIN:.0%} of buffered")
    return WritePathChoice(False, buffered_s, direct_s, f"direct did not beat {DIRECT_MARGIN:.0%} of buffered")


def _timed_write(path: str, chunk: memoryview, direct: bool) -> float:
    start = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (O_DIRECT if direct else 0), 0o644)
    try:
        for index in range(PROBE_BYTES // chunk.nbytes):
            os.pwrite(fd, chunk, index * chunk.nbytes)
        os.fsync(fd)
    finally:
        os.close(fd)
        chunk.release()
    return time.perf_counter() - start
