"""Loading into another dtype, on request: an fp32 checkpoint into a bf16 model (a bf16
fine-tune or evaluation of an fp32 run), 1-D and HSDP, dedicated and sharded, model and
optimizer; refused by name without ``cast_dtypes=True``."""
from __future__ import annotations

import pytest
import torch

import dmuon
import dmuon.dcp as ddcp
from tests.helpers.launch import run_ranks
from tests.helpers.models import TinyTransformer, proj_predicate
from tests.helpers.setup import make_mesh, shard_model
from tests.helpers.training import build, train


def bf16_model(replicate: int):
    torch.manual_seed(1)
    model = TinyTransformer().to(torch.bfloat16)
    _, opt = shard_model(model, make_mesh(replicate), proj_predicate)
    return model, opt


def cast_worker(rank, world, replicate, path):
    model, opt = build(replicate)
    train(model, opt, rank, world, range(2))
    ddcp.save(model, opt, path)
    saved_model, saved_optim = dmuon.get_model_state_dict(model), dmuon.get_optimizer_state_dict(model, opt)

    target, target_opt = bf16_model(replicate)
    try:
        ddcp.load(target, target_opt, path)
        refused = None
    except ddcp.CheckpointMismatchError as exc:
        refused = str(exc)
    manager_root = f"{path}-run"
    manager = ddcp.CheckpointManager(manager_root, keep=1)
    manager.save(2, model, opt)
    step = manager.resume(target, target_opt, cast_dtypes=True)
    loaded_model = dmuon.get_model_state_dict(target)
    loaded_optim = dmuon.get_optimizer_state_dict(target, target_opt)
    dtypes = {k: v.dtype for k, v in loaded_model.items()}
    train(target, target_opt, rank, world, range(2, 3))  # it trains on from there
    return dict(refused=refused, step=step, saved=(saved_model, saved_optim), loaded=(loaded_model, loaded_optim),
                dtypes=dtypes)


def _leaves(tree, prefix=""):
    if isinstance(tree, dict):
        for key, value in tree.items():
            yield from _leaves(value, f"{prefix}{key}.")
    elif isinstance(tree, (list, tuple)):
        for index, value in enumerate(tree):
            yield from _leaves(value, f"{prefix}{index}.")
    else:
        yield prefix.rstrip("."), tree


@pytest.mark.parametrize("world,replicate", [(2, 1), (4, 2)], ids=["fsdp2", "hsdp-2x2"])
def test_fp32_checkpoint_into_a_bf16_model_casts_on_request(tmp_path, world, replicate):
    results = run_ranks(cast_worker, world, replicate, str(tmp_path / "ckpt"), timeout=120)
    for got in results:
        assert got["refused"] is not None and "cast_dtypes=True" in got["refused"]
        assert "dtype float32 in the checkpoint, bfloat16 in the model" in got["refused"]
        assert got["step"] == 2
    got = results[0]
    saved_model, saved_optim = got["saved"]
    loaded_model, loaded_optim = got["loaded"]
    assert loaded_model.keys() == saved_model.keys()
    assert got["dtypes"]["layers.0.attn_norm.weight"] == torch.bfloat16  # a sharded parameter, cast
    assert got["dtypes"]["layers.0.q_proj.weight"] == torch.float32  # a dedicated master stays fp32
    for key, value in saved_model.items():
        assert torch.equal(loaded_model[key], value.to(loaded_model[key].dtype)), key
    saved_leaves, loaded_leaves = dict(_leaves(saved_optim)), dict(_leaves(loaded_optim))
    assert saved_leaves.keys() == loaded_leaves.keys()
    checked = 0
    for key, value in saved_leaves.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(loaded_leaves[key], value.to(loaded_leaves[key].dtype)), key
            checked += 1
    assert checked > 10
