"""Tiny models for distributed tests (hidden sizes 16-64)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, hidden: int) -> None:
        super().__init__()
        self.heads = heads
        self.attn_norm = nn.LayerNorm(dim)
        self.q_proj = nn.Linear(dim, dim, bias=False)
        self.k_proj = nn.Linear(dim, dim, bias=False)
        self.v_proj = nn.Linear(dim, dim, bias=False)
        self.o_proj = nn.Linear(dim, dim, bias=False)
        self.mlp_norm = nn.LayerNorm(dim)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = self.attn_norm(x)
        q, k, v = (
            proj(h).view(b, t, self.heads, d // self.heads).transpose(1, 2)
            for proj in (self.q_proj, self.k_proj, self.v_proj)
        )
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o_proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.down_proj(F.gelu(self.up_proj(self.mlp_norm(x))))


class TinyTransformer(nn.Module):
    def __init__(self, vocab: int = 64, dim: int = 32, layers: int = 2, heads: int = 2, hidden: int = 48,
                 tie_embeddings: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Block(dim, heads, hidden) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        if tie_embeddings:
            self.lm_head.weight = self.embed.weight
        self.register_buffer("logit_scale", torch.ones(vocab))
        self.register_buffer("scratch", torch.zeros(3), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x)) * self.logit_scale


def proj_predicate(name: str, param: torch.Tensor) -> bool:
    return param.ndim == 2 and "proj" in name


def lm_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), tokens[:, 1:].reshape(-1))


def batch(step: int, global_batch: int, seq: int = 9, vocab: int = 64) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, vocab, (global_batch, seq), generator=gen)


class OddShapes(nn.Module):
    """Matrices whose rows do not divide the world size, a 1-row matrix, an unused branch."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(16, 14, bias=True)    # 14 rows: uneven on 4 ranks
        self.mid = nn.Linear(14, 16, bias=False)
        self.gate = nn.Linear(16, 1, bias=False)    # 1-row matrix
        self.out = nn.Linear(16, 16, bias=False)
        self.unused = nn.Linear(16, 16, bias=False)  # gets no gradient when use_unused=False
        self.norm = nn.LayerNorm(16)

    def forward(self, x: torch.Tensor, use_unused: bool = False) -> torch.Tensor:
        h = torch.tanh(self.mid(torch.relu(self.inp(x))))
        h = h * torch.sigmoid(self.gate(h))
        if use_unused:
            h = h + self.unused(h)
        return self.out(self.norm(h))


class Wide(nn.Module):
    """16 x (512 x 512) fp32 matrices = 16 MiB: big enough to see who holds what in memory."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(512, 512, bias=False) for _ in range(16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x
