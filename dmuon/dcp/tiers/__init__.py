"""Checkpoint tiers: node-local saves replicated to a peer node, copied to a persistent tier.

==================  ===========================================================================
``manager``         ``TieredCheckpointManager`` (when each tier saves, the local save, the step
                    boundary's preemption agreement) and ``PreemptionReport``
``nodes``           which node each rank is on, the replication ring, the tiers' two gloo
                    groups (main thread, background thread)
``local``           one node's local directory: own steps, peers' replicas, what it holds,
                    retention
``transfer``        byte ranges of local files between ranks over a gloo group, in step even
                    when one side fails
``replication``     a node's part of a step copied to the next node, each file verified
                    before it is renamed into place
``promotion``       a committed local step copied to the persistent tier with the local
                    save's checksums, commit last
``restore``         the newest step complete in some tier, agreed by all ranks; missing byte
                    ranges fetched from peers; ``RestoreReport``
``preemption``      ``PreemptionWatcher``: a signal handler that only sets a flag
``background``      the background thread: jobs in order, a failure raised at the next call
==================  ===========================================================================

Only ``manager`` ties the others together, and the rest of dmuon imports none of them
(``dmuon.dcp`` takes its public names from this package): the feature reads as one unit,
on top of the rest of ``dcp``. Saves and loads go through ``api``, the persistent tier is a
``CheckpointManager``, and every byte copied between nodes or tiers is checked against the
manifest the local save wrote. The user's guide is ``docs/tiers.md``.
"""

from .manager import PreemptionReport, TieredCheckpointManager
from .restore import RestoreReport

__all__ = ["PreemptionReport", "RestoreReport", "TieredCheckpointManager"]
