"""Two checkpoint tiers: fast node-local saves replicated to a peer node, rare persistent ones.

A large job's failures cost most at the restart: reading every rank's share back from object
storage, and the steps since the last persistent checkpoint. :class:`TieredCheckpointManager`
keeps frequent checkpoints on each node's own disk (NVMe, ``/dev/shm``), copies each node's
files to the next node in the background (nodes do not share disks: the bytes go over the
job's own network, on a gloo group), and copies a step to the persistent tier (S3, GCS, a
shared filesystem: any dmuon URL) every so often, in the background as well, from the
committed local files (no second serialisation; the local save's checksums). A restore takes
the newest step complete anywhere. A preemption notice (SIGTERM) becomes a synchronous local
save at the next step boundary.

Here: when each tier is due, the local save, and the step boundary's agreement on a notice.
The rest is handed to the other modules of the package (its docstring maps them), none of
which imports this one: each can be read on its own.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from torch import nn

from ...optim.muon import Muon
from ..checkpointer import Checkpointer
from ..deprecation import renamed, renamed_argument
from ..errors import StorageError
from ..manager import CheckpointManager
from ..storage.local import LOCAL_DIRECT_IO_OPTION
from ..transport import lowest
from .background import BackgroundWork
from .local import CommitCopy, LocalTier
from .nodes import NodeLayout, TierGroups, discover_nodes
from .preemption import PreemptionWatcher
from .promotion import promote_step
from .replication import replicate_step
from .restore import LOCAL, RestoreReport, TierContext, restore
from .transfer import DEFAULT_CHUNK_BYTES

__all__ = ["PreemptionReport", "TieredCheckpointManager"]

log = logging.getLogger(__name__)


@dataclass
class PreemptionReport:
    """What the step boundary after a preemption notice did: the same on every rank, the
    message included (the times in it are agreed by all ranks)."""

    step: int
    saved: bool  # step ``step`` is committed in the local tier
    replicated: bool  # ... and its replication to the next node (and anything before it) finished
    seconds_left: float  # before the deadline, when the boundary was reached (inf: no deadline)
    message: str


class TieredCheckpointManager:
    """Checkpoints in a node-local tier every ``local_every`` steps and a persistent tier
    every ``persistent_every`` steps, each with its own retention; restore from the newest
    step complete in either; save on preemption. Collective: every rank creates it, in the
    same order as its other process groups, and calls every method.

    ``local_root``: this node's directory (a local path; each node passes its own, and the
    same one again after a restart on that machine). ``persistent_root``: any dmuon URL, the
    same on every rank; None for a local tier only. ``storage_options``: for the persistent
    tier. ``keep`` / ``persistent_keep``: committed steps kept in each (the local count
    applies to the node's own steps and to each peer's replicas). ``replicate``: copy each
    node's files to the next node (ignored on one node). ``node_rank``: this rank's node
    (default: torchrun's ``GROUP_RANK``, else ranks on one host are one node).
    ``preemption_signals``: the signals taken as a preemption notice; ``()`` for none (a notice
    then comes only from ``manager.preemption.notify()``, say from a thread polling the cloud's
    metadata server); None turns preemption off, and with it the one small collective that
    :meth:`step` runs at every step boundary.
    ``preemption_deadline_s``: seconds after the notice by which the preemption save must be
    committed; a save that the last local save's duration says cannot make it is not started
    (and says so), so the previous checkpoint stays the newest, intact.
    """

    def __init__(
        self,
        local_root: str | os.PathLike,
        persistent_root: str | os.PathLike | None = None,
        *,
        local_every: int = 1,
        persistent_every: int | None = None,
        keep: int = 2,
        persistent_keep: int = 3,
        storage_options: dict | None = None,
        replicate: bool = True,
        node_rank: int | None = None,
        preemption_signals: Iterable[int] | None = (signal.SIGTERM,),
        preemption_deadline_s: float | None = None,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        local_keep: int | None = None,
    ) -> None:
        keep = renamed_argument("TieredCheckpointManager", "local_keep", local_keep, "keep", keep)
        if local_every < 1:
            raise ValueError(f"local_every must be >= 1, got {local_every}")
        if persistent_every is not None and persistent_every < 1:
            raise ValueError(f"persistent_every must be >= 1 (or None), got {persistent_every}")
        if persistent_every is not None and persistent_root is None:
            raise ValueError("persistent_every needs a persistent_root")
        if keep < 1 or persistent_keep < 1:
            raise ValueError(f"keep and persistent_keep must be >= 1, got {keep}, {persistent_keep}")
        self.local = LocalTier(local_root)
        self.persistent = (
            CheckpointManager(persistent_root, keep=persistent_keep, storage_options=storage_options)
            if persistent_root is not None
            else None
        )
        self.local_every = local_every
        self.persistent_every = persistent_every
        self.keep = keep
        self.replicate = replicate
        self.chunk_bytes = chunk_bytes
        self.preemption_deadline_s = preemption_deadline_s
        self.groups = TierGroups()
        self.layout: NodeLayout = discover_nodes(self.groups, node_rank)
        self.background = BackgroundWork("dmuon-tiers")
        self.preemption = PreemptionWatcher(preemption_signals) if preemption_signals is not None else None
        # The local saves (and what they keep: the save plans). Buffered: this copy exists to be
        # restored on this node, which then reads it from memory (storage/write_path.py).
        self.checkpointer = Checkpointer(storage_options={LOCAL_DIRECT_IO_OPTION: False})
        self.last_extra: dict = {}  # what the restored checkpoint carried in ``extra``
        self.last_restore: RestoreReport | None = None
        self.last_preemption: PreemptionReport | None = None
        self.last_saved_step: int | None = None  # newest step in the local tier from this manager
        self.last_save_seconds: float | None = None  # blocking time of the last local save
        self.background_seconds: dict[str, float] = {}  # wall time of the last replication / promotion

    # -- the training loop ----------------------------------------------------------------------
    def step(self, step: int, model: nn.Module, optimizer: Muon | None, extra: dict | None = None) -> bool:
        """Call at every step boundary (after ``optimizer.step()``, ``step`` = steps done) on every
        rank. Saves what is due; True when a preemption notice came: step ``step`` is saved
        (see :attr:`last_preemption`) and the job should exit now. A failure of earlier
        background work is raised here, except after a notice: the save comes first, and
        :meth:`close` raises it."""
        if self.preemption is not None and self._preempted(step, model, optimizer, extra):
            return True
        self.background.raise_failure()
        if step != self.last_saved_step and (self._due(step, self.local_every) or self._due_persistent(step)):
            self.save(step, model, optimizer, extra)
        return False

    def save(
        self,
        step: int,
        model: nn.Module,
        optimizer: Muon | None,
        extra: dict | None = None,
        *,
        persistent: bool | None = None,
    ) -> None:
        """Collective: save ``step`` to the local tier now (blocking for the save only); then,
        in the background, replicate it to the next node and (``persistent``, default: when
        ``persistent_every`` says so) copy it to the persistent tier. Work from the previous
        save is finished first, and its error raised."""
        promote = self._due_persistent(step) if persistent is None else persistent
        if promote and self.persistent is None:
            raise ValueError("persistent=True needs a persistent_root")
        self.background.wait()
        self.background.raise_failure()
        copy = self._save_local(step, model, optimizer, extra)
        self._in_background(step, copy, promote)

    def restore(self, model: nn.Module, optimizer: Muon | None) -> int | None:
        """Deprecated name of :meth:`resume`."""
        renamed("TieredCheckpointManager.restore()", "TieredCheckpointManager.resume()")
        return self.resume(model, optimizer)

    def resume(self, model: nn.Module, optimizer: Muon | None, *, cast_dtypes: bool = False) -> int | None:
        """Collective: load the newest step that is complete in some tier (own files, a peer's
        replica, the persistent tier; every rank agreeing on one); returns it, or None when no
        tier holds a checkpoint. :attr:`last_restore` says where it came from. ``cast_dtypes``:
        as for :meth:`Checkpointer.load <dmuon.dcp.Checkpointer.load>`."""
        self.background.wait()
        self.background.raise_failure()
        context = TierContext(self.groups, self.layout, self.local, self.persistent, self.chunk_bytes, cast_dtypes)
        report, self.last_extra = restore(context, model, optimizer)
        self.last_restore = report
        if report.source == LOCAL:
            self.last_saved_step = report.step
        return report.step

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the background work (replication, promotion); raise its error. False if
        ``timeout`` seconds passed first."""
        finished = self.background.wait(timeout)
        self.background.raise_failure()
        return finished

    def close(self) -> None:
        """Finish the background work (raising its error) and put the signal handlers back."""
        try:
            self.background.close()
        finally:
            if self.preemption is not None:
                self.preemption.close()

    def local_steps(self) -> list[int]:
        """Steps this node's own local directory has the commit of."""
        return self.local.committed_steps()

    # -- inside -------------------------------------------------------------------------------
    @staticmethod
    def _due(step: int, every: int | None) -> bool:
        return every is not None and step % every == 0

    def _due_persistent(self, step: int) -> bool:
        return self.persistent is not None and self._due(step, self.persistent_every)

    def _save_local(self, step: int, model: nn.Module, optimizer: Muon | None, extra: dict | None) -> CommitCopy:
        """Every rank writes its share into its node's ``step-<N>``; the commit (rank 0's node)
        is then copied beside the data files on every other node."""
        started = time.monotonic()
        path = self.local.step_dir(step)
        if self.layout.is_leader:
            self.local.prepare_step_dir(step)
        self.groups.control.barrier()
        os.makedirs(path, exist_ok=True)
        self.checkpointer.save(model, optimizer, path, extra=extra, overwrite=True)
        copy = self.groups.control.decided(
            lambda: self.local.read_commit_copy(path),
            0,
            f"{path}: step {step} committed, but its commit cannot be read back",
            StorageError,
        )
        if self.layout.is_leader and self.layout.node != self.layout.node_of_rank[0]:
            LocalTier.write_commit_copy(path, copy)
        self.last_saved_step = step
        self.last_save_seconds = time.monotonic() - started
        return copy

    def _in_background(self, step: int, copy: CommitCopy, promote: bool) -> None:
        what = [] if len(self.layout.nodes) < 2 or not self.replicate else ["replication to the next node"]
        if promote:
            what.append(f"copy to {self.persistent.root if self.persistent else None}")

        def timed(name: str, work: Callable[[], object], errors: list[Exception]) -> bool:
            started = time.monotonic()
            try:
                work()
            except StorageError as exc:  # raised on every rank alike (the work gathers problems)
                errors.append(exc)
                return False
            self.background_seconds[name] = time.monotonic() - started
            return True

        def job() -> None:
            errors: list[Exception] = []
            replicated = True
            if self.replicate and len(self.layout.nodes) > 1:
                replicated = timed(
                    "replication",
                    lambda: replicate_step(self.groups, self.layout, self.local, step, copy, self.chunk_bytes),
                    errors,
                )
            if promote and self.persistent is not None:
                persistent = self.persistent
                timed(
                    "promotion",
                    lambda: promote_step(self.groups, self.layout, self.local, step, copy, persistent),
                    errors,
                )
            if replicated and self.layout.is_leader:  # older steps go only once this one is safe
                try:
                    self.local.retain(self.keep, upto=step)
                except OSError as exc:
                    log.warning("local retention under %s: %s", self.local.root, exc)
            if errors:
                raise errors[0] if len(errors) == 1 else StorageError("; ".join(str(e) for e in errors))

        self.background.submit(f"{self.local.step_dir(step)} ({', '.join(what) or 'retention'})", job)

    def _preempted(self, step: int, model: nn.Module, optimizer: Muon | None, extra: dict | None) -> bool:
        """The one collective of every step boundary: did any rank get a notice? If so, save."""
        assert self.preemption is not None
        boundary = time.monotonic()
        left = math.inf
        if self.preemption.requested and self.preemption_deadline_s is not None:
            left = self.preemption_deadline_s - self.preemption.seconds_since()
        notice = self.groups.control.reduce(
            _Notice(self.preemption.requested, left, self.last_save_seconds or 0.0), None, "the step boundary"
        )
        if not notice.requested:
            return False
        left, estimate = notice.left, notice.last_save_seconds
        previous = self.last_saved_step
        took = None
        if step == self.last_saved_step:
            saved, how = True, f"step {step} was already saved"
        elif estimate > left:
            saved = False
            how = (
                f"step {step} NOT saved: the last local save took {estimate:.1f} s, more than the time left; "
                f"the newest checkpoint, step {previous}, is intact"
            )
        else:
            self._in_background(step, self._save_local(step, model, optimizer, extra), promote=False)
            saved, took = True, self.last_save_seconds
        spent = time.monotonic() - boundary
        replicated = self.background.wait(None if math.isinf(left) else max(0.0, left - spent))
        # every rank reports the same: the slowest rank's save, replicated only where all are
        outcome = self.groups.control.reduce(_Saved(took or 0.0, not replicated), None, "the preemption save")
        slowest, replicated = outcome.slowest, not outcome.not_replicated
        if took is not None:
            how = f"step {step} saved to the local tier in {slowest:.1f} s"
        if saved and len(self.layout.nodes) > 1 and self.replicate:
            how += "; replicated to the next node" if replicated else "; its replication did not finish in time"
        message = f"preemption notice at step {step}{_time_left(left)}: {how}"
        if self.groups.rank == 0:
            print(f"dmuon: {message}", file=sys.stderr, flush=True)
        self.last_preemption = PreemptionReport(step, saved, replicated, left, message)
        return True


@dataclass(frozen=True)
class _Notice:
    """The step boundary's one round: did any rank get a preemption notice; the least time left
    before any rank's deadline; the slowest rank's last local save (the estimate of this one)."""

    requested: bool = False
    left: float = lowest(math.inf)
    last_save_seconds: float = 0.0


@dataclass(frozen=True)
class _Saved:
    """After a preemption save: the slowest rank's save, and whether any rank's replication did
    not finish in time (every rank then reports the same)."""

    slowest: float = 0.0
    not_replicated: bool = False


def _time_left(left: float) -> str:
    """The one figure of the time left that a preemption report gives, said once."""
    if math.isinf(left):
        return ""
    if left < 0:
        return f" (the deadline had passed {-left:.1f} s before)"
    return f" ({left:.1f} s were left before the deadline)"
