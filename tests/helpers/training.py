"""A tiny training job shared by checkpoint tests: same global batch on every topology."""
from __future__ import annotations

import functools

import torch

import dmuon

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


RESUME_STEPS = 6


def resume_worker(rank, world, replicate, phase, save, load):
    """One phase of a resume check: train straight through, or train half and ``save(model,
    opt, step=...)`` right after ``step()`` (HSDP broadcasts still pending), or ``load(model,
    opt) -> step`` in fresh processes and train on. ``save``/``load`` are picklable callables."""
    model, opt = build(replicate)
    if phase == "uninterrupted":
        losses = train(model, opt, rank, world, range(RESUME_STEPS))
    elif phase == "first_half":
        losses = train(model, opt, rank, world, range(RESUME_STEPS // 2))
        pending = sum(rec._replicate_work is not None for rec in model._dmuon_registry)
        save(model, opt, step=RESUME_STEPS // 2)
        return {"losses": losses, "pending": pending}
    else:
        start = load(model, opt)
        losses = train(model, opt, rank, world, range(start, RESUME_STEPS))
    import dmuon

    return {"losses": losses, "model": dmuon.get_model_state_dict(model),
            "optim": dmuon.get_optimizer_state_dict(model, opt)}


# The uninterrupted run of each (world, replicate), kept for the session: it does not use
# ``save``/``load``, so every resume check of that topology (torch's, dmuon's, torchtitan's
# entry points, the flat state dicts) compares against the same job's result; one run each.
@functools.cache
def uninterrupted(world: int, replicate: int) -> list:
    return run_ranks(resume_worker, world, replicate, "uninterrupted", None, None)


def check_bit_exact_resume(world: int, replicate: int, save, load) -> list:
    """Assert that train-half, save, load in fresh processes, train-half equals training
    straight through, bit for bit (losses, parameters, optimizer state)."""
    full = uninterrupted(world, replicate)
    first = run_ranks(resume_worker, world, replicate, "first_half", save, load)
    second = run_ranks(resume_worker, world, replicate, "second_half", save, load)
    if replicate > 1:
        assert any(r["pending"] for r in first), "the HSDP case must save with broadcasts pending"
    for rank in range(world):
        assert first[rank]["losses"] + second[rank]["losses"] == full[rank]["losses"]
    assert max_abs_diff(second[0]["model"], full[0]["model"]) == 0.0
    for section in ("fsdp2", "dedicated"):
        for fqn, entry in full[0]["optim"][section].items():
            assert max_abs_diff(second[0]["optim"][section][fqn], entry) == 0.0, fqn
    return second


def build_compiled(replicate: int, backend: str | None, order: str = "before", bf16: bool = False):
    """TinyTransformer with its projections dedicated, each block compiled ``order`` fully_shard."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.manual_seed(0)
    model = TinyTransformer()
    mesh = make_mesh(replicate)
    dtype = torch.bfloat16 if bf16 else None
    dmuon.dedicate_params(model, mesh, proj_predicate, param_dtype=dtype)
    policy = MixedPrecisionPolicy(param_dtype=dtype)

    def compile_blocks():
        for block in model.layers:
            block.compile(backend=backend, fullgraph=True)

    if backend is not None and order == "before":
        compile_blocks()
    for block in model.layers:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    if backend is not None and order == "after":
        compile_blocks()
    return model, dmuon.Muon(model, lr=0.02, adamw_lr=1e-3)
