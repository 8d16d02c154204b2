"""A small Llama-like model on a ("dp_shard", "tp") mesh, as torchtitan's Llama 3 plan lays it out.

For ``tp_step.py`` (issue 45, item 5): an embedding, blocks of attention and a SwiGLU MLP, a final
norm and an output projection; the tensor-parallel plan without sequence or loss parallelism,
then FSDP2 over ``dp_shard``. Defined here because benchmarks do not import the tests.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

SEED = 0
COLWISE = ("attention.wq", "attention.wk", "attention.wv", "feed_forward.w1", "feed_forward.w3")
ROWWISE = ("attention.wo", "feed_forward.w2")

@dataclass(frozen=True)
class Shape:
    dim: int = 128
    heads: int = 4
    hidden: int = 352  # the MLP's; RowwiseParallel needs TP to divide it (torch 2.13)
    vocab: int = 1001  # TP 2 does not divide it: the output projection is cut 501 + 500
    layers: int = 2
    seq: int = 32
    batch: int = 4  # sequences per data-parallel rank per step


# ---------------------------------------------------------------------------------------------
# the model
# ---------------------------------------------------------------------------------------------
class Attention(nn.Module):
    def __init__(self, shape: Shape) -> None:
        super().__init__()
        self.head_dim = shape.dim // shape.heads
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(shape.dim, shape.dim, bias=False) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        # (-1 heads: every head, or this TP rank's share of them)
        q, k, v = (w(x).view(b, s, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        heads = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(heads.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    def __init__(self, shape: Shape) -> None:
        super().__init__()
        self.w1 = nn.Linear(shape.dim, shape.hidden, bias=False)
        self.w2 = nn.Linear(shape.hidden, shape.dim, bias=False)
        self.w3 = nn.Linear(shape.dim, shape.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, shape: Shape) -> None:
        super().__init__()
        self.attention_norm, self.ffn_norm = nn.RMSNorm(shape.dim), nn.RMSNorm(shape.dim)
        self.attention, self.feed_forward = Attention(shape), FeedForward(shape)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(nn.Module):
    def __init__(self, shape: Shape) -> None:
        super().__init__()
        self.shape = shape
        self.tok_embeddings = nn.Embedding(shape.vocab, shape.dim)
        self.layers = nn.ModuleList(Block(shape) for _ in range(shape.layers))
        self.norm = nn.RMSNorm(shape.dim)
        self.output = nn.Linear(shape.dim, shape.vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok_embeddings(tokens[:, :-1])
        for block in self.layers:
            x = block(x)
        logits = self.output(self.norm(x))
        return F.cross_entropy(logits.reshape(-1, self.shape.vocab), tokens[:, 1:].reshape(-1))


def is_muon(fqn: str, param: Any = None) -> bool:
    """Every ``Linear`` weight: the blocks' seven and the output projection."""
    return fqn.endswith(".weight") and ((fqn.startswith("layers.") and "norm" not in fqn) or fqn == "output.weight")


def matrices_in_model(shape: Shape) -> int:
    return 7 * shape.layers + 1


def tensor_parallel(model: Llama, tp_mesh) -> None:
    """torchtitan's Llama 3 plan, without sequence or loss parallelism."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    parallelize_module(model, tp_mesh, {"output": ColwiseParallel(output_layouts=Replicate())})
    plan = {name: ColwiseParallel() for name in COLWISE} | {name: RowwiseParallel() for name in ROWWISE}
    for block in model.layers:
        parallelize_module(block, tp_mesh, plan)


def build_model(shape: Shape, mesh, dedicate: bool) -> Llama:
    """The model from ``SEED``: the TP plan over ``tp``, FSDP2 over ``dp_shard``; with
    ``dedicate``, its matrices named to dmuon as sharded matrices."""
    from torch.distributed.fsdp import fully_shard

    import dmuon

    torch.manual_seed(SEED)
    model = Llama(shape)
    if dedicate:
        dmuon.dedicate_params(model, mesh["dp_shard"], lambda fqn, p: False, sharded_matrices=is_muon)
    tensor_parallel(model, mesh["tp"])
    for block in model.layers:
        fully_shard(block, mesh=mesh["dp_shard"])
    fully_shard(model, mesh=mesh["dp_shard"])
    return model


def batch(shape: Shape, step: int, mesh) -> torch.Tensor:
    """The same tokens for both methods at a step; each data-parallel rank its own rows (the
    two TP ranks of a data-parallel rank take the same ones)."""
    dp_rank, dp = mesh.get_local_rank("dp_shard"), mesh.size(0)
    gen = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, shape.vocab, (shape.batch * dp, shape.seq + 1), generator=gen)
    return tokens[shape.batch * dp_rank : shape.batch * (dp_rank + 1)]
