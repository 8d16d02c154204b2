"""How the ranks of one save coordinate: the full rounds for a new layout, almost none after.

torch's ``dcp.save`` gathers every rank's local plan on the coordinator and scatters the final
plans back, then gathers every rank's write results and broadcasts the whole ``.metadata`` to
every rank. What goes through the coordinator grows with ranks x items, at every save. A
training job saves the same layout again and again, and after the first save its ranks already
know everything those rounds would tell them. :func:`run_save` drives dmuon's planner and writer
itself and, when every rank's :class:`~.plan_cache.SavePlanCache` holds the previous save's plans
and this save's plan equals them (a *steady* save), coordinates with two all-reduces of a few
integers and one of one:

1. all-reduce (``_Planned``, five numbers): did any rank fail to plan; does any rank's plan
   differ from its cached one (or its file's name would: another key-prefix setting; or, on the
   coordinator, the previous commit's files are in the target directory: the same checkpoint
   saved again); do all ranks hold the same cache token (its maximum and minimum); and the
   coordinator's new save id (the other ranks offer -1);
2. each rank writes its data file under the name it had in the previous save (the id of the
   first save of the layout in it: files of one layout in different directories share names),
   its checksums in the file's trailer, which names this save's id (``format/file_sums.py``):
   nothing of them travels;
3. all-reduce (``_Wrote``, two numbers): did any rank fail to write, or write items at offsets
   and sizes other than its previous save's (an object entry that grew);
4. the coordinator commits (``commit.py``): the previous commit's ``.metadata`` bytes as they
   are (the same names, and no URL or save id in them: ``plan_cache.Committed``) and a
   manifest of this save's id and the same file sizes; then one all-reduce of one integer: did
   the commit fail. No pickle is built, read or edited.

Where a rank wrote a different layout, step 4 gathers the write results (items and file sizes,
no checksums) instead. A first save, or one whose plan changed, runs the full rounds: gather the
plans (a rank whose plan did not change sends a marker), scatter the final plans, gather the
results, all-reduce the outcome. Only the coordinator ever holds the metadata.

The commit protocol does not change: ``.metadata`` is written after every rank reported its
bytes durable (the writer's file is closed, and fsynced on a local disk, before its rank takes
part in step 3). A failure on any rank, at any step, is raised on every rank as one dmuon error
naming every failed rank and its problem (gathered on that path only: ``transport.py``), and
nothing is committed. The rounds run over a :class:`~.transport.Transport`: torch's process
group in a job, N simulated ranks in the scale simulator (``benchmarks/scale/scale_sim.py``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from torch.distributed.checkpoint.planner import SavePlan
from torch.distributed.checkpoint.storage import WriteResult

from .plan_cache import Committed, SavePlanCache, Written, WrittenFile
from .save_planner import DMuonSavePlanner
from .transport import Attempt, Transport, same
from .writer import FILE_STATS_KEY, DMuonStorageWriter, new_save_id, plan_storage_data, split_write_results

__all__ = ["run_save"]


def _written(results: list[WriteResult], key_prefixes: int) -> Written:
    """What this rank's write results say it wrote, as the next save compares it."""
    items, file = [], None
    for result in results:
        if result.index.fqn.startswith(FILE_STATS_KEY):
            name, stats = result.storage_data
            file = WrittenFile(name, stats.size, stats.sums_at)
        else:
            info = result.storage_data
            items.append((result.index, info.offset, info.length))
    return Written(tuple(items), file, key_prefixes)


@dataclass(frozen=True)
class _Planned:
    """The first round of a save: does any rank's plan differ from its cached one; the cache
    token every rank holds (None: not all the same); the coordinator's new save id (the other
    ranks offer -1)."""

    changed: bool = False
    token: int | None = same()
    save_id: int = -1


@dataclass(frozen=True)
class _Wrote:
    """The second round of a steady save: did any rank write another layout than before."""

    changed: bool = False


def run_save(state: dict, writer: DMuonStorageWriter, planner: DMuonSavePlanner, transport: Transport) -> None:
    """Collective over ``transport``: save ``state`` with dmuon's planner and writer (module
    docstring)."""
    cache = planner.plan_cache
    local: SavePlan | None = None
    steady = False
    with Attempt() as planning:
        planner.set_up_planner(state, storage_meta=writer.storage_meta(), is_coordinator=transport.coordinator)
        writer.set_up_storage_writer(transport.coordinator, rank=transport.rank, use_collectives=True)
        local = writer.prepare_local_plan(planner.create_local_plan())
        steady = cache is not None and _steady_here(cache, local, writer, transport.coordinator)
    offer = _Planned(
        changed=not steady,
        token=cache.token_number() if cache is not None else -1,
        save_id=int(new_save_id(), 16) if transport.coordinator else -1,
    )
    planned = transport.reduce(offer, planning, "planning")
    if not planned.changed and planned.token is not None:
        assert cache is not None
        _steady_save(transport, writer, planner, cache, f"{planned.save_id:016x}")
    else:
        assert local is not None
        _full_save(transport, writer, planner, local)


def _steady_here(cache: SavePlanCache, local: SavePlan, writer: DMuonStorageWriter, coordinator: bool) -> bool:
    """Can this rank save ``local`` without a gather: its plan is the cached one, its file
    keeps its name (the same key-prefix setting), and (the coordinator) the previous commit's
    data files are not in the target directory (saving the same directory again: new names)."""
    written = cache.written
    if not cache.reuses_all(local) or written is None or written.key_prefixes != writer.key_prefixes:
        return False
    return not coordinator or cache.can_commit_again(writer.existing)


def _steady_save(
    transport: Transport, writer: DMuonStorageWriter, planner: DMuonSavePlanner, cache: SavePlanCache, save_id: str
) -> None:
    results: list[WriteResult] = []
    assert cache.written is not None
    file = cache.written.file
    with Attempt() as writing:
        named = plan_storage_data(transport.rank, save_id, writer.key_prefixes, file.name if file else None)
        results = writer.write_data(planner.finish_plan(cache.reused_final(named)), planner).wait()
    same_layout = writing.error is None and _written(results, writer.key_prefixes) == cache.written
    if transport.reduce(_Wrote(changed=not same_layout), writing, "writing").changed:
        # the coordinator learns the new layout; the plans stand
        cached = cache.metadata
        assert cached is not None or not transport.coordinator
        _commit_gathered(transport, writer, cache, results, lambda: dataclasses.replace(cached))  # type: ignore[type-var]
        return
    with Attempt() as committing:
        if transport.coordinator:  # the previous commit's bytes and files, under this save's id
            committed = cache.reused_commit()
            writer.commit_bytes(committed.metadata_bytes, committed.files, committed.index)
    transport.settle(committing, "committing")


def _full_save(transport: Transport, writer: DMuonStorageWriter, planner: DMuonSavePlanner, local: SavePlan) -> None:
    metadata = None

    def decide(plans: list[SavePlan]) -> list[SavePlan]:
        nonlocal metadata
        global_plans, metadata = planner.create_global_plan(plans)
        return writer.prepare_global_plan(global_plans)

    received = transport.gather_scatter(local, decide, "planning")
    results: list[WriteResult] = []
    with Attempt() as writing:
        results = writer.write_data(planner.finish_plan(received), planner).wait()
    _commit_gathered(transport, writer, planner.plan_cache, results, lambda: metadata, writing)


def _commit_gathered(
    transport: Transport,
    writer: DMuonStorageWriter,
    cache: SavePlanCache | None,
    results: list[WriteResult],
    metadata_of,
    writing: Attempt | None = None,
) -> None:
    """Gather every rank's write results (None from a rank whose write failed); the
    coordinator commits; every rank learns the outcome."""
    failed = writing is not None and writing.error is not None
    everyone = transport.gather(None if failed else results)
    with Attempt() as committing:
        # (a rank whose write failed says why in the outcome's round)
        if transport.coordinator and not failed and everyone is not None and None not in everyone:
            storage_data, files = split_write_results(r for rank_results in everyone for r in rank_results)
            data, index = writer.commit_save(metadata_of(), storage_data, files)
            if cache is not None:
                cache.remember_commit(Committed(data, files, index))
    transport.settle(writing if failed else committing, "writing and committing")
    if cache is not None:
        cache.remember_written(_written(results, writer.key_prefixes))
