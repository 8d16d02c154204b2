"""A tiny Llama-like model and the ways it is laid out: data x tensor parallel, or data only.

The tensor-parallel plan is the one torchtitan's Llama 3 applies, without sequence
parallelism: in each block the attention's q, k, v and the MLP's gate and up projections
column-wise, the attention's output and the MLP's down projection row-wise; the output
projection column-wise, its output replicated. Its size (37) is one the tensor-parallel degree
does not divide. The MLP's hidden size (42) cannot be such a size: torch's ``RowwiseParallel``
builds its input DTensor from local shards as if they were even (torch 2.13), so the down
projection fails on an uneven split; 42 splits 21 + 21 over TP 2, and FSDP2 then cuts 21
unevenly (11 + 10).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

DIM, HEADS, HIDDEN, VOCAB = 32, 4, 42, 37
BATCH, SEQ = 4, 6
COLWISE = ("attention.wq", "attention.wk", "attention.wv", "feed_forward.w1", "feed_forward.w3")
ROWWISE = ("attention.wo", "feed_forward.w2")


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.head_dim = DIM // HEADS
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(DIM, DIM, bias=False) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        # -1 heads: all of them, or this tensor-parallel rank's share
        q, k, v = (w(x).view(b, s, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Linear(DIM, HIDDEN, bias=False)
        self.w2 = nn.Linear(HIDDEN, DIM, bias=False)
        self.w3 = nn.Linear(DIM, HIDDEN, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(DIM)
        self.attention = Attention()
        self.ffn_norm = nn.RMSNorm(DIM)
        self.feed_forward = FeedForward()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


class Tiny(nn.Module):
    def __init__(self, layers: int = 2) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block() for _ in range(layers))
        self.norm = nn.RMSNorm(DIM)
        self.output = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.output(self.norm(x))


def is_matrix(fqn: str, param) -> bool:
    return param.ndim == 2


def tensor_parallel(model: Tiny, tp_mesh, *, sequence_parallel: bool = False) -> None:
    """torchtitan's Llama 3 plan (no loss parallelism), with or without sequence parallelism.

    With it the norms work on this rank's positions of the sequence (``Shard(1)``): the model's
    input is this rank's positions, and the blocks gather the sequence before attention and
    the MLP and scatter it after (as torchtitan's plan did with ``parallelize_module``).
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    top = {"output": ColwiseParallel(output_layouts=Replicate())}
    plan = {name: ColwiseParallel() for name in COLWISE}
    plan.update({name: RowwiseParallel() for name in ROWWISE})
    if sequence_parallel:
        top = {"norm": SequenceParallel(), "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())}
        gather = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
        plan.update({name: RowwiseParallel(output_layouts=Shard(1)) for name in ROWWISE})
        plan.update(attention_norm=SequenceParallel(), ffn_norm=SequenceParallel(), attention=gather,
                    feed_forward=gather)
    parallelize_module(model, tp_mesh, top)
    for block in model.layers:
        parallelize_module(block, tp_mesh, plan)


@dataclass(frozen=True)
class Share:
    """This rank's part of the job's batch: its data-parallel rows and, under sequence
    parallelism, its tensor-parallel rank's positions of the input."""

    index: int
    parts: int
    seq_index: int = 0
    seq_parts: int = 1

    def inputs(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = batch(step)
        per = x.shape[0] // self.parts
        x, y = x[self.index * per : (self.index + 1) * per], y[self.index * per : (self.index + 1) * per]
        positions = x.shape[1] // self.seq_parts
        return x[:, self.seq_index * positions : (self.seq_index + 1) * positions], y


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole job's batch of a step: every layout takes its data-parallel share of it."""
    generator = torch.Generator().manual_seed(100 + step)
    return torch.randn(BATCH, SEQ, DIM, generator=generator), torch.randn(BATCH, SEQ, VOCAB, generator=generator)


def loss_of(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (out - target).pow(2).mean()


def train_step(model: nn.Module, opt, share, step: int) -> float:
    """One optimizer step on this rank's share of batch ``step``; the job's mean loss (every
    rank's share summed, divided by the world: tensor-parallel ranks hold the same share)."""
    import torch.distributed as dist

    x, y = share.inputs(step)
    loss = loss_of(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    whole = loss.detach().clone()
    dist.all_reduce(whole)
    return whole.item() / dist.get_world_size()
