"""How the ranks of one load coordinate: a gather of plans only when something needs it.

torch's ``dcp.load`` gathers every rank's load plan on the coordinator, scatters them back, and
ends with an all-gather of every rank's result: at least one round whose bytes through the
coordinator grow with the ranks, and one that every rank pays N times over. Neither is needed
when every rank's plan stands on its own: an FSDP2 shard or a dedicated weight is read by the
rank that holds it, from the metadata every rank has (``operation.open_once``). :func:`run_load`
drives dmuon's planner and reader itself:

1. one all-reduce of a few integers: did any rank fail to plan; does any rank's plan need the
   coordinator (a problem to report with every rank's, a checkpoint key no rank may hold:
   ``DMuonLoadPlanner.needs_global_check``); does the reader want a cooperative assignment (it
   always does on object storage, and on a local path when the ranks span machines: the
   maximum and minimum of a hash of each rank's machine say so);
2. only then, the gather of plans and the scatter of final ones (cooperative restore's
   assignment, ``cooperative.py``, and the checks that name every rank's problem);
3. each rank reads its share;
4. one all-reduce: did any rank fail; if so, every rank raises every failed rank's error
   (gathered on that path only), as torch's ``CheckpointException``.
"""

from __future__ import annotations

import zlib
from typing import Any

from torch.distributed.checkpoint.planner import LoadPlan

from .load_planner import DMuonLoadPlanner
from .node_identity import this_node
from .ranks import Ranks, raise_failures, wrapped
from .reader import DMuonStorageReader

__all__ = ["run_load"]


def _node_number() -> int:
    return zlib.crc32(str(this_node()).encode())


def run_load(state: dict, reader: DMuonStorageReader, planner: DMuonLoadPlanner, group: Any = None) -> None:
    """Collective: load ``state`` in place with dmuon's planner and reader (module docstring)."""
    ranks = Ranks(group)
    problem: BaseException | None = None
    local: LoadPlan | None = None
    check = wanted = across = False
    node = _node_number()
    try:
        metadata = reader.read_metadata()
        planner.set_up_planner(state, metadata, ranks.coordinator)
        reader.set_up_storage_reader(metadata, ranks.coordinator, rank=ranks.rank, use_collectives=True)
        local = reader.prepare_local_plan(planner.create_local_plan())
        check = planner.needs_global_check(local)
        wants = reader.wants_global_plan()
        wanted, across = wants is True, wants is None
    except Exception as exc:
        problem = exc
    failed, needs, any_across, top, neg_bottom = ranks.max([problem is not None, check or wanted, across, node, -node])
    if failed:
        ranks.raise_everyones(problem, "planning the load failed")
    assert local is not None
    if ranks.world > 1 and (needs or (any_across and top != -neg_bottom)):
        final = _global_plan(ranks, reader, planner, local)
    else:
        final = planner.local_final_plan(local)
    problem = None
    try:
        reader.read_data(planner.finish_plan(final), planner).wait()
    except Exception as exc:
        problem = exc
    ranks.settle(problem, "the load failed")


def _global_plan(ranks: Ranks, reader: DMuonStorageReader, planner: DMuonLoadPlanner, local: LoadPlan) -> LoadPlan:
    plans = ranks.gather(local)
    outgoing: list[Any] | None = None
    if ranks.coordinator:
        assert plans is not None
        try:
            outgoing = [(None, plan) for plan in reader.prepare_global_plan(planner.create_global_plan(plans))]
        except Exception as exc:
            outgoing = [(wrapped(exc), None)] * ranks.world
    failure, plan = ranks.scatter(outgoing)
    if failure is not None:
        raise_failures({0: failure}, "planning the load failed")
    return plan
