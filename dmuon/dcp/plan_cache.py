"""Reusing the plans of the previous save when nothing about the layout changed.

A training job saves the same state-dict layout again and again. DCP still has every rank
send its local plan to the coordinator, which unpickles them all, de-duplicates, validates and
sends the final plans back: work that grows with ranks x items and buys nothing when no plan
changed. With a :class:`SavePlanCache` (``DMuonSavePlanner(plan_cache=...)``), a rank whose
local plan equals the one of its previous save sends a small marker instead; the coordinator
puts its cached copy of that plan in its place and, when no rank's plan changed, reuses the
previous global plans and metadata without recomputing them (or unpickling anything big).

Why not torch's ``enable_plan_caching``: it keeps its caches in class attributes, for the life
of the process, shared by every planner of the class; it compares plans without their dtypes
(a bf16 save after an fp32 one would reuse fp32 metadata); and it reuses the previous final
plan whole, storage data included, where dmuon's writer names each save's files afresh. Here
the cache is an object the caller owns and can drop, plans are compared as whole values, and
each save keeps its own storage data.

Consistency: every cached global plan has a token; ranks learn it with their final plans and
send it back in their markers. A marker whose token is not the coordinator's (a rank's cache
and the coordinator's saw different saves: a cache dropped on one rank, a save that failed
half way) is refused before anything is written, and a rank told to reuse a final plan it does
not have refuses likewise. After a failed save, ``clear()`` the cache on every rank (dmuon's
``save``, ``CheckpointManager`` and ``AsyncCheckpointer`` do).
"""

from __future__ import annotations

import dataclasses
import uuid
from dataclasses import dataclass

from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan

from .errors import PlanCacheError
from .format.manifest import FileStats

__all__ = ["CachedSavePlan", "Committed", "SavePlanCache", "Written", "WrittenFile", "same_plan"]


@dataclass(frozen=True)
class WrittenFile:
    """A rank's data file as a save left it: its name, size and where its trailer starts."""

    name: str
    size: int
    sums_at: int | None


@dataclass(frozen=True)
class Written:
    """What one rank's save wrote, as the next save compares it: its items ``(index, offset,
    length)``, its data file (None: it wrote none), and the key-prefix setting it was named
    with."""

    items: tuple[tuple[MetadataIndex, int, int], ...]
    file: WrittenFile | None
    key_prefixes: int


@dataclass(frozen=True)
class Committed:
    """Coordinator: the last commit, as a steady save commits it again: the ``.metadata`` bytes
    (nothing in them changes from one save of the layout to the next: the data files keep their
    names, and no URL or save id is pickled) and every data file's stats."""

    metadata_bytes: bytes
    files: dict[str, FileStats]
    index: bytes | None = None  # the manifest's sharding index, as unchanged as the metadata


@dataclass(frozen=True)
class CachedSavePlan(SavePlan):
    """A save plan tagged for the cache. ``cache_token`` names the global plan it is part of;
    a marker (``usable=False``, no items) stands for the plan cached under ``reuses``. Writers
    copy plans with ``dataclasses.replace``, which keeps the tags; one that builds a plain
    ``SavePlan`` drops them, and the cache then simply misses next time."""

    cache_token: str = ""
    reuses: str = ""


def same_plan(a: SavePlan, b: SavePlan) -> bool:
    """Equal items (index, type, sizes, offsets, dtypes...) and key mappings; storage data aside."""
    return a.usable == b.usable and a.items == b.items and a.planner_data == b.planner_data


def _tagged(plan: SavePlan, token: str) -> CachedSavePlan:
    fields = {f.name: getattr(plan, f.name) for f in dataclasses.fields(SavePlan)}
    return CachedSavePlan(**fields, cache_token=token)


def _marker(reuses: str, token: str = "") -> CachedSavePlan:
    return CachedSavePlan([], usable=False, cache_token=token, reuses=reuses)


@dataclass
class SavePlanCache:
    """One rank's memory of its previous save's plans; ``clear()`` forgets them.

    ``local_hits`` counts saves whose local plan was reused; ``global_hits`` (coordinator)
    saves whose global plan and metadata were reused whole.
    """

    token: str | None = None
    local_plan: SavePlan | None = None
    final_plan: SavePlan | None = None
    # coordinator only
    all_local_plans: list[SavePlan] | None = None
    global_plans: list[SavePlan] | None = None
    metadata: Metadata | None = None
    local_hits: int = 0
    global_hits: int = 0

    #: what this rank's previous save wrote, to tell whether this save wrote the same layout
    written: Written | None = None
    #: coordinator only: the previous commit, to commit a save that wrote the same without asking
    committed: Committed | None = None

    def clear(self) -> None:
        self.token = None
        self.local_plan = self.final_plan = None
        self.all_local_plans = self.global_plans = None
        self.metadata = None
        self.written = self.committed = None

    # --- a save with no gather (save_protocol.py) ------------------------------------------------
    def token_number(self) -> int:
        """The cache token as a number the ranks can compare in an all-reduce (-1: none)."""
        return int(self.token[:15], 16) if self.token else -1

    def reuses_all(self, local: SavePlan | None) -> bool:
        """Is ``local`` (what this rank's planner offers) the marker of the cached plan, and
        does this rank hold what a save without a gather needs?"""
        return (
            local is not None
            and not local.usable
            and bool(self.token)
            and getattr(local, "reuses", "") == self.token
            and self.final_plan is not None
            and self.written is not None
        )

    def reused_final(self, storage_data) -> SavePlan:
        """What the coordinator would have sent for a save that reuses everything."""
        assert self.token is not None
        return dataclasses.replace(_marker(self.token, self.token), storage_data=storage_data)

    def remember_written(self, written: Written) -> None:
        self.written = written

    def remember_commit(self, committed: Committed) -> None:
        """Coordinator: the commit just made."""
        self.committed = committed

    def reused_commit(self) -> Committed:
        """Coordinator: the previous commit, for a save that wrote the same."""
        if self.committed is None:
            raise PlanCacheError("the coordinator's SavePlanCache holds no committed layout; clear() it on every rank")
        self.global_hits += 1
        return self.committed

    def can_commit_again(self, existing: set[str]) -> bool:
        """Coordinator: can a steady save commit the previous commit's bytes again, into a
        directory that holds the files ``existing``? Not where one of its data files is there
        (the same directory saved again: the new files would overwrite a committed save's)."""
        return self.committed is not None and existing.isdisjoint(self.committed.files)

    # --- every rank -----------------------------------------------------------------------------
    def offer_local(self, plan: SavePlan) -> SavePlan:
        """What this rank sends for ``plan``: a marker when it equals the cached one."""
        if self.token and self.local_plan is not None and same_plan(plan, self.local_plan):
            self.local_hits += 1
            return _marker(self.token)
        return plan

    def finish(self, local_plan: SavePlan, received: SavePlan) -> SavePlan:
        """This rank's final plan: ``received``, or for a marker the cached final plan with this
        save's storage data. Remembered, with the local plan it answers, for the next save."""
        token = getattr(received, "cache_token", "")
        if not received.usable:
            if self.final_plan is None or not self.token or getattr(received, "reuses", "") != self.token:
                raise PlanCacheError(
                    "the coordinator reused a cached save plan this rank does not have (the ranks' "
                    "SavePlanCache objects saw different saves); clear() them on every rank"
                )
            final = dataclasses.replace(self.final_plan, storage_data=received.storage_data)
        else:
            final = received
        self.token = token or None  # a writer that dropped the token: plan in full next time
        self.local_plan, self.final_plan = local_plan, final
        return final

    # --- coordinator ----------------------------------------------------------------------------
    def fill_in(self, sent: list[SavePlan]) -> list[SavePlan]:
        """Every rank's local plan, the cached one where a rank sent a marker."""
        if all(plan.usable for plan in sent):
            return sent
        stale = [
            rank
            for rank, plan in enumerate(sent)
            if not plan.usable and (not self.token or getattr(plan, "reuses", "") != self.token)
        ]
        if stale or self.all_local_plans is None or len(self.all_local_plans) != len(sent):
            raise PlanCacheError(
                f"ranks {stale or [r for r, p in enumerate(sent) if not p.usable]} reused save plans "
                "the coordinator's SavePlanCache does not hold (the ranks' caches saw different "
                "saves); clear() them on every rank"
            )
        return [plan if plan.usable else old for plan, old in zip(sent, self.all_local_plans)]

    def reuse_global(self, sent: list[SavePlan]) -> tuple[list[SavePlan], Metadata] | None:
        """(what to send each rank, metadata) when no rank's plan changed; else None."""
        if any(plan.usable for plan in sent) or self.token is None or self.metadata is None:
            return None
        self.global_hits += 1
        return [_marker(self.token, self.token) for _ in sent], dataclasses.replace(self.metadata)

    def remember_global(
        self, all_local: list[SavePlan], global_plans: list[SavePlan], metadata: Metadata
    ) -> list[SavePlan]:
        """Cache a new global plan under a new token; what to send each rank (a marker where
        its final plan is the one it has already, so it is not sent again)."""
        before, previous = self.global_plans, self.token or ""
        token = uuid.uuid4().hex
        olds: list[SavePlan | None] = [None] * len(global_plans)
        if previous and before is not None and len(before) == len(global_plans):
            olds = list(before)  # a rank's final plan can only be reused under the previous token
        out: list[SavePlan] = [
            _marker(previous, token) if old is not None and same_plan(new, old) else _tagged(new, token)
            for new, old in zip(global_plans, olds)
        ]
        self.token, self.all_local_plans, self.global_plans = token, all_local, global_plans
        self.metadata = dataclasses.replace(metadata)  # the writer fills in the one it is given
        return out
