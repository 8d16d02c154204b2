"""What the scale simulator plans: Llama-like models, each synthetic rank's state dict, and the
bytes that DCP's object collectives move.

Each synthetic rank's state dict is laid out as ``dmuon.dcp.AppState.state_dict()`` lays out a
real one (``model.*``, ``optim.state.*``, ``optim.param_groups.*``, ``__dmuon__``), with no
tensor memory: an FSDP2 shard is a :class:`ShardStub` (a meta tensor of the global shape that
answers DCP's two checkpoint hooks with the chunk this rank would hold), a dedicated tensor a
plain meta tensor of its full shape on the ranks that hold it. torch's view of the same model
(nothing dedicated) makes every tensor a shard. The real-run check (``scale_sim_real.py``)
compares the bytes counted here with those of real gloo ranks on a tiny model.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.tensor.placement_types import Replicate, Shard

from dmuon.dcp.app_state import DedicatedEntry, DedicatedLayout
from dmuon.dcp.format.layout import MODEL_SECTION, OPTIM_SECTION, RESERVED_KEY
from dmuon.ownership import assign_owners

FP32 = torch.float32


@dataclass(frozen=True)
class ModelSpec:
    """A Llama-like decoder: embed, per layer q/k/v/o, gate/up/down and two norms, norm, lm_head."""

    name: str
    layers: int
    dim: int
    ffn: int
    vocab: int
    kv_dim: int


SPECS = {
    "8b": ModelSpec("8B", 32, 4096, 14336, 128256, 1024),
    "70b": ModelSpec("70B", 80, 8192, 28672, 128256, 1024),
    "tiny": ModelSpec("tiny", 2, 32, 64, 128, 16),
}


def param_shapes(spec: ModelSpec) -> list[tuple[str, tuple[int, ...]]]:
    """(fqn, shape) in model order, named as HuggingFace's Llama names them."""
    d, f, kv = spec.dim, spec.ffn, spec.kv_dim
    out: list[tuple[str, tuple[int, ...]]] = [("embed_tokens.weight", (spec.vocab, d))]
    for i in range(spec.layers):
        p = f"layers.{i}"
        out += [
            (f"{p}.self_attn.q_proj.weight", (d, d)),
            (f"{p}.self_attn.k_proj.weight", (kv, d)),
            (f"{p}.self_attn.v_proj.weight", (kv, d)),
            (f"{p}.self_attn.o_proj.weight", (d, d)),
            (f"{p}.mlp.gate_proj.weight", (f, d)),
            (f"{p}.mlp.up_proj.weight", (f, d)),
            (f"{p}.mlp.down_proj.weight", (d, f)),
            (f"{p}.input_layernorm.weight", (d,)),
            (f"{p}.post_attention_layernorm.weight", (d,)),
        ]
    return out + [("norm.weight", (d,)), ("lm_head.weight", (spec.vocab, d))]


def is_muon(fqn: str, shape: Sequence[int]) -> bool:
    """Muon (and so dedicated) for the hidden 2-D weights; embedding and head stay on AdamW, as
    Muon's authors and dmuon's README predicate (``p.ndim == 2 and "proj" in name``) have it."""
    return len(shape) == 2 and "proj" in fqn


# Hyper-parameters as dmuon.Muon's defaults put them in optim.param_groups.
PARAM_GROUPS = {
    "muon": {"lr": 0.02, "momentum": 0.95, "nesterov": True, "ns_steps": 5, "weight_decay": 0.0},
    "adamw": {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01},
}


@dataclass(frozen=True)
class Mesh:
    """The data-parallel mesh: ``replicate`` x ``shard`` ranks, global rank = r * shard + s."""

    world: int
    replicate: int = 1

    @property
    def shard(self) -> int:
        return self.world // self.replicate

    def slot(self, rank: int) -> tuple[int, int]:
        return divmod(rank, self.shard)

    @property
    def label(self) -> str:
        return "FSDP2" if self.replicate == 1 else f"HSDP {self.replicate}x{self.shard}"


class ShardStub(torch.Tensor):
    """An FSDP2 DTensor as DCP's planners see it: global shape and dtype, and the one chunk
    this rank holds (dim-0 sharding, torch's ceil-division, empty shards past the end). The
    memory of one element, expanded to the global shape. DCP asks a DTensor for its write
    items and chunk list through these hooks, so the plans come out as a real DTensor's
    would, with no process group behind it."""

    chunk: ChunkStorageMetadata

    @staticmethod
    def __new__(
        cls,
        shape: Sequence[int],
        dtype: torch.dtype,
        shard_index: int,
        shards: int,
        replica: int = 0,
        replicas: int = 1,
    ) -> ShardStub:
        stub = torch.Tensor._make_subclass(cls, stand_in(shape, dtype))
        # where a DTensor says which ranks hold copies of its chunk (HSDP's replicas)
        stub.device_mesh = StubMesh((replica, shard_index), (replicas, shards))
        stub.placements = (Replicate(), Shard(0))
        size0, offset0 = Shard.local_shard_size_and_offset(shape[0], shards, shard_index)
        sizes = torch.Size([size0, *shape[1:]])
        offsets = torch.Size([offset0] + [0] * (len(shape) - 1))
        stub.chunk = ChunkStorageMetadata(offsets=offsets, sizes=sizes)
        return stub

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))

    def __create_write_items__(self, fqn: str, obj: Any) -> list[WriteItem]:
        chunk = self.chunk
        data = TensorWriteData(
            chunk=ChunkStorageMetadata(chunk.offsets, chunk.sizes),
            properties=TensorProperties(dtype=self.dtype),
            size=self.shape,
        )
        return [WriteItem(index=MetadataIndex(fqn, chunk.offsets), type=WriteItemType.SHARD, tensor_data=data)]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [self.chunk]


class StubMesh:
    """A 2-D device mesh as a DTensor's planner sees it (this rank's coordinate and the sizes),
    and as a load finds its replicas (``replica_reads.replica_layout``: its dimensions, names and
    equality; the simulated transport reaches the ranks along the first)."""

    mesh_dim_names = ("replicate", "shard")
    ndim = 2

    def __init__(self, coordinate: tuple[int, int], sizes: tuple[int, int]) -> None:
        self.coordinate, self.sizes = list(coordinate), sizes

    def __eq__(self, other: object) -> bool:
        return isinstance(other, StubMesh) and (other.coordinate, other.sizes) == (self.coordinate, self.sizes)

    def __hash__(self) -> int:
        return hash((tuple(self.coordinate), self.sizes))

    def get_coordinate(self) -> list[int]:
        return self.coordinate

    def size(self, dim: int) -> int:
        return self.sizes[dim]


def stand_in(shape: Sequence[int], dtype: torch.dtype = FP32) -> torch.Tensor:
    """A CPU tensor of ``shape`` with the memory of one element (stride 0). Not a meta tensor:
    DCP's load planner allocates real memory for those."""
    return torch.zeros((), dtype=dtype).expand(tuple(shape))


@dataclass
class Model:
    """One model on one mesh: its parameters, which are dedicated, and their owners."""

    spec: ModelSpec
    mesh: Mesh
    dedicated: bool  # False: torch's view, every tensor an FSDP2 shard
    params: list[tuple[str, tuple[int, ...]]] = field(init=False)
    owners: dict[str, tuple[int, int]] = field(init=False)

    def __post_init__(self) -> None:
        self.params = param_shapes(self.spec)
        muon = [(fqn, shape) for fqn, shape in self.params if is_muon(fqn, shape)]
        sizes = [(fqn, int(torch.Size(shape).numel()) * 4) for fqn, shape in muon]
        self.owners = assign_owners(sizes, self.mesh.replicate, self.mesh.shard) if self.dedicated else {}

    def writer(self, fqn: str) -> int:
        r, s = self.owners[fqn]
        return r * self.mesh.shard + s

    def layout(self) -> DedicatedLayout:
        """What AppState puts under ``__dmuon__``: the same on every rank."""
        layout = DedicatedLayout(topology=(self.mesh.replicate, self.mesh.shard))
        layout.order = [f"{MODEL_SECTION}.{fqn}" for fqn, _ in self.params]
        holders = tuple(range(self.mesh.world))  # (every plain parameter's mesh is the whole job's)
        for fqn, shape in self.params:
            if fqn in self.owners:
                owner, writer = self.owners[fqn], self.writer(fqn)
                layout.entries[f"{MODEL_SECTION}.{fqn}"] = DedicatedEntry(shape, FP32, writer, owner)
                key = f"{OPTIM_SECTION}.state.{fqn}.momentum_buffer"
                layout.entries[key] = DedicatedEntry(shape, FP32, writer, owner)
            elif not is_muon(fqn, shape):  # what AppState marks as held alike by every rank
                layout.everywhere[f"{OPTIM_SECTION}.state.{fqn}.step"] = holders
        layout.everywhere[f"{OPTIM_SECTION}.param_groups."] = None
        return layout

    def state(self, rank: int, layout: DedicatedLayout | None = None) -> dict[str, Any]:
        """Rank ``rank``'s state dict, as AppState (dmuon) or an all-FSDP2 model (torch) shows it."""
        r, s = self.mesh.slot(rank)
        shards = self.mesh.shard
        model: dict[str, Any] = {}
        adam: dict[str, Any] = {}
        dedicated: dict[str, Any] = {}
        for fqn, shape in self.params:
            owner = self.owners.get(fqn)
            if owner is None:
                model[fqn] = ShardStub(shape, FP32, s, shards, r, self.mesh.replicate)
                if is_muon(fqn, shape):  # torch's view: Muon's momentum as a shard too
                    adam[fqn] = {"momentum_buffer": ShardStub(shape, FP32, s, shards, r, self.mesh.replicate)}
                else:
                    adam[fqn] = {
                        "step": stand_in(()),
                        "exp_avg": ShardStub(shape, FP32, s, shards, r, self.mesh.replicate),
                        "exp_avg_sq": ShardStub(shape, FP32, s, shards, r, self.mesh.replicate),
                    }
                continue
            if owner[1] == s:  # every replica of the owner's shard column holds the master
                model[fqn] = stand_in(shape)
            if owner == (r, s):  # the momentum: the global owner only
                dedicated[fqn] = {"momentum_buffer": stand_in(shape)}
        groups = {name: dict(values) for name, values in PARAM_GROUPS.items()}
        out: dict[str, Any] = {
            MODEL_SECTION: model,
            OPTIM_SECTION: {"state": {**adam, **dedicated}, "param_groups": groups},
        }
        if self.owners:
            out[RESERVED_KEY] = layout if layout is not None else self.layout()
        return out


# ---------------------------------------------------------------------------------------------
# bytes of DCP's object collectives
# ---------------------------------------------------------------------------------------------
SIZE_BYTES = 8  # each object collective first exchanges sizes as int64 tensors


@dataclass
class Call:
    """One collective rooted at rank 0: ``gather`` (sizes[r]: rank r's object), ``scatter``
    (sizes[r]: the object for rank r), ``broadcast`` (sizes[0]: the object), ``all_gather``
    (sizes[r]: rank r's object) or ``all_reduce`` (sizes[0]: the tensor's bytes, 8 per int64)."""

    kind: str
    sizes: list[int]
    #: an all-gather within groups of ranks (a load's replica groups): each group's ranks
    groups: list[tuple[int, ...]] | None = None


def tally(calls: Sequence[Call], world: int) -> dict[str, float]:
    """Per-rank bytes of a list of collectives, two ways.

    *Payload* (``rank0_in``, ``rank0_out``, ``other_*``, ``total``): pickled objects counted
    point to point from or to their root (rank 0), a broadcast as a star (the root sends it to
    each rank: gloo's); an all-reduce of k int64 as 2 x 8k sent and received by every rank (a
    ring's reduce-scatter plus all-gather, or a tree's reduce plus broadcast: at most that).

    *Wire* (``wire_rank0_in``, ``wire_max_in``, ``wire_max_out``): what torch's object
    collectives really move per rank, with ring or tree algorithms where there is no root to
    go through: a gather pads every object to the largest and first all-gathers the int64
    sizes (8 x (N-1) bytes in and out of every rank); a scatter pads likewise, broadcasts the
    largest size and scatters the sizes; a broadcast (sizes, then the object) costs every rank
    the object once in and at most once out (a pipelined ring or tree); an all-gather is ring.
    """
    sent, received = [0] * world, [0] * world
    win, wout = [0] * world, [0] * world
    others = range(1, world)
    for call in calls:
        sizes = call.sizes
        if call.kind == "gather":
            top = max(sizes)
            for rank in others:
                sent[rank] += sizes[rank]
                wout[rank] += top
            received[0] += sum(sizes[1:])
            win[0] += top * (world - 1)
            for rank in range(world):  # the all-gather of the sizes
                win[rank] += SIZE_BYTES * (world - 1)
                wout[rank] += SIZE_BYTES * (world - 1)
        elif call.kind == "scatter":
            top = max(sizes)
            for rank in others:
                received[rank] += sizes[rank]
                win[rank] += top + 2 * SIZE_BYTES
            sent[0] += sum(sizes[1:])
            wout[0] += (top + 2 * SIZE_BYTES) * (world - 1)
        elif call.kind == "broadcast":
            sent[0] += sizes[0] * (world - 1)
            for rank in range(world):
                if rank:
                    received[rank] += sizes[0]
                    win[rank] += sizes[0] + SIZE_BYTES
                wout[rank] += sizes[0] + SIZE_BYTES if world > 1 else 0
        elif call.kind == "all_gather" and call.groups is not None:
            for group in call.groups:
                total, top = sum(sizes[rank] for rank in group), max(sizes[rank] for rank in group)
                for rank in group:
                    sent[rank] += sizes[rank] * (len(group) - 1)
                    received[rank] += total - sizes[rank]
                    win[rank] += (top + SIZE_BYTES) * (len(group) - 1)
                    wout[rank] += (top + SIZE_BYTES) * (len(group) - 1)
        elif call.kind == "all_gather":
            total, top = sum(sizes), max(sizes)
            for rank in range(world):
                sent[rank] += sizes[rank] * (world - 1)
                received[rank] += total - sizes[rank]
                win[rank] += (top + SIZE_BYTES) * (world - 1)
                wout[rank] += (top + SIZE_BYTES) * (world - 1)
        elif call.kind == "all_reduce":
            for rank in range(world):
                for side in (sent, received, win, wout):
                    side[rank] += 2 * sizes[0]
        else:
            raise ValueError(call.kind)
    return {
        "rank0_in": received[0],
        "rank0_out": sent[0],
        "other_in_max": max(received[1:], default=0),
        "other_out_max": max(sent[1:], default=0),
        "total": sum(sent),
        "wire_rank0_in": win[0],
        "wire_max_in": max(win),
        "wire_max_out": max(wout),
    }
