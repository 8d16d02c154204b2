"""Checkpoint errors. All are ordinary Exceptions (torch's CheckpointException is a BaseException
that ``except Exception`` misses: dmuon's own rounds, ``transport.py``, raise these instead)."""

from __future__ import annotations

__all__ = [
    "CheckpointCorruptError",
    "CheckpointError",
    "CheckpointExistsError",
    "CheckpointIncompleteError",
    "CheckpointMismatchError",
    "CheckpointNotFoundError",
    "NoLoadableCheckpointError",
    "PlanCacheError",
    "SaveRefusedError",
    "StorageError",
    "UnsafeCheckpointError",
]


class CheckpointError(RuntimeError):
    """A save or load failed; the message names the rank, key or file at fault. Raised on
    every rank for a failure of some (``transport.py``): ``ranks`` are the ranks that failed,
    ``phase`` the round they failed in."""

    ranks: tuple[int, ...] = ()
    phase: str = ""
    #: raised alike on every rank by a round of the transport: a rank's next round does not
    #: report it again (``transport.Attempt`` lets it through)
    everywhere: bool = False


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    pass


class CheckpointIncompleteError(CheckpointError):
    """No ``.metadata``: the save that wrote these files never committed."""


class CheckpointCorruptError(CheckpointError):
    """A checksum, size or structural check failed; names the file."""


class CheckpointExistsError(CheckpointError, FileExistsError):
    """A committed checkpoint is already there and overwrite was not requested."""


class StorageError(CheckpointError, OSError):
    """The storage failed (after retries on object stores); says what was being done, where."""


class UnsafeCheckpointError(CheckpointCorruptError):
    """The checkpoint asks for something a checkpoint must never do (code, paths outside it)."""


class PlanCacheError(CheckpointError):
    """The ranks' save-plan caches saw different saves; raised while planning, nothing written."""


class _ProblemListError(CheckpointError, ValueError):
    """One error for every problem found, listed one per line under a headline."""

    headline = "{count} problem(s)"

    def __init__(self, problems: list[str] | str) -> None:
        if isinstance(problems, str):  # re-raised with a rank prefix by the API
            self.problems = [problems]
            super().__init__(problems)
            return
        self.problems = problems
        super().__init__(self.headline.format(count=len(problems)) + ":\n  " + "\n  ".join(problems))


class CheckpointMismatchError(_ProblemListError):
    """The checkpoint does not fit the state dict being loaded; nothing was written."""

    headline = "checkpoint does not match the model/optimizer ({count} problem(s)); nothing was loaded"


class SaveRefusedError(_ProblemListError):
    """The state dict cannot be saved as given (a dedicated tensor is missing or has the wrong
    shape); raised while planning, so nothing was written and nothing committed."""

    headline = "refusing to save ({count} problem(s)); nothing was written"


class NoLoadableCheckpointError(_ProblemListError):
    """Committed checkpoints exist and none of them loads; one line per checkpoint and its error.

    Raised instead of resuming from nothing: a job that cannot read its own checkpoints must
    stop and say so, not train from scratch over them."""

    headline = "none of the {count} committed checkpoint(s) could be loaded; refusing to start over"
