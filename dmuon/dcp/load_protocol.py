"""How the ranks of one load coordinate: a gather of plans only when something needs it.

torch's ``dcp.load`` gathers every rank's load plan on the coordinator, scatters them back, and
ends with an all-gather of every rank's result: at least one round whose bytes through the
coordinator grow with the ranks, and one that every rank pays N times over. Neither is needed
when every rank's plan stands on its own: an FSDP2 shard or a dedicated weight is read by the
rank that holds it, from the metadata every rank has (``operation.open_once``). :func:`run_load`
drives dmuon's planner and reader itself:

1. one all-reduce of a few integers (``_Planned``): did any rank fail to plan; does any rank's plan need the
   coordinator (a problem to report with every rank's, a checkpoint key no rank may hold:
   ``DMuonLoadPlanner.needs_global_check``); does the reader want a cooperative assignment (it
   always does on object storage, and on a local path when the ranks span machines: the
   maximum and minimum of a hash of each rank's machine say so);
2. only then, the gather of plans and the scatter of final ones (cooperative restore's
   assignment, ``cooperative.py``, and the checks that name every rank's problem);
3. each rank reads its share;
4. one all-reduce: did any rank fail; if so, every rank raises one dmuon error naming every
   failed rank's problem (gathered on that path only: ``transport.py``).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

from torch.distributed.checkpoint.planner import LoadPlan

from .load_planner import DMuonLoadPlanner
from .node_identity import this_node
from .reader import DMuonStorageReader
from .transport import Attempt, Transport, same

__all__ = ["run_load"]


def _node_number() -> int:
    return zlib.crc32(str(this_node()).encode())


@dataclass(frozen=True)
class _Planned:
    """The first round of a load: does any rank's plan need the coordinator (a problem to
    report with everyone's, a key it cannot place, a cooperative assignment the reader always
    wants); does any reader want one only across machines; every rank's machine, if the same."""

    needs_coordinator: bool = False
    across_machines: bool = False
    machine: int | None = same()


def run_load(state: dict, reader: DMuonStorageReader, planner: DMuonLoadPlanner, transport: Transport) -> None:
    """Collective over ``transport``: load ``state`` in place with dmuon's planner and reader
    (module docstring)."""
    local: LoadPlan | None = None
    offer = _Planned(machine=_node_number())
    reader.transport = transport
    with Attempt() as planning:
        metadata = reader.read_metadata()
        planner.set_up_planner(state, metadata, transport.coordinator)
        reader.set_up_storage_reader(metadata, transport.coordinator, rank=transport.rank, use_collectives=True)
        local = reader.prepare_local_plan(planner.create_local_plan())
        wants = reader.wants_global_plan()
        offer = _Planned(planner.needs_global_check(local) or wants is True, wants is None, offer.machine)
    planned = transport.reduce(offer, planning, "planning")
    assert local is not None
    if transport.world > 1 and (planned.needs_coordinator or (planned.across_machines and planned.machine is None)):
        final = transport.gather_scatter(
            local, lambda plans: reader.prepare_global_plan(planner.create_global_plan(plans)), "planning"
        )
    else:
        final = planner.local_final_plan(local)
    with Attempt() as reading:
        reader.read_data(planner.finish_plan(final), planner).wait()
    transport.settle(reading, "reading")
