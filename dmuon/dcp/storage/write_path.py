"""Direct or buffered writes for a local checkpoint directory: a rule, the same on every run.

Neither way is faster everywhere. Direct I/O (``O_DIRECT``) skips the page cache: little CPU,
a wall time set by the device, and the training job's cache left alone; but a load right after
the save on the same node (a job rolling back to its own checkpoint, the tiers' local copy)
reads the device again. Buffered writes (writeback started as they go, ``write_behind.py``)
leave the file in memory for that load, but each new page costs CPU: on this project's VM a
save of hundreds of MiB into pages the kernel had to hand out anew took 4-6x the wall of the
direct one (``benchmarks/page_first_touch.py``, ``docs/performance.md``).

dmuon used to time both ways at the first write into a filesystem and keep the faster. The
answer changed from run to run on the same machine (a load right after the save was 1.95x
torch's in one run, 0.70x in the next: issue 44), so a user could neither predict nor
reproduce what a job would do. The choice is now a rule that reads in one line each:

* the local path's ``direct_io`` storage option, when given (``True`` or ``False``), wins;
* a save written in the background (``dmuon.dcp.async_save``, an ``AsyncCheckpointer``, an
  async ``CheckpointManager``) goes direct on ext4 and XFS, whose ``O_DIRECT`` is plain;
* every other save is written buffered, on every filesystem.

Why buffered for a save the loop waits for: measured alone on this machine, 2 ranks, ratios
to torch's DCP (wall, paired medians; ``benchmarks/save_load.py``, ``docs/performance.md``),
buffered against direct: at 512 MiB, three runs, save 0.50-0.62 / 0.54-0.65, load right after
the save 0.42-0.54 / 1.47-1.65, cold 0.81-0.91 / 1.02-1.37, warm 0.36-0.49 / 0.39-0.52; at
4 GiB (the first save into fresh pages) save 0.68 / 0.81, natural 0.49 / 2.11, cold 0.88 /
1.02, warm 0.53 / 0.62. Direct saved CPU (0.30-0.34 of torch's against 0.51-0.62) and lost
wall time in every cell: for a save the loop waits for, a default that buys CPU with wall is
the wrong one.

Why direct for a save in the background: its wall time is hidden behind training, its CPU is
not. Each rank's training already keeps its cores busy, so every CPU second the writer spends
is a second the next steps lose. Measured (``benchmarks/snapshot_window.py --ns-steps 0``, 2
ranks, 64 MiB, a 0.45-0.55 s step): the writer's CPU was 150-180 ms buffered against 30-50 ms
direct, and the first step after the call took 1.37-1.86x a free step buffered against
1.13-1.16x direct. The price: a load right after such a save on the same node reads the device
instead of the page cache; ``direct_io=False`` keeps the pages (the tiers' local copy, which
exists to be read back on its node, asks for that).

Each way chosen for a filesystem is logged once per process (logger ``dmuon.dcp.storage.write_path``,
INFO); :func:`known_choices` lists what was logged and :func:`forget_choices` drops the list
(the next write logs again). Nothing is measured, so nothing differs between runs.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass

__all__ = ["DIRECT_IO_FILESYSTEMS", "WritePathChoice", "choose_write_path", "forget_choices", "known_choices"]

log = logging.getLogger(__name__)

# Filesystems on a block device whose O_DIRECT is plain (no network or cluster semantics, no
# data checksums that a buffer could race with): where direct writes are chosen for a background
# save, and where ``direct_io=True`` is known to behave (elsewhere -- tmpfs, NFS, Lustre, btrfs --
# it may be refused or slow).
DIRECT_IO_FILESYSTEMS = frozenset({"ext4", "xfs"})


@dataclass(frozen=True)
class WritePathChoice:
    """Which way streamed files go on one filesystem, and the rule that said so."""

    direct: bool
    reason: str

    def describe(self) -> str:
        return f"{'direct I/O' if self.direct else 'buffered writes'} ({self.reason})"


BUFFERED_BY_RULE = WritePathChoice(False, "the default: direct I/O only when asked, direct_io=True")
DIRECT_IN_BACKGROUND = WritePathChoice(True, "a background save on ext4/XFS: its CPU competes with training")
BUFFERED_ASKED = WritePathChoice(False, "direct_io=False")
DIRECT_ASKED = WritePathChoice(True, "direct_io=True")

# (st_dev of a filesystem, direct?) -> the choice logged for it in this process (known_choices):
# a job whose synchronous and background saves go different ways logs each way once
_logged: dict[tuple[int, bool], WritePathChoice] = {}
_lock = threading.Lock()


def known_choices() -> dict[tuple[int, bool], WritePathChoice]:
    """The choices logged so far in this process, by filesystem (``st_dev``) and way."""
    with _lock:
        return dict(_logged)


def forget_choices() -> None:
    """Drop the list of logged choices: the next write into each filesystem logs again."""
    with _lock:
        _logged.clear()


def choose_write_path(
    root: str, direct_io: bool | None, *, background: bool = False, filesystem: str = ""
) -> WritePathChoice:
    """The way for streamed files under the existing directory ``root`` (on a ``filesystem``
    of that type): the ``direct_io`` option when given; else direct for a ``background`` save
    on ext4/XFS, buffered otherwise. Logged once per filesystem and way."""
    if direct_io is None:
        if not background:
            choice = BUFFERED_BY_RULE
        elif filesystem in DIRECT_IO_FILESYSTEMS:
            choice = DIRECT_IN_BACKGROUND
        else:
            choice = WritePathChoice(
                False,
                f"a background save on {filesystem or 'an unknown filesystem'}: "
                f"direct I/O only on {'/'.join(sorted(DIRECT_IO_FILESYSTEMS))}",
            )
    else:
        choice = DIRECT_ASKED if direct_io else BUFFERED_ASKED
    note(root, choice)
    return choice


def note(root: str, choice: WritePathChoice) -> None:
    """Log ``choice`` for the filesystem of ``root`` unless it is the one already logged."""
    key = (os.stat(root).st_dev, choice.direct)
    with _lock:
        if _logged.get(key) == choice:
            return
        _logged[key] = choice
    log.info("%s: %s", root, choice.describe())
