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
* otherwise streamed data files are written buffered, on every filesystem.

Until issue 44's quiet measurements, ext4 and XFS defaulted to direct. Measured alone on this
machine, 2 ranks, ratios to torch's DCP (wall, paired medians; ``benchmarks/save_load.py``,
``docs/performance.md``), buffered against direct: at 512 MiB, three runs, save 0.50-0.62 /
0.54-0.65, load right after the save 0.42-0.54 / 1.47-1.65, cold 0.81-0.91 / 1.02-1.37, warm
0.36-0.49 / 0.39-0.52; at 4 GiB (the first save into fresh pages) save 0.68 / 0.81, natural
0.49 / 2.11, cold 0.88 / 1.02, warm 0.53 / 0.62. Direct saved CPU (0.30-0.34 of torch's against
0.51-0.62) and lost wall time in every cell: a default that buys CPU with wall is the wrong one.
``direct_io=True`` keeps it for a job that wants the page cache left alone.

Each filesystem's choice is logged once per process (logger ``dmuon.dcp.storage.write_path``,
INFO); :func:`known_choices` lists what was logged and :func:`forget_choices` drops the list
(the next write logs again). Nothing is measured, so nothing differs between runs.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass

__all__ = ["WritePathChoice", "choose_write_path", "forget_choices", "known_choices"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WritePathChoice:
    """Which way streamed files go on one filesystem, and the rule that said so."""

    direct: bool
    reason: str

    def describe(self) -> str:
        return f"{'direct I/O' if self.direct else 'buffered writes'} ({self.reason})"


BUFFERED_BY_RULE = WritePathChoice(False, "the default: direct I/O only when asked, direct_io=True")
BUFFERED_ASKED = WritePathChoice(False, "direct_io=False")
DIRECT_ASKED = WritePathChoice(True, "direct_io=True")

# st_dev of a filesystem -> the choice logged for it in this process (see known_choices)
_logged: dict[int, WritePathChoice] = {}
_lock = threading.Lock()


def known_choices() -> dict[int, WritePathChoice]:
    """The choices logged so far in this process, by filesystem (``st_dev``)."""
    with _lock:
        return dict(_logged)


def forget_choices() -> None:
    """Drop the list of logged choices: the next write into each filesystem logs again."""
    with _lock:
        _logged.clear()


def choose_write_path(root: str, direct_io: bool | None) -> WritePathChoice:
    """The way for streamed files under the existing directory ``root``: the ``direct_io``
    option when given, else buffered; logged once per filesystem and answer."""
    if direct_io is None:
        choice = BUFFERED_BY_RULE
    else:
        choice = DIRECT_ASKED if direct_io else BUFFERED_ASKED
    note(root, choice)
    return choice


def note(root: str, choice: WritePathChoice) -> None:
    """Log ``choice`` for the filesystem of ``root`` unless it is the one already logged."""
    device = os.stat(root).st_dev
    with _lock:
        if _logged.get(device) == choice:
            return
        _logged[device] = choice
    log.info("%s: %s", root, choice.describe())
