"""How the ranks of one load coordinate: a gather of plans only when something needs it.

torch's ``dcp.load`` gathers every rank's load plan on the coordinator, scatters them back, and
ends with an all-gather of every rank's result: at least one round whose bytes through the
coordinator grow with the ranks, and one that every rank pays N times over. Neither is needed
when every rank's plan stands on its own: an FSDP2 shard or a dedicated weight is read by the
rank that holds it, from the metadata every rank has (``operation.open_once``). :func:`run_load`
drives dmuon's planner and reader itself:

1. one all-reduce of a few integers (``_Planned``): did any rank fail to plan; does any rank's
   plan need the coordinator (a problem to report with every rank's, a checkpoint key no rank
   may hold: ``DMuonLoadPlanner.needs_global_check``); does the reader share reads between
   ranks (always on object storage; on a local path only between machines: the maximum and
   minimum of a hash of each rank's machine say whether the ranks span several); and where
   each rank's identical copies are (``replica_reads.replica_layout``: the same on every rank);
2. reads shared, without a gather to the coordinator: under HSDP (every distributed tensor on
   one mesh, replicated along one dimension of it) each replica group finds the reads all its
   members make in two all-reduces over the group of a width set by the checkpoint, not by
   the job, and each member computes the same assignment of readers
   (``replica_reads.share_among_replicas``). On an FSDP2 1-D mesh no two ranks hold the same
   tensor: nothing to share. Only where the layout is irregular (tensors on several meshes, or
   on none) does the coordinator gather the plans to find what ranks share
   (``cooperative.assign_readers``), as it does to name every rank's problem;
3. each rank reads its share (and its replicas exchange the shared regions);
4. one all-reduce: did any rank fail; if so, every rank raises one dmuon error naming every
   failed rank's problem (gathered on that path only: ``transport.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.checkpoint.planner import LoadPlan

from .load_planner import DMuonLoadPlanner
from .node_identity import node_number
from .reader import DMuonStorageReader
from .replica_reads import IRREGULAR, NO_REPLICAS, ReplicaLayout, replica_layout
from .transport import Attempt, Transport, same

__all__ = ["run_load"]


@dataclass(frozen=True)
class _Planned:
    """The first round of a load (module docstring, step 1)."""

    needs_coordinator: bool = False  # a rank's problem or unexplained key: the coordinator judges
    share_everywhere: bool = False  # a reader shares reads between every pair of ranks
    share_across_machines: bool = False  # a reader shares them between machines only
    machine: int | None = same()  # every rank's machine, if it is one
    replicas: int | None = same()  # every rank's replica layout, if it is one (its signature)


def run_load(state: dict, reader: DMuonStorageReader, planner: DMuonLoadPlanner, transport: Transport) -> None:
    """Collective over ``transport``: load ``state`` in place with dmuon's planner and reader
    (module docstring)."""
    local: LoadPlan | None = None
    layout: ReplicaLayout | int = IRREGULAR
    offer = _Planned(machine=node_number())
    reader.transport = transport
    with Attempt() as planning:
        metadata = reader.read_metadata()
        planner.set_up_planner(state, metadata, transport.coordinator)
        reader.set_up_storage_reader(metadata, transport.coordinator, rank=transport.rank, use_collectives=True)
        local = reader.prepare_local_plan(planner.create_local_plan())
        wants = reader.wants_global_plan()
        if wants is not False:
            layout = replica_layout(planner.state_dict)
        offer = _Planned(
            planner.needs_global_check(local),
            wants is True,
            wants is None,
            offer.machine,
            layout.signature if isinstance(layout, ReplicaLayout) else layout,
        )
    planned = transport.reduce(offer, planning, "planning")
    assert local is not None
    sharing = transport.world > 1 and (
        planned.share_everywhere or (planned.share_across_machines and planned.machine is None)
    )
    regular = planned.replicas is not None and planned.replicas != IRREGULAR
    if transport.world > 1 and (planned.needs_coordinator or (sharing and not regular)):
        final = transport.gather_scatter(
            local, lambda plans: reader.prepare_global_plan(planner.create_global_plan(plans)), "planning"
        )
    else:
        final = planner.local_final_plan(local)
    with Attempt() as reading:
        if sharing and regular and not planned.needs_coordinator and planned.replicas != NO_REPLICAS:
            assert isinstance(layout, ReplicaLayout)
            final = reader.share_among_replicas(final, planner.state_dict, layout)
        reader.read_data(planner.finish_plan(final), planner).wait()
    transport.settle(reading, "reading")
