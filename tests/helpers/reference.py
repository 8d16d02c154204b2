"""A deliberately plain single-process Muon + AdamW, written independently of dmuon.optim.

Equivalence tests compare dmuon's distributed run against this on the full, unsharded model.
"""
from __future__ import annotations

import math

import torch
from torch import nn

HPARAMS = dict(lr=0.02, momentum=0.95, nesterov=True, ns_steps=5, weight_decay=0.01,
               adamw_lr=1e-2, adamw_betas=(0.9, 0.99), adamw_eps=1e-8, adamw_weight_decay=0.01)


def newton_schulz(g: torch.Tensor, steps: int) -> torch.Tensor:
    a, b, c = 3.4445, -4.7750, 2.0315
    transpose = g.shape[0] > g.shape[1]
    x = g.t() if transpose else g
    x = x / (torch.linalg.matrix_norm(x) + 1e-7)
    for _ in range(steps):
        s = x @ x.t()
        x = a * x + (b * s + c * s @ s) @ x
    return x.t() if transpose else x


class ReferenceOptimizer:
    def __init__(self, model: nn.Module, muon_fqns: set[str], hp: dict = HPARAMS) -> None:
        self.params = dict(model.named_parameters())
        self.muon = {n for n in muon_fqns if self.params[n].ndim >= 2}
        self.hp = hp
        self.state: dict[str, dict] = {}

    @torch.no_grad()
    def step(self) -> None:
        hp = self.hp
        for name, p in self.params.items():
            if p.grad is None:
                continue
            g = p.grad
            st = self.state.setdefault(name, {})
            if name in self.muon:
                buf = st.setdefault("momentum_buffer", torch.zeros_like(p))
                buf.copy_(hp["momentum"] * buf + g)
                u = g + hp["momentum"] * buf if hp["nesterov"] else buf
                o = newton_schulz(u.reshape(u.shape[0], -1), hp["ns_steps"]).reshape(p.shape)
                rows, cols = p.shape[0], p[0].numel()
                p.mul_(1 - hp["lr"] * hp["weight_decay"])
                p.sub_(hp["lr"] * 0.2 * math.sqrt(max(rows, cols)) * o)
            else:
                b1, b2 = hp["adamw_betas"]
                st["step"] = st.get("step", 0) + 1
                m = st.setdefault("exp_avg", torch.zeros_like(p))
                v = st.setdefault("exp_avg_sq", torch.zeros_like(p))
                m.copy_(b1 * m + (1 - b1) * g)
                v.copy_(b2 * v + (1 - b2) * g * g)
                m_hat = m / (1 - b1 ** st["step"])
                v_hat = v / (1 - b2 ** st["step"])
                p.mul_(1 - hp["adamw_lr"] * hp["adamw_weight_decay"])
                p.sub_(hp["adamw_lr"] * m_hat / (v_hat.sqrt() + hp["adamw_eps"]))

    def zero_grad(self) -> None:
        for p in self.params.values():
            p.grad = None
