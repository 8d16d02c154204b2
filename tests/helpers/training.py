"""A tiny training job shared by checkpoint tests: same global batch on every topology."""
from __future__ import annotations

import torch

from .models import TinyTransformer, batch, lm_loss, proj_predicate
from .setup import make_mesh, shard_model

GLOBAL_BATCH = 8  # divisible by 1, 2 and 4 ranks


def local_batch(step: int, rank: int, world: int) -> torch.Tensor:
    per = GLOBAL_BATCH // world
    return batch(step, GLOBAL_BATCH)[rank * per:(rank + 1) * per]


def train(model, opt, rank: int, world: int, steps) -> list[float]:
    losses = []
    for step in steps:
        loss = lm_loss(model, local_batch(step, rank, world))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def build(replicate: int = 1, model_cls=TinyTransformer, predicate=proj_predicate, **model_kwargs):
    torch.manual_seed(0)
    model = model_cls(**model_kwargs)
    _, opt = shard_model(model, make_mesh(replicate), predicate)
    return model, opt
