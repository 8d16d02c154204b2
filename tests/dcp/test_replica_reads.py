"""How a replica group shares its reads without a coordinator (``replica_reads.py``): every
member computes its part of one assignment alone, so the parts must fit together -- each
receive has its send, on the same tag, from the member that reads -- whatever the machines;
and the layout that allows it is told apart from those that do not. (Real ranks:
``test_cooperative.py``.)"""
from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.tensor import Replicate, Shard

from dmuon.dcp.cooperative import STICKY_BYTES
from dmuon.dcp.replica_reads import IRREGULAR, NO_REPLICAS, ReplicaLayout, _assigned, replica_layout


def shared_list(count=40, size=3 << 20, files=3):
    """(region, bytes, file, offset, position) in file order, as the shared list is."""
    reads = []
    for k in range(count):
        file = f"__{k % files}_0.distcp"
        reads.append(((f"w{k}", (0,), (0,), (size,)), size, file, (k // files) * size, k))
    return sorted(reads, key=lambda read: (read[2], read[3], read[0]))


def check_fits(reads, machines, writers=None):
    members = range(len(machines))
    parts = [_assigned(reads, me, machines, writers or {}) for me in members]
    sources = {}
    for me, part in enumerate(parts):
        for position, transfer in part.sends.items():
            assert transfer.source == me
            sources[position] = transfer
    read_by = {member: 0 for member in members}
    for position, transfer in sources.items():
        read_by[transfer.source] += reads[0][1]
        # a member of the reader's machine reads for itself and is not sent it
        assert set(transfer.targets) == {m for m in members if machines[m] != machines[transfer.source]}
    for me, part in enumerate(parts):
        for position, transfer in part.receives.items():
            assert position in sources and transfer.tag == sources[position].tag, (me, position)
            assert transfer.source == sources[position].source and me in sources[position].targets
        expected = {p for p, t in sources.items() if me in t.targets}
        assert set(part.receives) == expected
    return read_by


def test_every_receive_has_its_send_between_every_pair():
    reads = shared_list()
    read_by = check_fits(reads, [0, 1, 2, 3])
    # balanced: no member reads much more than its share (neighbours stay together within
    # the sticky allowance)
    assert max(read_by.values()) - min(read_by.values()) <= STICKY_BYTES + reads[0][1]


def test_members_of_one_machine_read_for_themselves():
    check_fits(shared_list(), [7, 7, 9, 9])  # two machines of two members
    parts = [_assigned(shared_list(), me, [5, 5], {}) for me in range(2)]
    assert all(not part.sends and not part.receives for part in parts)  # one machine: no exchange


def test_each_member_reads_the_file_it_wrote_while_balanced():
    """On the topology that saved, each member wrote a share of the chunks (spread over the
    replicas) into its own file: it reads that file, and no other member's (a request or more
    per file on object storage), as long as the shares stay within the sticky allowance."""
    reads = shared_list(count=40, files=4)  # 10 regions of 3 MiB in each member's file
    writers = {f"__{member}_0.distcp": member for member in range(4)}
    parts = [_assigned(reads, me, [0, 1, 2, 3], writers) for me in range(4)]
    file_of = {read[4]: read[2] for read in reads}  # plan position -> file
    for me, part in enumerate(parts):
        files = {file_of[position] for position in part.sends}
        assert files == {f"__{me}_0.distcp"}, (me, files)
    check_fits(reads, [0, 1, 2, 3], writers)

    # one member's file holds most of the bytes: past the allowance the others take its regions
    lopsided = shared_list(count=40, files=1)  # all 120 MiB in member 0's file
    read_by = check_fits(lopsided, [0, 1, 2, 3], {"__0_0.distcp": 0})
    assert max(read_by.values()) - min(read_by.values()) <= STICKY_BYTES + lopsided[0][1], read_by


@dataclass
class Stand:
    """What ``replica_layout`` reads of a DTensor: its mesh and placements."""

    device_mesh: object
    placements: tuple


class Mesh:
    def __init__(self, sizes, names=("replicate", "shard")):
        self.sizes, self.mesh_dim_names, self.ndim = sizes, names, len(sizes)

    def size(self, dim):
        return self.sizes[dim]


def test_the_layout_is_hsdps_replicate_dimension_or_nothing():
    hsdp = Mesh((2, 4))
    state = {"a": Stand(hsdp, (Replicate(), Shard(0))), "b": Stand(hsdp, (Replicate(), Shard(0))), "plain": 3}
    layout = replica_layout(state)
    assert isinstance(layout, ReplicaLayout) and layout.dim == 0
    assert layout.signature == ReplicaLayout(Mesh((2, 4)), 0).signature != ReplicaLayout(Mesh((4, 2)), 0).signature
    assert replica_layout({"a": Stand(Mesh((1, 8)), (Replicate(), Shard(0)))}) == NO_REPLICAS
    assert replica_layout({"a": Stand(Mesh((8,), ("shard",)), (Shard(0),))}) == NO_REPLICAS
    two_meshes = {"a": Stand(hsdp, (Replicate(), Shard(0))), "b": Stand(Mesh((2, 4)), (Replicate(), Shard(0)))}
    assert replica_layout(two_meshes) == IRREGULAR  # (another mesh object, not equal to the first)
    assert replica_layout({"plain": 1}) == IRREGULAR
    mixed = {"a": Stand(hsdp, (Replicate(), Shard(0))), "b": Stand(hsdp, (Shard(0), Shard(1)))}
    assert replica_layout(mixed) == NO_REPLICAS  # no dimension every tensor is replicated along
