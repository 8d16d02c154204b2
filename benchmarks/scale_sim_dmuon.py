"""dmuon's own save and load protocols (``dmuon/dcp/save_protocol.py``, ``load_protocol.py``),
run in one process for N synthetic ranks, through dmuon's planners, plan caches, writer and
reader as they are in the tree.

:func:`simulate_dmuon_save` is ``run_save`` step by step for every rank in turn: the local plan
(the :class:`SavePlanCache` offering a marker when it is unchanged), the all-reduce of 5 int64
(failed, not steady, token, -token, save id); then either the steady path (each rank writes
under the new id, an all-reduce of 2 int64, the coordinator commits the cached metadata renamed:
``cache.reused_commit()``, ``save_protocol._renamed``, ``writer.commit_save``, a broadcast of the
outcome) or the full rounds (gather of plans, ``create_global_plan`` and
``prepare_global_plan``, scatter, writes, gather of write results without checksums,
``split_write_results`` and ``commit_save``, broadcast of the outcome). What each rank's write
returns is :func:`scale_sim_protocol.dmuon_results`. :func:`simulate_dmuon_load` is
``run_load``: every rank plans from the broadcast listing (``open_once``, counted by the
caller), an all-reduce of 5 int64, a gather/scatter of plans only when a plan needs the
coordinator or the reader wants a cooperative assignment, then an all-reduce of 1 int64 (and,
when a cooperative exchange happens, ``read_shared``'s all-gather of every rank's outcome).

The decisions (steady or not, gather or not) are taken from what the real code returns on each
rank; the simulator only replaces the collectives by their element-wise maximum and records
their sizes. ``scale_sim_real.py`` checks the recorded calls against real gloo ranks.
"""

from __future__ import annotations

import pickle
import time
from collections.abc import Callable
from typing import Any

from scale_sim_protocol import Phase, SimulatedWorld, SimulatorGap, Timer, dmuon_results
from scale_sim_state import Call, pickled_size

from dmuon.dcp import save_protocol
from dmuon.dcp.cooperative import share_of
from dmuon.dcp.plan_cache import Committed
from dmuon.dcp.writer import new_save_id, plan_storage_data, split_write_results

SAVE_AGREE, WRITE_AGREE, OUTCOME_AGREE, LOAD_AGREE, READ_AGREE = 5, 2, 1, 5, 1  # int64 per all-reduce


def _prefixes(writer) -> tuple:
    """The writer's key-prefix setting where the tree's writer has one (data files' names spread
    over leading hex prefixes), passed on as ``save_protocol`` passes it."""
    return (writer.key_prefixes,) if hasattr(writer, "key_prefixes") else ()


def _all_reduce(phase: Phase, count: int) -> None:
    phase.calls.append(Call("all_reduce", [8 * count]))


def simulate_dmuon_save(world: SimulatedWorld, planner: Callable[[int], Any], writer: Callable[[int], Any],
                        state: Callable[[int], dict], caches: list) -> tuple[Phase, str]:
    """One ``run_save`` by every rank; returns the phase and which path it took."""
    phase, n = Phase(), world.world
    clock = Timer(phase)
    world.calls = []
    planners, writers, local = [], [], []
    steady_everywhere, tokens = True, set()
    for rank in range(n):  # planning on every rank
        world.rank = rank
        p, w = planner(rank), writer(rank)
        p.set_up_planner(state(rank), storage_meta=w.storage_meta(), is_coordinator=rank == 0)
        w.set_up_storage_writer(rank == 0, rank=rank, use_collectives=True)
        plan = w.prepare_local_plan(p.create_local_plan())
        cache = caches[rank]
        steady_everywhere &= cache.reuses_all(plan)
        tokens.add(cache.token_number())
        local.append(plan)
        planners.append(p)
        writers.append(w)
    world.rank = 0
    save_id = f"{int(new_save_id(), 16):016x}"  # the coordinator's offer wins the maximum
    _all_reduce(phase, SAVE_AGREE)
    if steady_everywhere and len(tokens) == 1:
        _steady(world, phase, clock, planners, writers, caches, save_id)
        path = "steady"
    else:
        _full(world, phase, clock, planners, writers, caches, local)
        path = "full"
    phase.calls += world.calls
    return phase, path


def _steady(world, phase, clock, planners, writers, caches, save_id: str) -> None:
    for rank in range(world.world):  # each rank writes under the new id
        world.rank = rank
        file = caches[rank].written.file
        named = plan_storage_data(rank, save_id, *_prefixes(writers[rank]), file.name if file else None)
        final = planners[rank].finish_plan(caches[rank].reused_final(named))
        writers[rank].save_id = save_id  # (write_data takes it from the plan)
        if save_protocol._written(dmuon_results(rank, final), *_prefixes(writers[rank])) != caches[rank].written:
            raise SimulatorGap(f"rank {rank} wrote another layout in a steady save: the simulator "
                               "models the gathered commit of that case only in the full rounds")
    world.rank = 0
    _all_reduce(phase, WRITE_AGREE)
    with clock.coordinator():
        committed = caches[0].reused_commit()
        writers[0].commit_bytes(committed.metadata_bytes, committed.files)
    _all_reduce(phase, OUTCOME_AGREE)


def _full(world, phase, clock, planners, writers, caches, local) -> None:
    n = world.world
    blobs = [pickle.dumps(plan) for plan in local]
    local.clear()
    phase.calls.append(Call("gather", [len(b) for b in blobs]))
    world.rank = 0
    with clock.coordinator():
        gathered = [pickle.loads(b) for b in blobs]
        global_plans, metadata = planners[0].create_global_plan(gathered)
        outgoing = [pickle.dumps((None, plan)) for plan in writers[0].prepare_global_plan(global_plans)]
    del blobs, gathered, global_plans
    phase.calls.append(Call("scatter", [len(b) for b in outgoing]))
    results, written = [], []
    for rank in range(n):
        world.rank = rank
        _, received = pickle.loads(outgoing[rank])
        final = planners[rank].finish_plan(received)
        writers[rank].save_id = final.storage_data["save_id"]
        mine = dmuon_results(rank, final)
        written.append(save_protocol._written(mine, *_prefixes(writers[rank])))
        results.append(pickle.dumps(mine))
    del outgoing
    world.rank = 0
    phase.calls.append(Call("gather", [len(b) for b in results]))
    with clock.coordinator():
        everyone = [pickle.loads(b) for b in results]
        storage_data, files = split_write_results(r for rank_results in everyone for r in rank_results)
        data = writers[0].commit_save(metadata, storage_data, files)
        caches[0].remember_commit(Committed(data, files))
    _all_reduce(phase, OUTCOME_AGREE)
    for cache, mine in zip(caches, written):
        cache.remember_written(mine)


def local_load_plan(world: SimulatedWorld, rank: int, planner, reader, state: dict) -> tuple[Any, bool, bool, float]:
    """``run_load``'s planning on one rank: (plan, needs the coordinator, wants a cooperative
    assignment, CPU seconds)."""
    world.rank = rank
    start = time.process_time()
    metadata = reader.read_metadata()
    planner.set_up_planner(state, metadata, rank == 0)
    reader.set_up_storage_reader(metadata, rank == 0, rank=rank, use_collectives=True)
    plan = reader.prepare_local_plan(planner.create_local_plan())
    check = planner.needs_global_check(plan)
    wants = reader.wants_global_plan()
    if wants is None:
        raise SimulatorGap("a local-path load (the machines' hashes decide): the simulator's store is remote")
    return plan, check, wants, time.process_time() - start


def simulate_dmuon_load(world: SimulatedWorld, planner: Callable[[int], Any], reader: Callable[[int], Any],
                        state: Callable[[int], dict], sample: list[int] | None = None) -> Phase:
    """One ``run_load`` by every rank (or, ``sample``: by those ranks, the plans scaled to N)."""
    phase, n = Phase(), world.world
    clock = Timer(phase)
    ranks = range(n) if sample is None else sample
    blobs, cpu, gather = [], [], False
    coordinator = None
    for rank in ranks:
        p, r = planner(rank), reader(rank)
        plan, check, wants, seconds = local_load_plan(world, rank, p, r, state(rank))
        cpu.append(seconds)
        gather |= check or wants
        blobs.append(pickle.dumps(plan))
        if rank == 0:
            coordinator = (p, r)
    world.rank = 0
    _all_reduce(phase, LOAD_AGREE)
    exchange = False
    if gather and n > 1:
        if sample is not None:  # the coordinator's step is not run: sizes scaled, CPU not known
            mean = round(sum(map(len, blobs)) / len(blobs))
            phase.calls += [Call("gather", [mean] * n), Call("scatter", [mean] * n)]
            phase.rank0_cpu = float("nan")
            exchange = True  # (assumed: a cooperative load of shared regions, as at the N run in full)
        else:
            phase.calls.append(Call("gather", [len(b) for b in blobs]))
            with clock.coordinator():
                plans = [pickle.loads(b) for b in blobs]
                final = coordinator[1].prepare_global_plan(coordinator[0].create_global_plan(plans))
                outgoing = [pickle.dumps((None, plan)) for plan in final]
            phase.calls.append(Call("scatter", [len(b) for b in outgoing]))
            exchange = any(share_of(plan) is not None for plan in final)
    if exchange:  # read_shared: every rank agrees its reads succeeded (agreement.agree)
        phase.calls.append(Call("all_gather", [pickled_size(None)] * n))
    _all_reduce(phase, READ_AGREE)
    phase.extra.update(rank_plan_cpu_max=max(cpu), rank_plan_cpu_mean=sum(cpu) / len(cpu),
                       gathered=float(gather), sampled=float(len(cpu) if sample is not None else 0))
    return phase
