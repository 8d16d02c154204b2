"""The distributed run equals a single-process reference of the same math, step by step."""
import copy

import pytest
import torch

import dmuon
from tests.helpers.launch import run_ranks
from tests.helpers.models import TinyTransformer, batch, lm_loss, proj_predicate
from tests.helpers.reference import ReferenceOptimizer
from tests.helpers.setup import make_mesh, max_abs_diff, shard_model

STEPS = 4
PER_RANK = 2


def train(model, opt, rank, world, steps=STEPS, hook=None):
    losses = []
    for step in range(steps):
        tokens = batch(step, PER_RANK * world)
        loss = lm_loss(model, tokens[PER_RANK * rank: PER_RANK * (rank + 1)])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        if hook is not None:
            hook(step)
    return losses


def equivalence_worker(rank, world, replicate):
    torch.manual_seed(0)
    model = TinyTransformer()
    ref = copy.deepcopy(model)
    owners, opt = shard_model(model, make_mesh(replicate), proj_predicate)
    ref_opt = ReferenceOptimizer(ref, set(owners))
    diffs = []

    def compare(step):
        tokens = batch(step, PER_RANK * world)
        lm_loss(ref, tokens).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        full = dmuon.get_model_state_dict(model, rank0_only=False)
        diffs.append(max_abs_diff(full, ref.state_dict()))

    train(model, opt, rank, world, hook=compare)
    return {"diffs": diffs, "owners": owners}


@pytest.mark.parametrize("world,replicate", [(2, 1), (4, 1), (4, 2)], ids=["2ranks", "4ranks", "hsdp2x2"])
def test_matches_single_process_reference(world, replicate):
    results = run_ranks(equivalence_worker, world, replicate)
    for res in results:
        assert len(res["diffs"]) == STEPS
        assert max(res["diffs"]) <= 1e-5, res["diffs"]
        assert res["owners"] == results[0]["owners"]  # same map on every rank
    owners = results[0]["owners"]
    assert len(set(owners.values())) == world  # every slot owns something
    print(f"world={world} replicate={replicate} max|diff| per step: {results[0]['diffs']}")


def variants_worker(rank, world, replicate):
    """Same seed, same data, three runtime variants: the results must be bit-identical."""
    out = {}
    for name, kwargs in {
        "async": dict(replicate_async=True),
        "sync": dict(replicate_async=False),
        "keep_after_forward": dict(reshard_after_forward=False),
    }.items():
        torch.manual_seed(0)
        model = TinyTransformer()
        _, opt = shard_model(model, make_mesh(replicate), proj_predicate, **kwargs)
        losses = train(model, opt, rank, world)
        out[name] = (losses, dmuon.get_model_state_dict(model, rank0_only=False))
    return out


def test_async_sync_and_reshard_variants_bit_identical():
    results = run_ranks(variants_worker, 4, 2)
    for res in results:
        base_losses, base_sd = res["async"]
        for name in ("sync", "keep_after_forward"):
            losses, sd = res[name]
            assert losses == base_losses, name
            assert max_abs_diff(sd, base_sd) == 0.0, name
