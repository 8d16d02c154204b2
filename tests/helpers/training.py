"""A tiny training job shared by checkpoint tests: same global batch on every topology."""
from __future__ import annotations

import torch

from .launch import run_ranks
from .models import TinyTransformer, batch, lm_loss, proj_predicate
from .setup import make_mesh, max_abs_diff, shard_model

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


def check_bit_exact_resume(worker, world: int, replicate: int, *args) -> list:
    """Run ``worker(rank, world, replicate, phase, *args)`` for the phases "uninterrupted",
    "first_half" (trains, saves right after ``step()``) and "second_half" (fresh processes:
    load, train on), and assert the halves equal the straight run bit for bit.

    Workers return ``losses``, and on rank 0 ``model`` and ``optim`` (flat dicts); the first
    half also ``pending``: how many HSDP broadcasts were in flight when it saved.
    """
    full = run_ranks(worker, world, replicate, "uninterrupted", *args)
    first = run_ranks(worker, world, replicate, "first_half", *args)
    second = run_ranks(worker, world, replicate, "second_half", *args)
    if replicate > 1:
        assert any(r["pending"] for r in first), "the HSDP case must save with broadcasts pending"
    for rank in range(world):
        assert first[rank]["losses"] + second[rank]["losses"] == full[rank]["losses"]
    assert max_abs_diff(second[0]["model"], full[0]["model"]) == 0.0
    for section in ("fsdp2", "dedicated"):
        for fqn, entry in full[0]["optim"][section].items():
            assert max_abs_diff(second[0]["optim"][section][fqn], entry) == 0.0, fqn
    return second
