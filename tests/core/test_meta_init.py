"""A model built on the meta device: dedicate_params, fully_shard, to_empty, init, train.

The order large-job frameworks (torchtitan's Trainer) use. Checked against the same model
built with memory on every rank and initialised the same way: bit-exact values after init and
after training, on 1-D FSDP2 and HSDP; no rank allocates a weight it does not hold; clear
errors, on every rank, for what cannot work.
"""
from __future__ import annotations

import zlib

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import fully_shard

import dmuon
from tests.helpers.launch import RankFailed, run_ranks
from tests.helpers.models import TinyTransformer
from tests.helpers.reference import HPARAMS
from tests.helpers.setup import make_mesh
from tests.helpers.training import train


def matrices(name: str, param: torch.Tensor) -> bool:
    return param.ndim == 2


def per_module_init(model: nn.Module, seed: int = 7) -> None:
    """torchtitan-style init_weights, seeded per module: the same values whichever weights a
    rank holds (every random draw depends only on its module's seed)."""
    with torch.no_grad():
        for name, module in model.named_modules():
            # seeded by the module's name as state_dict shows it (wrappers add none)
            index = zlib.crc32(name.replace("_checkpoint_wrapped_module.", "").encode())
            if isinstance(module, nn.Linear):
                torch.manual_seed(seed + index)
                nn.init.normal_(module.weight, std=0.02)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                torch.manual_seed(seed + index)
                nn.init.normal_(module.weight)
            elif isinstance(module, nn.LayerNorm):
                module.reset_parameters()


def shard(model: nn.Module, mesh) -> dict:
    owners = dmuon.dedicate_params(model, mesh, matrices)
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return owners


def build_on_meta(replicate: int = 1, **model_kwargs) -> nn.Module:
    with torch.device("meta"):
        model = TinyTransformer(**model_kwargs)
    shard(model, make_mesh(replicate))
    model.to_empty(device="cpu")
    if model_kwargs.get("tie_embeddings"):
        # to_empty unties tied weights, in any torch model: tie again before init (HF's
        # model.tie_weights() does this), so that the init's last write wins as in one process
        model.lm_head.weight = model.embed.weight
    return model


def build_with_memory(replicate: int = 1, **model_kwargs) -> nn.Module:
    torch.manual_seed(123)
    model = TinyTransformer(**model_kwargs)
    per_module_init(model)
    shard(model, make_mesh(replicate))
    return model


def compare_worker(rank, world, replicate, model_kwargs):
    import torch.distributed as dist

    meta = build_on_meta(replicate, **model_kwargs)
    registry = vars(meta)["_dmuon_registry"]  # not get_registry: that would adopt before init
    # before init: a rank that will not hold a master holds nothing of it (what the module
    # holds is read directly: asking the record would adopt it)
    held = {rec.fqn: rec.holds_master for rec in registry}
    in_module = {fqn: meta.get_parameter(fqn) for fqn in held}
    bytes_not_held = sum(p.numel() for fqn, p in in_module.items() if not held[fqn])
    held_shapes_ok = all(
        tuple(p.shape) == tuple(registry.records[fqn].shape) for fqn, p in in_module.items() if held[fqn]
    )
    per_module_init(meta)
    meta.logit_scale.fill_(1.0)
    opt_meta = dmuon.Muon(meta, **HPARAMS)

    reference = TinyTransformer(**model_kwargs)
    per_module_init(reference)
    masters_exact = all(
        torch.equal(rec.held_master.detach(), reference.get_parameter(rec.fqn).detach())
        for rec in registry if rec.holds_master
    )
    full = build_with_memory(replicate, **model_kwargs)
    opt_full = dmuon.Muon(full, **HPARAMS)
    init_meta, init_full = dmuon.get_model_state_dict(meta), dmuon.get_model_state_dict(full)
    losses_meta = train(meta, opt_meta, rank, world, range(3))
    losses_full = train(full, opt_full, rank, world, range(3))
    after_meta, after_full = dmuon.get_model_state_dict(meta), dmuon.get_model_state_dict(full)
    dist.barrier()
    return dict(
        bytes_not_held=bytes_not_held, held_shapes_ok=held_shapes_ok, masters_exact=masters_exact,
        init_equal=init_meta.keys() == init_full.keys()
        and all(torch.equal(init_meta[k], init_full[k]) for k in init_full),
        after_equal=all(torch.equal(after_meta[k], after_full[k]) for k in after_full),
        losses=(losses_meta, losses_full),
    )


@pytest.mark.parametrize("world,replicate,model_kwargs", [
    (2, 1, {}),
    (2, 1, {"tie_embeddings": True}),
    (4, 2, {}),
], ids=["fsdp2", "fsdp2-tied", "hsdp-2x2"])
def test_meta_build_matches_a_model_built_with_memory(world, replicate, model_kwargs):
    results = run_ranks(compare_worker, world, replicate, model_kwargs, timeout=120)
    for rank, got in enumerate(results):
        assert got["bytes_not_held"] == 0, rank
        assert got["held_shapes_ok"], rank
        assert got["masters_exact"], rank
        losses_meta, losses_full = got["losses"]
        assert losses_meta == losses_full, rank
    assert results[0]["init_equal"] and results[0]["after_equal"]


def untied_by_to_empty_worker(rank, world):
    """to_empty unties tied weights; a user who does not tie them again still trains one weight:
    dmuon points every alias of a dedicated weight at the parameter the init wrote."""
    with torch.device("meta"):
        model = TinyTransformer(tie_embeddings=True)
    shard(model, make_mesh())
    model.to_empty(device="cpu")
    untied = model.lm_head.weight is not model.embed.weight
    with torch.no_grad():
        torch.manual_seed(5)
        nn.init.normal_(model.embed.weight)  # the init writes only the first name
        for name, p in model.named_parameters():
            if "norm" in name or "bias" in name or "embed" in name:
                continue
            nn.init.normal_(p, std=0.02)
        model.logit_scale.fill_(1.0)
    opt = dmuon.Muon(model, **HPARAMS)
    train(model, opt, rank, world, range(2))
    return untied, model.lm_head.weight is model.embed.weight


def test_tied_weights_untied_by_to_empty_are_tied_again():
    for untied, tied in run_ranks(untied_by_to_empty_worker, 2, timeout=60):
        assert untied and tied


def global_stream_worker(rank, world):
    """One RNG stream over the whole model (not per module): the replicas of a master still
    start equal, because the global owner's values are sent down its column."""
    with torch.device("meta"):
        model = TinyTransformer()
    shard(model, make_mesh(2))
    model.to_empty(device="cpu")
    torch.manual_seed(1000 + rank)  # a different stream on every rank
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()
    dmuon.Muon(model, **HPARAMS)
    return {rec.fqn: rec.held_master.detach().clone() for rec in model._dmuon_registry if rec.holds_master}


def test_hsdp_replicas_start_from_the_global_owners_init():
    results = run_ranks(global_stream_worker, 4, timeout=90)
    # 2x2: ranks 0 and 2 form one shard column, 1 and 3 the other
    for a, b in ((0, 2), (1, 3)):
        assert results[a].keys() == results[b].keys() and results[a]
        for fqn in results[a]:
            assert torch.equal(results[a][fqn], results[b][fqn]), fqn


def error_worker(rank, world, case):
    with torch.device("meta"):
        model = TinyTransformer()
    if case == "mixed":
        model.embed.to_empty(device="cpu")
        shard(model, make_mesh())
        return None
    shard(model, make_mesh())
    tokens = torch.zeros(2, 5, dtype=torch.long)
    if case == "optimizer-on-meta":
        dmuon.Muon(model, **HPARAMS)
    elif case == "init-after-optimizer":
        model.to_empty(device="cpu")
        dmuon.Muon(model, **HPARAMS)
        per_module_init(model)  # too late: the masters were adopted by Muon
        model(tokens)
    return None


@pytest.mark.parametrize("case,expected", [
    ("optimizer-on-meta", "still on the meta device"),
    ("init-after-optimizer", "nothing has written since model.to_empty"),
    ("mixed", "is on the meta device but"),
])
def test_what_cannot_work_fails_on_every_rank(case, expected):
    with pytest.raises(RankFailed) as info:
        run_ranks(error_worker, 2, case, timeout=60, grace=20)
    text = str(info.value)
    assert text.count(expected) >= 2, text  # both ranks raised it, neither hung


def load_instead_of_init_worker(rank, world, path):
    import dmuon.dcp as ddcp

    full = build_with_memory()
    opt_full = dmuon.Muon(full, **HPARAMS)
    train(full, opt_full, rank, world, range(2))
    ddcp.save(full, opt_full, path)
    model = build_on_meta()
    opt = dmuon.Muon(model, **HPARAMS)  # before anything wrote the weights: a load will
    ddcp.load(model, opt, path)
    losses = train(model, opt, rank, world, range(2, 4)), train(full, opt_full, rank, world, range(2, 4))
    return losses


def test_a_checkpoint_load_stands_in_for_init(tmp_path):
    for meta_losses, full_losses in run_ranks(load_instead_of_init_worker, 2, str(tmp_path / "ckpt"), timeout=90):
        assert meta_losses == full_losses


def wrapped_worker(rank, world, path):
    """torchtitan's order inside a parallelize function: activation checkpointing first, then
    dedicate_params, then fully_shard; saved through torch's own entry point."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    with torch.device("meta"):
        model = TinyTransformer()
    for index, block in enumerate(model.layers):
        model.layers[index] = checkpoint_wrapper(block)
    owners = shard(model, make_mesh())
    model.to_empty(device="cpu")
    per_module_init(model)
    model.logit_scale.fill_(1.0)
    opt = dmuon.Muon(model, **HPARAMS)
    losses = train(model, opt, rank, world, range(2))
    dcp.save({"model": model.state_dict()}, checkpoint_id=path)
    saved = dmuon.get_model_state_dict(model)
    plain = TinyTransformer()
    if rank == 0:
        state = {"model": plain.state_dict()}
        dcp.load(state, checkpoint_id=path, process_group=None, no_dist=True)
        loaded = state["model"]
    else:
        loaded = {}
    full = build_with_memory()
    full_losses = train(full, dmuon.Muon(full, **HPARAMS), rank, world, range(2))
    return sorted(owners), losses == full_losses, all(torch.equal(saved[k], loaded[k]) for k in loaded)


def test_activation_checkpointing_applied_before_dedicate_params(tmp_path):
    results = run_ranks(wrapped_worker, 2, str(tmp_path / "ckpt"), timeout=90)
    owners, _, loaded_equal = results[0]
    assert "layers.0.q_proj.weight" in owners  # named as state_dict names it
    assert all(r[1] for r in results) and loaded_equal
