"""A tiny mixture-of-experts model, with or without expert parallelism, for dmuon's own tests.

Each layer routes every token to its top expert (``router``), and the experts are two stacks,
``w_in`` ``[experts, hidden, dim]`` and ``w_out`` ``[experts, dim, hidden]``, as torchtitan's
``GroupedExperts`` holds them; ``proj`` is a dense matrix beside them (dedicated). Without
expert parallelism every rank runs every expert on its own tokens. With it
(:func:`build`, ``ep > 1``) the stacks are ``Shard(0)`` DTensors over an ``ep`` mesh
dimension, and the tokens of the ``ep`` ranks are gathered, each rank runs its own experts on
all of them, and the outputs are summed back to their ranks (an all-gather dispatcher); FSDP2
shards the rest of each stack over ``efsdp``, the other dimension, which makes the stacks
DTensors of the two (``_StridedShard``), as torchtitan's expert parallelism does.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

import dmuon

from .reference import HPARAMS

DIM, HIDDEN, VOCAB, SEQ = 32, 48, 64, 9


def _scaled_grad(tensor: torch.Tensor, factor: float) -> torch.Tensor:
    """``tensor`` itself forward (exactly: the second term is zero), its gradient times ``factor``
    backward. Under expert parallelism a rank's experts see the tokens of all ``ep`` ranks, and
    FSDP2 averages over ``efsdp`` only: ``1 / ep`` makes the experts' gradients the job-wide
    mean, as the dense weights' are."""
    return tensor.detach() + (tensor - tensor.detach()) * factor


class Experts(nn.Module):
    def __init__(self, experts: int) -> None:
        super().__init__()
        self.num_experts = experts
        self.w_in = nn.Parameter(torch.randn(experts, HIDDEN, DIM) / math.sqrt(DIM))
        self.w_out = nn.Parameter(torch.randn(experts, DIM, HIDDEN) / math.sqrt(HIDDEN))
        self.ep_group: dist.ProcessGroup | None = None

    def forward(self, x: torch.Tensor, choice: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        w_in, w_out = self.w_in, self.w_out
        first = 0
        if isinstance(w_in, DTensor):  # expert parallel: this rank's experts, all ranks' tokens
            assert isinstance(w_out, DTensor) and self.ep_group is not None
            first = dist.get_group_rank(self.ep_group, dist.get_rank()) * w_in.to_local().shape[0]
            ep = dist.get_world_size(self.ep_group)
            w_in, w_out = (_scaled_grad(w.to_local(), 1.0 / ep) for w in (w_in, w_out))
            x = funcol.all_gather_single_autograd(x, 0, self.ep_group)
            choice = funcol.all_gather_single_autograd(choice, 0, self.ep_group)
            gate = funcol.all_gather_single_autograd(gate, 0, self.ep_group)
        out = torch.zeros_like(x)
        for e in range(w_in.shape[0]):
            mask = (choice == first + e).unsqueeze(-1).to(x.dtype)
            out = out + mask * (F.gelu(x @ w_in[e].T) @ w_out[e].T)
        out = out * gate.unsqueeze(-1)
        if self.ep_group is not None and isinstance(self.w_in, DTensor):
            out = funcol.reduce_scatter_single_autograd(out, "sum", 0, self.ep_group)
        return out


class MoELayer(nn.Module):
    def __init__(self, experts: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.router = nn.Linear(DIM, experts, bias=False)
        self.experts = Experts(experts)
        self.proj = nn.Linear(DIM, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        flat = h.reshape(-1, DIM)
        probs = torch.softmax(self.router(flat).float(), dim=-1)
        gate, choice = probs.max(dim=-1)
        moe = self.experts(flat, choice, gate.to(flat.dtype)).reshape(x.shape)
        return x + self.proj(moe)


class TinyMoE(nn.Module):
    def __init__(self, experts: int = 8, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(MoELayer(experts) for _ in range(layers))
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(x)


def is_stack(fqn: str, param: torch.Tensor) -> bool:
    return ".experts." in fqn


def is_dense_matrix(fqn: str, param: torch.Tensor) -> bool:
    return fqn.endswith("proj.weight")


def build(ep: int, experts: int = 8, seed: int = 0):
    """TinyMoE on every rank: stacks per expert (``ep`` ranks split them, FSDP2 the rest),
    dense ``proj`` matrices dedicated over all ranks. Returns (model, optimizer)."""
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    torch.manual_seed(seed)
    model = TinyMoE(experts)
    if ep == 1:
        mesh = init_device_mesh("cpu", (world,))
        dmuon.dedicate_params(model, mesh, is_dense_matrix, expert_stacks=is_stack)
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, dmuon.Muon(model, **HPARAMS)
    mesh2 = init_device_mesh("cpu", (world // ep, ep), mesh_dim_names=("efsdp", "ep"))
    dp = mesh2._flatten("dp")
    dmuon.dedicate_params(model, dp, is_dense_matrix, expert_stacks=is_stack)
    for layer in model.layers:
        stack = layer.experts
        stack.ep_group = mesh2["ep"].get_group()
        for name in ("w_in", "w_out"):
            value = getattr(stack, name).detach()
            setattr(stack, name, nn.Parameter(distribute_tensor(value, mesh2["ep"], [Shard(0)])))
        fully_shard(stack, mesh=mesh2["efsdp"])
        fully_shard(layer, mesh=dp)
    fully_shard(model, mesh=dp)
    return model, dmuon.Muon(model, **HPARAMS)


def train(model, opt, steps, start: int = 0, per_rank: int = 2) -> list[float]:
    rank, world = dist.get_rank(), dist.get_world_size()
    losses = []
    for step in range(start, start + steps):
        gen = torch.Generator().manual_seed(1000 + step)
        tokens = torch.randint(0, VOCAB, (per_rank * world, SEQ), generator=gen)
        tokens = tokens[per_rank * rank : per_rank * (rank + 1)]
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, VOCAB).float(), tokens[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses
