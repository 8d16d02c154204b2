"""The optimizer step of a small MoE at expert parallelism 2 on 4 CPU ranks, four ways.

dmuon against FSDP2 + AdamW, "gather and compute everywhere" Muon and torchtitan 0.3.0's
DistMuon (issue 42, item 6).

    python benchmarks/moe_step.py [--quick] [--repeats 20] [--json PATH] [--profile]

The model is defined here (benchmarks do not import the tests): 4 blocks, each a router
(``Linear``), two expert stacks ``w_in [E, hidden, dim]`` and ``w_out [E, dim, hidden]`` (E = 8),
and a dense ``Linear``; an embedding, norms and a head beside them. 4 ranks, expert parallelism
2: the stacks are ``Shard(0)`` over an ``ep`` mesh dimension and FSDP2 shards them over
``efsdp`` (a 2 x 2 mesh, ``_StridedShard`` DTensors, as torchtitan's EP makes them); everything
else is FSDP2 over all 4 ranks (``dp``). Tokens are routed top-1; the ``ep`` ranks' tokens are
all-gathered, each rank runs its own experts on them, and the outputs are reduce-scattered back.

Muon takes the routers, the dense matrices and every expert (each expert its own matrix); AdamW
the embedding, norms and head. The four methods, on the same initial weights, the same batches
and the same ranks, one training step each in turn (``harness.rotated``), repeated:

* ``dmuon``: routers and dense matrices dedicated (``dmuon.dedicate_params``, one owner each,
  over ``dp``), stacks per expert (``expert_stacks=``), one ``dmuon.Muon``;
* ``fsdp2+adamw``: no Muon at all, ``torch.optim.AdamW`` on the FSDP2 shards;
* ``gather-everywhere``: every rank all-gathers every Muon matrix's momentum update
  (``full_tensor()``), runs Newton-Schulz on all of them, and keeps its own shard of the result
  (the scheme of torchtitan's ``fsdp2-Muon`` and LeRobot's ``DistributedMuon``), written below;
* ``distmuon``: torchtitan's ``DistMuon`` (``torchtitan.distributed.flex_shard``), configured as
  its Kimi recipe does: each router and dense matrix ``Owned`` on ``dp`` (gathered to one rank,
  Newton-Schulz there, sent back), each stack ``Shard(0)`` on ``efsdp`` and ``ep`` (each rank
  its own experts, no communication). Two CUDA-only checks are lifted in these processes, as
  ``benchmarks/titan_dist_muon.py`` does (:func:`allow_dist_muon_on_cpu`);
* ``distmuon-fp32``, a diagnostic, no target: the same DistMuon with its Newton-Schulz in fp32
  (``dmuon.optim.orthogonalize``) instead of bf16. torchtitan casts to bf16 for GPUs; a CPU
  without bf16 matrix units runs bf16 matmuls far slower than fp32, and this row shows how much
  of DistMuon's step that is rather than its communication and scheduling.

Measured per method: the optimizer step's wall time (barrier to barrier, so the slowest rank's)
and CPU time; the bytes each rank sends per training step (forward + backward + step) and in
the step alone, read from outside the collectives (the kernel's count of acknowledged bytes on
every TCP socket of the process, ``wire.tcp_bytes``); Newton-Schulz work per job (matrices
orthogonalised per step, summed over the ranks, over the matrices in the model); optimizer
state per rank and peak RSS. After the timing, dmuon and DistMuon each save a checkpoint, which
is loaded at EP 1 on 4 ranks and at FSDP 2 (2 ranks, EP 1) and saved again: are the weights
and the momentum the ones written?
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import io
import json
import logging
import math
import pstats
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness import PeakRSS, TrainedMethod, paired_ratio, rotated, run_ranks, summary
from wire import barrier_bytes, metered, wire_check

METHODS = ("dmuon", "fsdp2+adamw", "gather-everywhere", "distmuon", "distmuon-fp32")
SEED = 0
MUON = dict(lr=0.02, momentum=0.95, nesterov=True, ns_steps=5, weight_decay=0.01)
ADAMW = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01)


@dataclass(frozen=True)
class Shape:
    dim: int = 64
    hidden: int = 128
    experts: int = 8
    layers: int = 4
    vocab: int = 256
    seq: int = 32
    batch: int = 4  # sequences per rank per step


# ---------------------------------------------------------------------------------------------
# the model
# ---------------------------------------------------------------------------------------------
def model_classes():
    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    import torch.nn.functional as F
    from torch import nn
    from torch.distributed.tensor import DTensor

    class ScaledGrad(torch.autograd.Function):
        """Identity; the gradient times ``factor``. With EP a rank's experts see the tokens of
        all ``ep`` ranks while FSDP2 averages their gradients over ``efsdp`` only: ``1 / ep``
        makes them the job-wide mean, as every other gradient is."""

        @staticmethod
        def forward(ctx, tensor, factor):
            ctx.factor = factor
            return tensor.view_as(tensor)

        @staticmethod
        def backward(ctx, grad):
            return grad * ctx.factor, None

    class Experts(nn.Module):
        def __init__(self, shape: Shape) -> None:
            super().__init__()
            self.num_experts = shape.experts
            self.w_in = nn.Parameter(torch.randn(shape.experts, shape.hidden, shape.dim) / math.sqrt(shape.dim))
            self.w_out = nn.Parameter(torch.randn(shape.experts, shape.dim, shape.hidden) / math.sqrt(shape.hidden))
            self.ep_group: dist.ProcessGroup | None = None

        def forward(self, x, choice, gate):
            w_in, w_out, first = self.w_in, self.w_out, 0
            expert_parallel = isinstance(w_in, DTensor)
            if expert_parallel:  # this rank's experts, every ep rank's tokens
                ep = dist.get_world_size(self.ep_group)
                first = dist.get_group_rank(self.ep_group, dist.get_rank()) * w_in.to_local().shape[0]
                w_in, w_out = (ScaledGrad.apply(w.to_local(), 1.0 / ep) for w in (w_in, w_out))
                x, choice, gate = (funcol.all_gather_single_autograd(t, 0, self.ep_group) for t in (x, choice, gate))
            experts = torch.arange(first, first + w_in.shape[0])
            routed = (choice.unsqueeze(0) == experts.unsqueeze(1)).to(x.dtype) * gate.unsqueeze(0)  # [e, tokens]
            hidden = F.gelu(torch.einsum("td,ehd->eth", x, w_in))
            out = torch.einsum("eth,edh,et->td", hidden, w_out, routed)
            if expert_parallel:
                out = funcol.reduce_scatter_single_autograd(out, "sum", 0, self.ep_group)
            return out

    class Block(nn.Module):
        def __init__(self, shape: Shape) -> None:
            super().__init__()
            self.norm = nn.LayerNorm(shape.dim)
            self.router = nn.Linear(shape.dim, shape.experts, bias=False)
            self.experts = Experts(shape)
            self.dense = nn.Linear(shape.dim, shape.dim, bias=False)

        def forward(self, x):
            flat = self.norm(x).reshape(-1, x.shape[-1])
            gate, choice = torch.softmax(self.router(flat), dim=-1).max(dim=-1)
            return x + self.dense(self.experts(flat, choice, gate).reshape(x.shape))

    class MoE(nn.Module):
        def __init__(self, shape: Shape) -> None:
            super().__init__()
            self.shape = shape
            self.embed = nn.Embedding(shape.vocab, shape.dim)
            self.layers = nn.ModuleList(Block(shape) for _ in range(shape.layers))
            self.norm = nn.LayerNorm(shape.dim)
            self.lm_head = nn.Linear(shape.dim, shape.vocab, bias=False)

        def forward(self, tokens):
            x = self.embed(tokens[:, :-1])
            for block in self.layers:
                x = block(x)
            logits = self.lm_head(self.norm(x))
            return F.cross_entropy(logits.reshape(-1, self.shape.vocab), tokens[:, 1:].reshape(-1))

    return MoE


def is_stack(fqn: str, param) -> bool:
    return ".experts.w_" in fqn


def is_dense_matrix(fqn: str, param) -> bool:
    return fqn.endswith((".router.weight", ".dense.weight"))


def is_muon(fqn: str) -> bool:
    return is_stack(fqn, None) or is_dense_matrix(fqn, None)


def matrices_in_model(shape: Shape) -> int:
    """Muon's matrices: per block a router, a dense matrix and 2 x E experts."""
    return shape.layers * (2 + 2 * shape.experts)


def batch(shape: Shape, step: int):
    """The same tokens for every method at a step; each rank its own slice of the job's batch."""
    import torch
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, shape.vocab, (shape.batch * world, shape.seq + 1), generator=gen)
    return tokens[shape.batch * rank: shape.batch * (rank + 1)]


@dataclass
class Meshes:
    dp: Any  # every rank: dense weights
    ep: Any = None  # experts' expert-parallel dimension (None: EP 1)
    efsdp: Any = None  # experts' FSDP dimension

    @classmethod
    def make(cls, world: int, ep: int) -> Meshes:
        from torch.distributed.device_mesh import init_device_mesh

        if ep == 1:
            return cls(init_device_mesh("cpu", (world,), mesh_dim_names=("dp",)))
        mesh = init_device_mesh("cpu", (world // ep, ep), mesh_dim_names=("efsdp", "ep"))
        return cls(mesh._flatten("dp"), mesh["ep"], mesh["efsdp"])


def build_model(shape: Shape, meshes: Meshes, dedicate: bool):
    """The model from ``SEED``, sharded: stacks over (efsdp, ep), the rest FSDP2 over dp; with
    ``dedicate``, routers and dense matrices dedicated and stacks declared (dmuon)."""
    import torch
    from torch import nn
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor

    import dmuon

    torch.manual_seed(SEED)
    model = model_classes()(shape)
    if dedicate:
        dmuon.dedicate_params(model, meshes.dp, is_dense_matrix, expert_stacks=is_stack)
    for block in model.layers:
        if meshes.ep is not None:
            stack = block.experts
            stack.ep_group = meshes.ep.get_group()
            for name in ("w_in", "w_out"):
                whole = getattr(stack, name).detach()
                setattr(stack, name, nn.Parameter(distribute_tensor(whole, meshes.ep, [Shard(0)])))
            fully_shard(stack, mesh=meshes.efsdp)
        fully_shard(block, mesh=meshes.dp)
    fully_shard(model, mesh=meshes.dp)
    return model


# ---------------------------------------------------------------------------------------------
# the optimizers
# ---------------------------------------------------------------------------------------------
def local(tensor):
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


class GatherEverywhereMuon:
    """Muon as FSDP2 ports of it do: momentum kept on each rank's shard, then every rank
    all-gathers every matrix's update, orthogonalises all of them (each expert of a stack on
    its own, batched), and applies its own shard. Same update as dmuon's: ``buf = mu buf + g``,
    Nesterov ``g + mu buf``, 5 quintic Newton-Schulz iterations (dmuon's public
    ``dmuon.optim.orthogonalize``), decoupled weight decay, scale ``0.2 sqrt(max(rows, cols))``."""

    def __init__(self, named: list[tuple[str, Any]], lr, momentum, nesterov, ns_steps, weight_decay) -> None:
        import torch

        self.named = named
        self.hp = dict(lr=lr, momentum=momentum, nesterov=nesterov, ns_steps=ns_steps, weight_decay=weight_decay)
        self.state = {p: {"momentum_buffer": torch.zeros_like(p)} for _, p in named}
        self.orthogonalised = 0  # matrices, this rank, since the counter was reset

    def step(self) -> None:
        import torch
        from torch.distributed.tensor import DTensor, Replicate

        from dmuon.optim import orthogonalize

        hp = self.hp
        with torch.no_grad():
            for _, param in self.named:
                grad, buf = local(param.grad), local(self.state[param]["momentum_buffer"])
                buf.mul_(hp["momentum"]).add_(grad)
                update = grad.add(buf, alpha=hp["momentum"]) if hp["nesterov"] else buf
                mesh, placements = param.device_mesh, param.placements
                whole = DTensor.from_local(update, mesh, placements, shape=param.shape,
                                           stride=param.stride()).full_tensor()
                ortho = orthogonalize(whole, hp["ns_steps"])
                self.orthogonalised += whole.shape[0] if whole.ndim == 3 else 1
                # this rank's shard of the replicated result: a local slice, no communication
                mine = DTensor.from_local(ortho, mesh, [Replicate()] * mesh.ndim).redistribute(mesh, placements)
                rows, cols = whole.shape[-2:]
                value = local(param)
                value.mul_(1.0 - hp["lr"] * hp["weight_decay"])
                value.add_(mine.to_local(), alpha=-hp["lr"] * 0.2 * math.sqrt(max(rows, cols)))

    def zero_grad(self, set_to_none: bool = True) -> None:
        for _, param in self.named:
            param.grad = None


def allow_dist_muon_on_cpu() -> None:
    """Lift DistMuon's two CUDA-only checks in this process (what stops it on a CPU rank; the
    same two lifts as ``benchmarks/titan_dist_muon.py``): ``_validate_parameter_storage``
    refuses every device but CUDA (replaced by one that returns the parameters' one device),
    and its bucket runtime builds a transfer stream with ``Stream(device=..., priority=0)``,
    which ``torch.cpu.Stream`` does not take (given a subclass that ignores ``device``). CPU
    streams and events do nothing and gloo's collectives are synchronous, so the overlap
    machinery is inert and the order of work holds."""
    import torch
    from torchtitan.distributed.flex_shard import dist_muon

    def one_device(self):
        devices = {p.to_local().device for group in self.param_groups for p in group["params"]}
        if len(devices) != 1:
            raise ValueError(f"DistMuon parameters on {devices}")
        return devices.pop()

    class CpuStream(torch.cpu.Stream):
        def __init__(self, device=None, priority: int = -1) -> None:
            super().__init__(priority)

    dist_muon.DistMuon._validate_parameter_storage = one_device
    torch.cpu.Stream = CpuStream


class NewtonSchulzCounter:
    """Counts the matrices DistMuon orthogonalises in this process, by wrapping the module-level
    function its compute step calls (a batch ``[n, rows, cols]`` counts n); while ``fp32`` is
    set, the iteration runs in fp32 (``distmuon-fp32``) rather than torchtitan's bf16."""

    count = 0
    fp32 = False

    @classmethod
    def install(cls) -> None:
        from torchtitan.distributed.flex_shard import dist_muon

        original = dist_muon._zeropower_via_newtonschulz
        if getattr(original, "counted", False):
            return

        def counted(update, **kwargs):
            from dmuon.optim import orthogonalize

            cls.count += update.reshape(-1, *update.shape[-2:]).shape[0] if update.ndim > 2 else 1
            if cls.fp32:
                return orthogonalize(update.float(), kwargs["ns_steps"], kwargs["eps"])
            return original(update, **kwargs)

        counted.counted = True
        dist_muon._zeropower_via_newtonschulz = counted


class Fp32NewtonSchulz:
    """A DistMuon whose step runs Newton-Schulz in fp32 (:class:`NewtonSchulzCounter`)."""

    def __init__(self, muon) -> None:
        self.muon, self.state, self.param_groups = muon, muon.state, muon.param_groups
        self._redistribution_runtime = muon._redistribution_runtime

    def step(self) -> None:
        NewtonSchulzCounter.fp32 = True
        try:
            self.muon.step()
        finally:
            NewtonSchulzCounter.fp32 = False

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.muon.zero_grad(set_to_none)


def dist_muon_layouts(model) -> dict:
    from torch.distributed.tensor import Shard
    from torchtitan.distributed.flex_shard import ComputeLayout, Owned

    owned = ComputeLayout(shardings_by_mesh_axis={"dp": Owned()})
    per_expert = ComputeLayout(shardings_by_mesh_axis={"dp": Shard(0), "efsdp": Shard(0), "ep": Shard(0)})
    return {fqn: per_expert if is_stack(fqn, p) else owned for fqn, p in model.named_parameters() if is_muon(fqn)}


def build_method(name: str, shape: Shape, meshes: Meshes) -> TrainedMethod:
    import torch

    import dmuon

    model = build_model(shape, meshes, dedicate=name == "dmuon")
    if name == "dmuon":
        opt = dmuon.Muon(model, **MUON, adamw_lr=ADAMW["lr"], adamw_betas=ADAMW["betas"], adamw_eps=ADAMW["eps"],
                         adamw_weight_decay=ADAMW["weight_decay"])
        # from its plans: the dense matrices this rank owns, the experts it orthogonalises
        owned = sum(1 for rec in opt.dedicated_of.values() if rec.uses_muon and rec.is_global_owner)
        owned += sum(len(plan.mine()) for plan in opt.stack_plans.values())
        return TrainedMethod(name, model, [opt], lambda: owned)
    named = list(model.named_parameters())
    if name == "fsdp2+adamw":
        return TrainedMethod(name, model, [torch.optim.AdamW([p for _, p in named], **ADAMW)])
    matrices = [(n, p) for n, p in named if is_muon(n)]
    rest = [(n, p) for n, p in named if not is_muon(n)]
    adamw = torch.optim.AdamW(rest, **ADAMW)  # (name, param) pairs: param_names in its groups
    if name == "gather-everywhere":
        muon = GatherEverywhereMuon(matrices, **MUON)

        def counted() -> int:
            count, muon.orthogonalised = muon.orthogonalised, 0
            return count

        return TrainedMethod(name, model, [muon, adamw], counted)
    assert name in ("distmuon", "distmuon-fp32"), name
    from torchtitan.distributed.flex_shard import BucketConfig, build_dist_muon

    NewtonSchulzCounter.install()
    muon = build_dist_muon([{"params": [p for _, p in matrices], "param_names": [n for n, _ in matrices]}],
                           compute_sharding_by_fqn=dist_muon_layouts(model),
                           bucket_configs=[BucketConfig(patterns=("layers.*",), name="blocks")],
                           adjust_lr_fn="match_rms_adamw", **MUON)
    if name == "distmuon-fp32":
        muon = Fp32NewtonSchulz(muon)

    def counted() -> int:
        count, NewtonSchulzCounter.count = NewtonSchulzCounter.count, 0
        return count

    return TrainedMethod(name, model, [muon, adamw], counted)


# ---------------------------------------------------------------------------------------------
# memory
# ---------------------------------------------------------------------------------------------
def tensor_bytes(root: Any) -> int:
    """Bytes of the distinct tensor storages reachable from ``root`` (dicts, sequences,
    dataclass and ``__slots__`` objects walked; DTensors by their local tensor)."""
    import torch
    from torch.distributed.tensor import DTensor

    seen_storages: set[int] = set()
    seen_objects: set[int] = set()
    total = 0
    stack = [root]
    while stack:
        obj = stack.pop()
        if id(obj) in seen_objects:
            continue
        seen_objects.add(id(obj))
        if isinstance(obj, DTensor):
            obj = obj.to_local()
        if isinstance(obj, torch.Tensor):
            storage = obj.untyped_storage()
            if storage.data_ptr() not in seen_storages:
                seen_storages.add(storage.data_ptr())
                total += storage.nbytes()
        elif isinstance(obj, dict):
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple, set)):
            stack.extend(obj)
        elif hasattr(obj, "__slots__") or hasattr(obj, "__dataclass_fields__"):
            names = list(getattr(obj, "__dataclass_fields__", ()))
            for cls in type(obj).__mro__:
                slots = cls.__dict__.get("__slots__", ())
                names += [slots] if isinstance(slots, str) else list(slots)
            stack.extend(getattr(obj, n) for n in names if hasattr(obj, n))
    return total


def optimizer_bytes(method: TrainedMethod) -> dict[str, int]:
    """This rank's optimizer state (``opt.state`` of every optimizer), and DistMuon's reserved
    communication and scratch buffers, which live as long as the optimizer."""
    state = sum(tensor_bytes(dict(opt.state)) for opt in method.optimizers)
    buffers = sum(tensor_bytes(vars(opt.__dict__["_redistribution_runtime"]))
                  for opt in method.optimizers if "_redistribution_runtime" in opt.__dict__)
    return {"state": state, "buffers": buffers}


# ---------------------------------------------------------------------------------------------
# the timed job
# ---------------------------------------------------------------------------------------------
def timed_job(rank: int, world: int, shape: Shape, ep: int, repeats: int, warmup: int, folder: str,
              profile: bool) -> dict:
    import torch
    import torch.distributed as dist

    allow_dist_muon_on_cpu()
    # DTensor warns at every full_tensor() of a stack that it takes two all-gathers: it does
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    out: dict[str, Any] = {"wire_check": wire_check()}
    meshes = Meshes.make(world, ep)
    methods = {}
    for name in METHODS:
        method = methods[name] = build_method(name, shape, meshes)
        for step in range(warmup):
            method.train_on(batch(shape, step))
            method.step()
            method.ns_per_step()
            method.zero_grad()
    empty = barrier_bytes()
    rows: dict[str, dict[str, list]] = {name: {k: [] for k in ("step_wall", "step_cpu", "fb_wall", "bytes_fb",
                                                                 "bytes_step", "ns")} for name in METHODS}
    for repeat in range(repeats):
        step = warmup + repeat
        for name in rotated(METHODS, repeat):
            method, row = methods[name], rows[name]
            fb, fb_bytes = metered(functools.partial(method.train_on, batch(shape, step)))
            st, st_bytes = metered(method.step)
            row["ns"].append(method.ns_per_step())
            method.zero_grad()
            row["step_wall"].append(st["wall_s"])
            row["step_cpu"].append(st["cpu_s"])
            row["fb_wall"].append(fb["wall_s"])
            row["bytes_fb"].append(fb_bytes - empty)
            row["bytes_step"].append(st_bytes - empty)
    peaks = {}
    for name in METHODS:  # apart from the timing: the sampler thread takes CPU of its own
        method, step = methods[name], warmup + repeats
        with PeakRSS() as peak:
            method.train_on(batch(shape, step))
            method.step()
            method.zero_grad()
        peaks[name] = peak.growth
    out["agreement"] = agreement(methods)
    out["losses"] = {name: list(m.losses) for name, m in methods.items()}  # (before any profiled step)
    if profile:
        out["profile"] = profile_step(methods["dmuon"], shape, warmup + repeats + 1, rank)
    ns_job = {}
    for name in METHODS:
        counts = torch.tensor(rows[name]["ns"], dtype=torch.int64)
        dist.all_reduce(counts)
        ns_job[name] = counts.tolist()
    out.update(rows=rows, peaks=peaks, ns_job=ns_job,
               optimizer_bytes={name: optimizer_bytes(m) for name, m in methods.items()},
               barrier_pair_bytes=empty)
    out["checkpoints"] = save_checkpoints(methods, folder)
    return out


def agreement(methods: dict[str, TrainedMethod]) -> dict[str, float] | None:
    """After the same steps on the same data: the largest relative difference (Frobenius) of a
    Muon matrix from dmuon's, per method (rank 0; gathered whole)."""
    import dmuon

    ours = dmuon.get_model_state_dict(methods["dmuon"].model)  # collective, whole on rank 0
    theirs = {name: {k: v.full_tensor() for k, v in methods[name].model.state_dict().items() if is_muon(k)}
              for name in ("gather-everywhere", "distmuon", "distmuon-fp32")}
    if not ours:
        return None
    return {name: max(float((ours[k] - v).norm() / ours[k].norm()) for k, v in weights.items())
            for name, weights in theirs.items()}


def profile_step(method: TrainedMethod, shape: Shape, step: int, rank: int, steps: int = 5) -> str | None:
    """cProfile of dmuon's optimizer step on rank 0 (the others step unprofiled beside it)."""
    import torch.distributed as dist

    profiler = cProfile.Profile()
    for i in range(steps):
        method.train_on(batch(shape, step + i))
        dist.barrier()
        if rank == 0:
            profiler.enable()
        method.step()
        if rank == 0:
            profiler.disable()
        dist.barrier()
        method.zero_grad()
    if rank != 0:
        return None
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(25)
    return text.getvalue()


# ---------------------------------------------------------------------------------------------
# checkpoints across topologies
# ---------------------------------------------------------------------------------------------
def titan_state(method: TrainedMethod) -> dict:
    """What torchtitan's checkpoint holds for a model and its optimizers: ``model.state_dict()``
    (DTensors, under the model's names) and each optimizer's state under
    ``state.{fqn}.{field}`` (its ``get_flat_optim_state_dict``; the state made first, as its
    ``init_optim_state`` does, by a zero-gradient step at lr 0)."""
    import torch

    for opt in method.optimizers:
        if not opt.state:
            params = [p for group in opt.param_groups for p in group["params"]]
            for p in params:
                p.grad = torch.zeros_like(p)
            lrs = [group["lr"] for group in opt.param_groups]
            for group in opt.param_groups:
                group["lr"] = 0.0
            opt.step()
            for group, lr in zip(opt.param_groups, lrs):
                group["lr"] = lr
            opt.zero_grad(set_to_none=True)
    optim = {}
    for opt in method.optimizers:
        for group in opt.param_groups:
            for fqn, param in zip(group["param_names"], group["params"]):
                for key, value in opt.state[param].items():
                    optim[f"state.{fqn}.{key}"] = value
    return {"model": method.model.state_dict(), "optim": optim}


def save_checkpoints(methods: dict[str, TrainedMethod], folder: str) -> dict:
    import torch.distributed.checkpoint as dcp

    import dmuon.dcp as ddcp

    ddcp.save(methods["dmuon"].model, methods["dmuon"].optimizers[0], f"{folder}/dmuon-ep2")
    dcp.save(titan_state(methods["distmuon"]), checkpoint_id=f"{folder}/distmuon-ep2")
    return {"dmuon": f"{folder}/dmuon-ep2", "distmuon": f"{folder}/distmuon-ep2"}


def restore_job(rank: int, world: int, shape: Shape, folder: str, tag: str) -> dict:
    """Load both checkpoints on EP 1 over ``world`` ranks and write them again."""
    import torch.distributed.checkpoint as dcp

    import dmuon.dcp as ddcp

    allow_dist_muon_on_cpu()
    meshes = Meshes.make(world, 1)
    outcome = {}
    for name in ("dmuon", "distmuon"):
        try:
            method = build_method(name, shape, meshes)
            if name == "dmuon":
                ddcp.load(method.model, method.optimizers[0], f"{folder}/dmuon-ep2")
                ddcp.save(method.model, method.optimizers[0], f"{folder}/dmuon-{tag}")
            else:
                state = titan_state(method)
                dcp.load(state, checkpoint_id=f"{folder}/distmuon-ep2")  # in place, into the live tensors
                dcp.save(titan_state(method), checkpoint_id=f"{folder}/distmuon-{tag}")
            # and the next step runs on the restored state
            method.train_on(batch(shape, 10_000))
            method.step()
            outcome[name] = "loaded"
        except Exception as error:  # a refusal is a result here
            outcome[name] = f"{type(error).__name__}: {error}"
    return outcome


def read_checkpoint(path: str) -> dict:
    """Every tensor of a DCP checkpoint, read whole in this process with torch's reader."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(path).read_metadata()
    wanted = {key: torch.empty(md.size, dtype=md.properties.dtype)
              for key, md in metadata.state_dict_metadata.items() if hasattr(md, "size")}
    dcp.load(wanted, storage_reader=FileSystemReader(path), no_dist=True)
    return wanted


def compare(saved: str, reloaded: str) -> dict:
    """The weights and the Muon momentum of two checkpoints: counted, and those that differ."""
    import torch

    before, after = read_checkpoint(saved), read_checkpoint(reloaded)
    weights = [k for k in before if k.startswith("model.")]
    momentum = [k for k in before if k.endswith("momentum_buffer")]
    differ = [k for k in weights + momentum if k not in after or not torch.equal(before[k], after[k])]
    return {"weights": len(weights), "momentum": len(momentum), "differing": differ}


# ---------------------------------------------------------------------------------------------
# report
# ---------------------------------------------------------------------------------------------
def report(results: list[dict], restores: dict, shape: Shape, repeats: int) -> dict:
    world = len(results)
    total = matrices_in_model(shape)
    table = {}
    for name in METHODS:
        per_rank = [r["rows"][name] for r in results]
        job_wall = [max(r["step_wall"][i] for r in per_rank) for i in range(repeats)]
        cpu = [statistics.mean(r["step_cpu"][i] for r in per_rank) for i in range(repeats)]
        bytes_train = [statistics.median(r["bytes_fb"][i] + r["bytes_step"][i] for i in range(repeats))
                       for r in per_rank]
        bytes_step = [statistics.median(r["bytes_step"]) for r in per_rank]
        table[name] = {
            "step_wall_ms": {k: v * 1e3 for k, v in summary(job_wall).items() if k != "spread"},
            "step_cpu_ms": statistics.median(cpu) * 1e3,
            "fb_wall_ms": statistics.median(max(r["fb_wall"][i] for r in per_rank) for i in range(repeats)) * 1e3,
            "bytes_per_training_step": {"mean": statistics.mean(bytes_train), "max": max(bytes_train)},
            "bytes_per_opt_step": {"mean": statistics.mean(bytes_step), "max": max(bytes_step)},
            "ns_per_job": statistics.median(results[0]["ns_job"][name]) / total,
            "optimizer_state_bytes": max(r["optimizer_bytes"][name]["state"] for r in results),
            "optimizer_buffer_bytes": max(r["optimizer_bytes"][name]["buffers"] for r in results),
            "peak_rss_growth_step": max(r["peaks"][name] for r in results),
            "last_loss": results[0]["losses"][name][-1],
            "_job_wall": job_wall,
        }
        table[name]["restore"] = restores.get(name)
    ours = table["dmuon"]["_job_wall"]
    ratios = {peer: paired_ratio(ours, table[peer]["_job_wall"]) for peer in METHODS[1:]}
    for row in table.values():
        del row["_job_wall"]
    adamw_bytes = table["fsdp2+adamw"]["bytes_per_training_step"]["mean"]
    targets = {
        "ns_per_job_1x": table["dmuon"]["ns_per_job"] == 1.0,
        "bytes_le_1.1x_adamw": table["dmuon"]["bytes_per_training_step"]["mean"] / adamw_bytes,
        "step_le_0.5x_gather": ratios["gather-everywhere"],
        "step_le_1.0x_distmuon": ratios["distmuon"],
    }
    return {"world": world, "shape": shape.__dict__, "repeats": repeats, "table": table,
            "paired_step_ratio_dmuon_over": ratios, "targets": targets,
            "wire_check": results[0]["wire_check"], "matrices_in_model": total,
            "largest_relative_difference_from_dmuon": results[0]["agreement"]}


def print_table(rep: dict) -> None:
    mib = 1 << 20
    print(f"\n{rep['world']} ranks, EP 2, {rep['shape']}, {rep['repeats']} interleaved repeats; "
          f"{rep['matrices_in_model']} Muon matrices in the model")
    print("| method | opt step wall min | median | CPU median | bytes/rank per training step | of which step |"
          " NS per job | opt state / rank | + buffers | peak RSS growth in a step | fwd+bwd median |"
          " restore EP2->EP1 x4, ->FSDP2 x2 |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name, row in rep["table"].items():
        wall = row["step_wall_ms"]
        ns = "-" if name == "fsdp2+adamw" else f"{row['ns_per_job']:.2f}x"
        restore = row["restore"] or "-"
        train, step = row["bytes_per_training_step"]["mean"], row["bytes_per_opt_step"]["mean"] + 0.0
        state, buffers = row["optimizer_state_bytes"], row["optimizer_buffer_bytes"]
        print(f"| {name} | {wall['min']:.1f} ms | {wall['med']:.1f} ms | {row['step_cpu_ms']:.1f} ms | "
              f"{train / mib:.3f} MiB | {round(step / 1024, 1) + 0.0} KiB | {ns} | {state / 1024:.0f} KiB | "
              f"{buffers / 1024:.0f} KiB | "
              f"{row['peak_rss_growth_step'] / mib:.1f} MiB | {row['fb_wall_ms']:.0f} ms | {restore} |")
    print("\npaired step ratio dmuon / peer:", {k: round(v, 3) for k, v in rep["paired_step_ratio_dmuon_over"].items()})
    print("targets:", rep["targets"])
    print("wire check:", rep["wire_check"])
    print("Muon matrices after the same steps, largest relative difference from dmuon's:",
          rep["largest_relative_difference_from_dmuon"])
    print("last losses:", {k: round(v["last_loss"], 6) for k, v in rep["table"].items()})


def restore_verdict(folder: str, outcomes: dict[str, dict], name: str) -> str:
    parts = []
    for tag, outcome in outcomes.items():
        if outcome[name] != "loaded":
            parts.append(f"{tag}: refused ({outcome[name][:200]})")
            continue
        result = compare(f"{folder}/{name}-ep2", f"{folder}/{name}-{tag}")
        ok = not result["differing"] and result["momentum"] > 0
        parts.append(f"{tag}: {'exact' if ok else 'DIFFERS'} ({result['weights']} weights, {result['momentum']} momenta"
                     + (f"; differing {result['differing'][:4]}" if result["differing"] else "") + ")")
    return "; ".join(parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a few repeats of a smaller model, no restores")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--profile", action="store_true", help="cProfile of dmuon's step on rank 0")
    args = parser.parse_args()
    shape = Shape(dim=args.dim, hidden=args.hidden)
    repeats, warmup = args.repeats, args.warmup
    if args.quick:
        shape, repeats, warmup = Shape(dim=32, hidden=48, layers=2), 3, 1
    world, ep = 4, 2
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="moe-step-") as folder:
        results = run_ranks(timed_job, world, shape, ep, repeats, warmup, folder, args.profile, timeout=600)
        restores: dict[str, str] = {}
        if not args.quick:
            outcomes = {"ep1x4": run_ranks(restore_job, 4, shape, folder, "ep1x4", timeout=300)[0],
                        "fsdp2x2": run_ranks(restore_job, 2, shape, folder, "fsdp2x2", timeout=300)[0]}
            restores = {name: restore_verdict(folder, outcomes, name) for name in ("dmuon", "distmuon")}
    rep = report(results, restores, shape, repeats)
    rep["seconds"] = time.monotonic() - started
    if args.profile and results[0].get("profile"):
        print(results[0]["profile"])
    print_table(rep)
    print(f"\n{rep['seconds']:.0f} s")
    if args.json:
        args.json.write_text(json.dumps(rep, indent=2, default=str))


if __name__ == "__main__":
    main()
