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
   differ from its cached one; do all ranks hold the same cache token (its maximum and
   minimum); and the coordinator's new save id (the other ranks offer -1);
2. each rank writes its data file under the new id's name, its checksums in the file's trailer
   (``format/file_sums.py``): nothing of them travels;
3. all-reduce (``_Wrote``, two numbers): did any rank fail to write, or write items at offsets and sizes other than its
   previous save's (an object entry that grew);
4. the coordinator commits (``commit.py``): the cached ``.metadata`` with the new file names and
   a manifest of file sizes; then one all-reduce of one integer: did the commit fail.

Where a rank wrote a different layout, step 4 gathers the write results (items and file sizes,
no checksums) instead. A first save, or one whose plan changed, runs the full rounds: gather the
plans (a rank whose plan did not change sends a marker), scatter the final plans, gather the
results, all-reduce the outcome. Only the coordinator ever holds the metadata.

The commit protocol does not change: ``.metadata`` is written after every rank reported its
bytes durable (the writer's file is closed, and fsynced on a local disk, before its rank takes
part in step 3). A failure on any rank, at any step, is raised on every rank as one dmuon error
naming every failed rank and its problem (gathered on that path only: ``transport.py``), and
nothing is committed. The rounds run over a :class:`~.transport.Transport`: torch's process
group in a job, N simulated ranks in the scale simulator (``benchmarks/scale_sim.py``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from torch.distributed.checkpoint.planner import SavePlan
from torch.distributed.checkpoint.storage import WriteResult

from .. import compat
from .format.layout import data_file_name
from .format.manifest import FileStats
from .plan_cache import SavePlanCache
from .save_planner import DMuonSavePlanner
from .transport import Attempt, Transport, same
from .writer import FILE_STATS_KEY, DMuonStorageWriter, new_save_id, plan_storage_data, split_write_results

__all__ = ["run_save"]

#: what one rank wrote, as the next save compares it: its items ``(index, offset, length)`` and
#: its data file's ``(size, trailer offset)`` (None: it wrote no file)
Written = tuple[tuple, tuple[int, int | None] | None]


def _written(results: list[WriteResult]) -> Written:
    items, file = [], None
    for result in results:
        if result.index.fqn.startswith(FILE_STATS_KEY):
            stats: FileStats = result.storage_data[1]
            file = (stats.size, stats.sums_at)
        else:
            info = result.storage_data
            items.append((result.index, info.offset, info.length))
    return tuple(items), file


def _renamed(rank_files: list[Written], save_id: str, key_prefixes: int) -> tuple[dict, dict[str, FileStats]]:
    """Where each item of the cached layout lies in the files of save ``save_id``."""
    storage_data: dict = {}
    files: dict[str, FileStats] = {}
    for rank, (items, file) in enumerate(rank_files):
        if file is None:
            continue
        name = data_file_name(rank, save_id, key_prefixes)
        files[name] = FileStats(file[0], None, sums_at=file[1])
        for index, offset, length in items:
            storage_data[index] = compat.StorageInfo(name, offset, length)
    return storage_data, files


def _renamed_files(rank_files: list[Written], save_id: str, key_prefixes: int) -> dict[str, FileStats]:
    """The data files of the cached layout under save ``save_id``'s names (no items)."""
    return {
        data_file_name(rank, save_id, key_prefixes): FileStats(file[0], None, sums_at=file[1])
        for rank, (_, file) in enumerate(rank_files)
        if file is not None
    }


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
        steady = cache is not None and cache.reuses_all(local)
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


def _steady_save(
    transport: Transport, writer: DMuonStorageWriter, planner: DMuonSavePlanner, cache: SavePlanCache, save_id: str
) -> None:
    results: list[WriteResult] = []
    with Attempt() as writing:
        named = plan_storage_data(transport.rank, save_id, writer.key_prefixes)
        results = writer.write_data(planner.finish_plan(cache.reused_final(named)), planner).wait()
    same_layout = writing.error is None and _written(results) == cache.written
    if transport.reduce(_Wrote(changed=not same_layout), writing, "writing").changed:
        # the coordinator learns the new layout; the plans stand
        cached = cache.metadata
        assert cached is not None or not transport.coordinator
        _commit_gathered(transport, writer, cache, results, lambda: dataclasses.replace(cached))  # type: ignore[type-var]
        return
    with Attempt() as committing:
        if transport.coordinator:
            _commit_reused(writer, cache, save_id)
    transport.settle(committing, "committing")


def _commit_reused(writer: DMuonStorageWriter, cache: SavePlanCache, save_id: str) -> None:
    """Coordinator: commit the cached layout under save ``save_id``'s file names."""
    metadata, rank_files = cache.reused_commit()
    files = _files_renamed(cache, save_id, writer.key_prefixes)
    if files is None:
        files = _renamed_files(rank_files, save_id, writer.key_prefixes)
    url = _url(writer)
    data = _repickled(cache.pickled, save_id, url, len(files))
    if data is not None:
        writer.commit_bytes(data, files)
    else:
        storage_data, _ = _renamed(rank_files, save_id, writer.key_prefixes)
        data = writer.commit_save(metadata, storage_data, files)
    cache.remember_commit(data, save_id, url, files, writer.key_prefixes)


def _files_renamed(cache: SavePlanCache, save_id: str, key_prefixes: int) -> dict[str, FileStats] | None:
    """The previous save's data files under this save's names (the id in each name replaced),
    or None where they were named otherwise (another key-prefix setting)."""
    if cache.pickled is None or cache.last_files is None or cache.last_files[1] != key_prefixes:
        return None
    old_id = cache.pickled[1]
    files = {name.replace(old_id, save_id): stats for name, stats in cache.last_files[0].items()}
    return files if len(files) == len(cache.last_files[0]) else None


def _url(writer: DMuonStorageWriter) -> str:
    meta = writer.storage_meta()
    return str(meta.checkpoint_id) if meta is not None else ""


def _repickled(pickled: tuple[bytes, str, str] | None, save_id: str, url: str, files: int) -> bytes | None:
    """The previous save's ``.metadata`` bytes with this save's id and URL in place of its own,
    or None where that is not certain to be the pickle of this save's metadata.

    The cached layout's metadata differs from the previous save's only in those two strings:
    the id inside each data file's name and in ``storage_meta``, the URL in ``storage_meta``.
    Pickle writes each string once (later uses are memo references), with its length before
    it, so replacing each by one of the same length, where they occur exactly that often (each
    file name once, the id once more, the URL once), gives a valid pickle of the renamed
    metadata without pickling it again: the bulk of the coordinator's work in a steady save
    at thousands of ranks (docs/performance.md, "Scale, simulated"). Any doubt: None, and the
    metadata is pickled."""
    if pickled is None:
        return None
    data, old_id, old_url = pickled
    old_id_bytes, new_id_bytes = old_id.encode(), save_id.encode()
    old_url_bytes, new_url_bytes = old_url.encode(), url.encode()
    if len(old_id_bytes) != len(new_id_bytes) or len(old_url_bytes) != len(new_url_bytes):
        return None
    if data.count(old_id_bytes) != files + 1 or old_id_bytes in old_url_bytes or new_id_bytes in new_url_bytes:
        return None
    renamed = data.replace(old_id_bytes, new_id_bytes)
    if old_url_bytes != new_url_bytes:
        if not old_url_bytes or renamed.count(old_url_bytes) != 1:
            return None
        renamed = renamed.replace(old_url_bytes, new_url_bytes)
    return renamed


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
            data = writer.commit_save(metadata_of(), storage_data, files)
            if cache is not None:
                cache.remember_rank_files([_written(rank_results) for rank_results in everyone])
                cache.remember_commit(data, writer.save_id or "", _url(writer), files, writer.key_prefixes)
    transport.settle(writing if failed else committing, "writing and committing")
    if cache is not None:
        cache.remember_written(_written(results))
