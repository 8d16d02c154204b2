"""Direct or buffered writes for a local checkpoint directory: chosen by timing both there.

Neither is faster everywhere. Direct I/O (``O_DIRECT``) skips the page cache: less CPU, and the
training job's cache is left alone, but each write waits for the device, and a load right
after the save (a job rolling back to its own latest checkpoint on the same node) reads the
device again. Buffered writes (with writeback started as they go, ``write_behind.py``) end in
a short ``fsync`` and leave the file in memory for that load. Which costs less wall time
depends on the device, the kernel and the VM, not on the filesystem's name, so the first
streamed write into a filesystem times both, with the same bytes, alternately, and keeps the
answer for that filesystem in this process:

* each way, ``PROBE_BYTES`` are written and fsynced into a new temporary file of the
  checkpoint directory, then read back once, as a load right after the save would find them:
  from memory after a buffered write, from the device after a direct one. Twice each way,
  alternately; the minimum of each is kept. Every trial writes a file of its own, and all of
  them stay until the probe ends: a save of gigabytes needs page-cache pages the kernel has
  not just freed, and on some VMs such pages cost 30 times the CPU of recycled ones (measured
  here: ``benchmarks/page_first_touch.py``, 0.05 against 1.5-2.9 CPU-s for 256 MiB). A probe
  that rewrote one file timed the cheap case and chose buffered writes for saves that then
  ran 3-12x slower than direct I/O;
* direct I/O is chosen when its write plus read-back takes no longer than the buffered write
  plus read-back: a save is never made faster by making the next load of the same node slower
  than it gains, and at equal wall time direct I/O spares the CPU and the training job's page
  cache;
* a filesystem that refuses ``O_DIRECT``, or whose ``O_DIRECT`` is not plain (tmpfs, network
  and cluster filesystems, btrfs: ``local.DIRECT_IO_FILESYSTEMS``), gets buffered writes
  without a probe.

A 32 MiB probe cannot see everything a save of gigabytes meets (on this project's VM the
probe's pages came back recycled and cheap a third of the time, the save's never), so every
buffered data file of at least ``OBSERVED_MIN_BYTES`` is timed as it is written (the time in
its writes, writeback kicks and fsync: :func:`observe_buffered_write`): when its bytes went
out slower than the probe's direct cycle, later files in that filesystem are written direct.
A choice never goes back from direct to buffered within a process.

The explicit ``direct_io=`` storage option skips all this and wins. Each choice is logged once
(logger ``dmuon.dcp.storage.write_path``, INFO) with the four timings; :func:`known_choices`
lists them and :func:`forget_choices` drops them (the next write probes again).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import logging
import mmap
import os
import threading
import time
import uuid
from dataclasses import dataclass

from .direct_io import O_DIRECT
from .write_behind import WRITE_BEHIND_WINDOW, start_writeback

__all__ = [
    "DIRECT_MARGIN",
    "OBSERVED_MIN_BYTES",
    "PROBE_BYTES",
    "WritePathChoice",
    "choice_for",
    "choose_write_path",
    "forget_choices",
    "known_choices",
    "observe_buffered_write",
]

log = logging.getLogger(__name__)

PROBE_BYTES = 32 << 20
DIRECT_MARGIN = 1.0  # direct when its save + load cycle is at most this times buffered's
OBSERVED_MIN_BYTES = 64 << 20  # buffered files at least this large are timed as they are written
_CHUNK = 256 << 10  # page-aligned (mmap): what O_DIRECT needs of memory
_PROBE_PREFIX = ".dmuon-write-probe-"


@dataclass(frozen=True)
class WritePathChoice:
    """What was chosen for one filesystem, and the measurement behind it (seconds for
    ``PROBE_BYTES``: write + fsync, then the read-back a load right after would do)."""

    direct: bool
    reason: str
    buffered_s: float | None = None
    direct_s: float | None = None
    buffered_read_s: float | None = None
    direct_read_s: float | None = None

    def describe(self) -> str:
        way = "direct I/O" if self.direct else "buffered writes"
        if None in (self.buffered_s, self.direct_s, self.buffered_read_s, self.direct_read_s):
            return f"{way} ({self.reason})"
        names = ("buffered_s", "direct_s", "buffered_read_s", "direct_read_s")
        ms = {name: 1e3 * getattr(self, name) for name in names}
        return (
            f"{way}: {PROBE_BYTES >> 20} MiB written + fsynced, then read back: buffered {ms['buffered_s']:.0f} + "
            f"{ms['buffered_read_s']:.0f} ms, direct {ms['direct_s']:.0f} + {ms['direct_read_s']:.0f} ms "
            f"({self.reason})"
        )


# st_dev of a filesystem -> the choice made for it in this process (see known_choices)
_choices: dict[int, WritePathChoice] = {}
_lock = threading.Lock()


def known_choices() -> dict[int, WritePathChoice]:
    """The choices made so far in this process, by filesystem (``st_dev``)."""
    with _lock:
        return dict(_choices)


def choice_for(root: str) -> WritePathChoice | None:
    """What this process chose for the filesystem of ``root`` so far; None before its first
    streamed write there (nothing is probed here)."""
    device = os.stat(root).st_dev
    with _lock:
        return _choices.get(device)


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


_NOT_AN_OPTION = WritePathChoice(False, "direct I/O is not an option on this filesystem")


def observe_buffered_write(root: str, nbytes: int, seconds: float) -> WritePathChoice | None:
    """A buffered data file of ``nbytes`` under ``root`` took ``seconds`` in its writes,
    writeback kicks and fsync. When that, per byte and with the probe's read-back from memory
    added, is slower than the probe's direct write and read-back, the filesystem's choice
    becomes direct I/O (returned, and logged); None when it stays as it was."""
    if nbytes < OBSERVED_MIN_BYTES:
        return None
    device = os.stat(root).st_dev
    with _lock:
        known = _choices.get(device)
        if (
            known is None
            or known.direct
            or known.direct_s is None  # (not probed: direct I/O is no option here)
            or known.direct_read_s is None
            or known.buffered_read_s is None
        ):
            return None
        buffered_cycle = seconds / nbytes + known.buffered_read_s / PROBE_BYTES
        direct_cycle = (known.direct_s + known.direct_read_s) / PROBE_BYTES
        if direct_cycle > DIRECT_MARGIN * buffered_cycle:
            return None
        rate = nbytes / seconds / (1 << 20) if seconds > 0 else float("inf")
        changed = dataclasses.replace(
            known,
            direct=True,
            reason=f"a {nbytes >> 20} MiB buffered file then went out at {rate:.0f} MiB/s, slower than direct's probe",
        )
        _choices[device] = changed
    log.info("%s: %s", root, changed.describe())
    return changed


def _probe(root: str) -> WritePathChoice:
    """Both ways from one page-aligned 256 KiB buffer (about all the memory a probe may take:
    it runs inside the first save, whose peak memory is bounded)."""
    chunk = mmap.mmap(-1, _CHUNK)
    chunk.write(os.urandom(_CHUNK))  # (incompressible, whatever the filesystem does with zeros)
    view = memoryview(chunk)  # (released before the map is closed, also when a write fails)
    paths: list[str] = []  # one new file per trial, all removed at the end
    writes: dict[bool, list[float]] = {False: [], True: []}
    reads: dict[bool, list[float]] = {False: [], True: []}
    try:
        for _ in range(2):
            for direct in (False, True):
                paths.append(os.path.join(root, f"{_PROBE_PREFIX}{uuid.uuid4().hex}"))
                try:
                    writes[direct].append(_timed_write(paths[-1], view, direct))
                except OSError as error:
                    if direct and error.errno == errno.EINVAL:
                        return WritePathChoice(False, "the filesystem refuses O_DIRECT")
                    raise
                reads[direct].append(_timed_read(paths[-1], view))
    finally:
        view.release()
        chunk.close()
        for path in paths:
            with contextlib.suppress(OSError):
                os.remove(path)
    timings = {
        "buffered_s": min(writes[False]),
        "direct_s": min(writes[True]),
        "buffered_read_s": min(reads[False]),
        "direct_read_s": min(reads[True]),
    }
    buffered_cycle = timings["buffered_s"] + timings["buffered_read_s"]
    direct_cycle = timings["direct_s"] + timings["direct_read_s"]
    if direct_cycle <= DIRECT_MARGIN * buffered_cycle:
        return WritePathChoice(True, "direct's save and load took no longer than buffered's", **timings)
    return WritePathChoice(False, "direct's save and load took longer than buffered's", **timings)


def _timed_write(path: str, chunk: memoryview, direct: bool) -> float:
    """Write + fsync of ``PROBE_BYTES`` as a save writes them: direct, or buffered with
    writeback started every window (as :class:`~.write_behind.WriteBehindFile` does)."""
    start = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (O_DIRECT if direct else 0), 0o644)
    try:
        started = 0
        for index in range(PROBE_BYTES // chunk.nbytes):
            os.pwrite(fd, chunk, index * chunk.nbytes)
            written = (index + 1) * chunk.nbytes
            if not direct and written - started >= WRITE_BEHIND_WINDOW:
                start_writeback(fd, started, written - started)
                started = written
        os.fsync(fd)
    finally:
        os.close(fd)
    return time.perf_counter() - start


def _timed_read(path: str, chunk: memoryview) -> float:
    """The file read once through the page cache, as a load right after the save reads it."""
    start = time.perf_counter()
    fd = os.open(path, os.O_RDONLY)
    try:
        for index in range(PROBE_BYTES // chunk.nbytes):
            os.preadv(fd, [chunk], index * chunk.nbytes)
    finally:
        os.close(fd)
    return time.perf_counter() - start
