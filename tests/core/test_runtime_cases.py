"""Edge cases of the runtime: uneven shapes, missing gradients, accumulation, tying, dtypes."""
import copy

import pytest
import torch
from torch.distributed.fsdp import fully_shard

import dmuon
from dmuon import fsdp_patch
from tests.helpers.launch import RankFailed, run_ranks
from tests.helpers.models import OddShapes, TinyTransformer, batch, lm_loss, proj_predicate
from tests.helpers.reference import ReferenceOptimizer
from tests.helpers.setup import make_mesh, max_abs_diff, shard_model

PREDICATES = {
    "all_matrices": lambda n, p: p.ndim == 2,
    "some": lambda n, p: n in ("mid.weight", "gate.weight", "unused.weight"),
    "none": lambda n, p: False,
}


def odd_shapes_worker(rank, world, predicate_name, accumulate):
    predicate = PREDICATES[predicate_name]
    torch.manual_seed(0)
    model = OddShapes()
    ref = copy.deepcopy(model)
    owners, opt = shard_model(model, make_mesh(), predicate, wrap=())
    ref_opt = ReferenceOptimizer(ref, set(owners))
    diffs, no_grad_seen = [], []
    for step in range(4):
        gen = torch.Generator().manual_seed(step)
        x = torch.randn(world * 2 * accumulate, 16, generator=gen)
        use_unused = step % 2 == 1  # 'unused' gets no gradient on even steps
        for micro in range(accumulate):
            rows = x[micro * world * 2:(micro + 1) * world * 2]
            local = rows[rank * 2:(rank + 1) * 2]
            (model(local, use_unused).square().mean() / accumulate).backward()
            (ref(rows, use_unused).square().mean() / accumulate).backward()
        if "unused.weight" in owners and not use_unused:
            rec = model._dmuon_registry.records["unused.weight"]
            no_grad_seen.append(rec.master is None or rec.master.grad is None)
        opt.step()
        opt.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
        diffs.append(max_abs_diff(dmuon.get_model_state_dict(model, rank0_only=False), ref.state_dict()))
    placeholders = {
        fqn: tuple(rec.param.shape) for fqn, rec in model._dmuon_registry.records.items()
    }
    return {"diffs": diffs, "placeholders": placeholders, "no_grad": no_grad_seen, "owners": owners}


@pytest.mark.parametrize("predicate_name", ["all_matrices", "some", "none"])
@pytest.mark.parametrize("accumulate", [1, 3])
def test_uneven_shapes_no_grad_and_accumulation_on_4_ranks(predicate_name, accumulate):
    results = run_ranks(odd_shapes_worker, 4, predicate_name, accumulate)
    for res in results:
        assert max(res["diffs"]) <= 1e-5, res["diffs"]
        assert all(shape == (0,) for shape in res["placeholders"].values()), res["placeholders"]
        assert all(res["no_grad"])
    owners = results[0]["owners"]
    if predicate_name == "none":
        assert owners == {}
    elif predicate_name == "all_matrices":
        assert {"inp.weight", "gate.weight"} <= set(owners)  # 14-row and 1-row matrices


def tied_and_lifecycle_worker(rank, world):
    torch.manual_seed(0)
    model = TinyTransformer(tie_embeddings=True)
    ref = copy.deepcopy(model)
    predicate = lambda n, p: p.ndim == 2 and ("proj" in n or n == "embed.weight")  # noqa: E731
    owners, opt = shard_model(model, make_mesh(), predicate)
    ref_opt = ReferenceOptimizer(ref, set(owners))
    registry = model._dmuon_registry
    seen_in_forward = {}

    def spy(module, args):  # runs after dmuon's own pre-forward hook
        seen_in_forward[module.weight.shape] = True

    model.layers[0].q_proj.register_forward_pre_hook(spy)
    diffs = []
    for step in range(3):
        tokens = batch(step, 2 * world)
        lm_loss(model, tokens[2 * rank:2 * rank + 2]).backward()
        opt.step()
        opt.zero_grad()
        lm_loss(ref, tokens).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        diffs.append(max_abs_diff(dmuon.get_model_state_dict(model, rank0_only=False), ref.state_dict()))
    holds = {fqn: rec.master is not None for fqn, rec in registry.records.items()}
    return {
        "diffs": diffs,
        "owners": owners,
        "aliases": registry.records["embed.weight"].aliases,
        "holds": holds,
        "outside_shapes": {fqn: tuple(rec.param.shape) for fqn, rec in registry.records.items()},
        "forward_shapes": list(seen_in_forward),
        "master_dtypes": {fqn: str(rec.master.dtype) for fqn, rec in registry.records.items() if rec.master is not None},
    }


def test_tied_embedding_and_placeholder_lifecycle():
    results = run_ranks(tied_and_lifecycle_worker, 2)
    for rank, res in enumerate(results):
        assert max(res["diffs"]) <= 1e-5, res["diffs"]
        assert res["aliases"] == ("embed.weight", "lm_head.weight")
        assert "lm_head.weight" not in res["owners"]  # one record per tied parameter
        assert all(shape == (0,) for shape in res["outside_shapes"].values())
        assert res["forward_shapes"] == [torch.Size([32, 32])]
        for fqn, (_, s) in res["owners"].items():
            assert res["holds"][fqn] == (s == rank)
        assert set(res["master_dtypes"].values()) == {"torch.float32"}


def bf16_worker(rank, world):
    from torch.distributed.fsdp import MixedPrecisionPolicy

    torch.manual_seed(0)
    model = TinyTransformer()
    mesh = make_mesh()
    dmuon.dedicate_params(model, mesh, proj_predicate, param_dtype=torch.bfloat16)
    seen = []
    model.layers[0].q_proj.register_forward_pre_hook(lambda m, a: seen.append(m.weight.dtype))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    opt = dmuon.Muon(model)
    losses = []
    for step in range(8):
        tokens = batch(0, 2 * world)[2 * rank:2 * rank + 2]
        loss = lm_loss(model, tokens)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    rec = model._dmuon_registry.records["layers.0.q_proj.weight"]
    return {"seen": [str(d) for d in seen], "losses": losses,
            "master": str(rec.master.dtype) if rec.master is not None else None}


def test_param_dtype_bf16_compute_fp32_master():
    results = run_ranks(bf16_worker, 2)
    for res in results:
        assert res["seen"] and set(res["seen"]) == {"torch.bfloat16"}
        assert res["master"] in (None, "torch.float32")
        assert res["losses"][-1] < res["losses"][0]
    assert any(res["master"] == "torch.float32" for res in results)


def misuse_worker(rank, world, case):
    model = TinyTransformer()
    mesh = make_mesh()
    if case == "after_fully_shard":
        fully_shard(model, mesh=mesh)
        dmuon.dedicate_params(model, mesh, proj_predicate)
    elif case == "twice":
        dmuon.dedicate_params(model, mesh, proj_predicate)
        dmuon.dedicate_params(model, mesh, proj_predicate)
    elif case == "unnamed_2d":
        from torch.distributed.device_mesh import init_device_mesh
        dmuon.dedicate_params(model, init_device_mesh("cpu", (1, world)), proj_predicate)
    elif case == "different_models":
        other = TinyTransformer(dim=32 if rank == 0 else 64)
        dmuon.dedicate_params(other, mesh, proj_predicate)


@pytest.mark.parametrize("case,message", [
    ("after_fully_shard", "before fully_shard"),
    ("twice", "already called"),
    ("unnamed_2d", 'mesh_dim_names \\("replicate", "shard"\\)'),
    ("different_models", "selected different parameters"),
])
def test_misuse_is_reported_clearly(case, message):
    with pytest.raises(RankFailed, match=message):
        run_ranks(misuse_worker, 2, case, timeout=60)


def test_patch_fails_loudly_when_target_is_missing(monkeypatch):
    import torch.distributed.fsdp._fully_shard._fully_shard as target_module

    monkeypatch.delattr(target_module, "_get_modules_and_states")
    with pytest.raises(fsdp_patch.FSDPPatchError, match="_get_modules_and_states"):
        fsdp_patch.install()
