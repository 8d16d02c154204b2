"""The flat-dict checkpoint API of the seed: exact resume, any topology, clear errors."""
import copy
from functools import partial

import pytest
import torch
from safetensors.torch import load_file, save_file

import dmuon
from tests.helpers.launch import run_ranks
from tests.helpers.memory import PeakRSS, return_freed_memory_to_os
from tests.helpers.models import OddShapes, TinyTransformer, Wide
from tests.helpers.setup import make_mesh, max_abs_diff, shard_model
from tests.helpers.training import build, check_bit_exact_resume, local_batch, train


def save_flat(model, opt, path, step):
    """The seed's save recipe, verbatim apart from the path."""
    import torch.distributed as dist

    model_sd = dmuon.get_model_state_dict(model)
    optim_sd = dmuon.get_optimizer_state_dict(model, opt)
    if dist.get_rank() == 0:
        torch.save({"model": model_sd, "optim": optim_sd, "step": step}, path)
    dist.barrier()


def load_flat(model, opt, path):
    ckpt = torch.load(path, map_location="cpu")
    dmuon.set_model_state_dict(model, ckpt["model"])
    dmuon.set_optimizer_state_dict(model, opt, ckpt["optim"])
    return ckpt["step"]


@pytest.mark.parametrize("world,replicate", [(2, 1), (4, 1), (4, 2)], ids=["2ranks", "4ranks", "hsdp2x2"])
def test_bit_exact_resume(tmp_path, world, replicate):
    path = tmp_path / "checkpoint.pt"
    second = check_bit_exact_resume(world, replicate, partial(save_flat, path=path), partial(load_flat, path=path))
    assert all(r["model"] == {} and r["optim"] == {} for r in second[1:])  # rank0_only default


def keys_and_values_worker(rank, world, files):
    torch.manual_seed(0)
    plain = TinyTransformer()
    reference = copy.deepcopy(plain)
    model, opt = build()
    out = {}
    everywhere = dmuon.get_model_state_dict(model, rank0_only=False)
    out["keys"] = list(everywhere) == list(plain.state_dict())
    out["init_diff"] = max_abs_diff(everywhere, plain.state_dict())
    out["no_dupes_for_nonpersistent"] = "scratch" not in everywhere
    # train the plain reference a bit so loading visibly changes the distributed model
    with torch.no_grad():
        for p in reference.parameters():
            p.add_(0.01 * torch.randn_like(p))
    if rank == 0:
        torch.save(reference.state_dict(), files["pt"])
        save_file({k: v.contiguous() for k, v in reference.state_dict().items()}, files["st"])
    import torch.distributed as dist

    dist.barrier()
    tokens = local_batch(0, rank, world)
    expected = reference(tokens)
    for kind, loader in (("pt", lambda f: torch.load(f, map_location="cpu")), ("st", load_file)):
        model_fresh, _ = build()
        dmuon.set_model_state_dict(model_fresh, loader(files[kind]))
        with torch.no_grad():
            got = model_fresh(tokens)
        out[f"{kind}_forward_diff"] = (got - expected).abs().max().item()
        out[f"{kind}_sd_diff"] = max_abs_diff(
            dmuon.get_model_state_dict(model_fresh, rank0_only=False), reference.state_dict())
    return out


def test_keys_values_and_single_process_and_hf_checkpoints(tmp_path):
    files = {"pt": tmp_path / "single.pt", "st": tmp_path / "model.safetensors"}
    for res in run_ranks(keys_and_values_worker, 2, files):
        assert res["keys"] and res["no_dupes_for_nonpersistent"]
        assert res["init_diff"] == 0.0
        for kind in ("pt", "st"):
            assert res[f"{kind}_sd_diff"] == 0.0
            assert res[f"{kind}_forward_diff"] <= 1e-6


def uneven_worker(rank, world, phase, path):
    torch.manual_seed(0)
    model = OddShapes()
    predicate = lambda n, p: n in ("mid.weight", "gate.weight")  # noqa: E731 - inp (14 rows) stays FSDP2
    _, opt = shard_model(model, make_mesh(), predicate, wrap=())
    if phase == "load":
        ckpt = torch.load(path, map_location="cpu")
        dmuon.set_model_state_dict(model, ckpt["model"])
        dmuon.set_optimizer_state_dict(model, opt, ckpt["optim"])
    else:
        for step in range(2):
            x = torch.randn(world * 2, 16, generator=torch.Generator().manual_seed(step))
            model(x[rank * 2:rank * 2 + 2]).square().mean().backward()
            opt.step()
            opt.zero_grad()
    state = {"model": dmuon.get_model_state_dict(model), "optim": dmuon.get_optimizer_state_dict(model, opt)}
    if phase == "save" and rank == 0:
        torch.save(state, path)
    return state


@pytest.mark.parametrize("world", [3, 4])
def test_uneven_shards_round_trip_exactly(tmp_path, world):
    path = tmp_path / "uneven.pt"
    saved = run_ranks(uneven_worker, world, "save", path)[0]
    loaded = run_ranks(uneven_worker, world, "load", path)[0]
    assert saved["model"]["inp.weight"].shape == (14, 16)
    assert max_abs_diff(loaded["model"], saved["model"]) == 0.0
    for section in ("fsdp2", "dedicated"):
        assert saved["optim"][section].keys() == loaded["optim"][section].keys()
        for fqn in saved["optim"][section]:
            assert max_abs_diff(loaded["optim"][section][fqn], saved["optim"][section][fqn]) == 0.0
    assert saved["optim"]["fsdp2"]["inp.weight"]["step"].item() == 2.0


def cross_topology_worker(rank, world, replicate, phase, path):
    model, opt = build(replicate)
    if phase == "save":
        train(model, opt, rank, world, range(3))
        save_flat(model, opt, path, 3)
        losses = train(model, opt, rank, world, range(3, 5))  # the continuation on 4 ranks
    else:
        load_flat(model, opt, path)
        loaded = (dmuon.get_model_state_dict(model), dmuon.get_optimizer_state_dict(model, opt))
        losses = train(model, opt, rank, world, range(3, 5))
        return {"loaded": loaded, "losses": losses, "final": dmuon.get_model_state_dict(model)}
    return {"losses": losses, "final": dmuon.get_model_state_dict(model)}


def test_cross_topology_4_to_2_to_1_and_hsdp(tmp_path):
    path = tmp_path / "ckpt.pt"
    source = run_ranks(cross_topology_worker, 4, 1, "save", path)[0]
    saved = torch.load(path)
    for world, replicate in ((2, 1), (1, 1), (4, 2)):
        res = run_ranks(cross_topology_worker, world, replicate, "load", path)[0]
        loaded_model, loaded_optim = res["loaded"]
        assert max_abs_diff(loaded_model, saved["model"]) == 0.0
        for section in ("fsdp2", "dedicated"):
            for fqn, entry in saved["optim"][section].items():
                assert max_abs_diff(loaded_optim[section][fqn], entry) == 0.0, (world, fqn)
        # same global batch, other split: training continues to the same place up to rounding
        assert max_abs_diff(res["final"], source["final"]) <= 1e-5, (world, replicate)


def bad_input_worker(rank, world):
    model, opt = build()
    good = dmuon.get_model_state_dict(model, rank0_only=False)
    bad = dict(good)
    del bad["layers.0.q_proj.weight"]                      # missing (dedicated)
    bad["layers.9.extra.weight"] = torch.zeros(3)            # unexpected
    bad["embed.weight"] = torch.zeros(65, 32)                # wrong shape (FSDP2)
    bad["layers.1.k_proj.weight"] = torch.zeros(32, 31)      # wrong shape (dedicated)
    try:
        dmuon.set_model_state_dict(model, bad)
        message = None
    except dmuon.StateDictError as exc:
        message = str(exc)
    after = dmuon.get_model_state_dict(model, rank0_only=False)
    non_strict = dict(good)
    del non_strict["lm_head.weight"]
    non_strict["unknown"] = torch.zeros(1)
    dmuon.set_model_state_dict(model, non_strict, strict=False)
    opt_sd = dmuon.get_optimizer_state_dict(model, opt, rank0_only=False)
    del opt_sd["dedicated"]["layers.0.v_proj.weight"]
    opt_sd["fsdp2"]["embed.weight"]["exp_avg"] = torch.zeros(2, 2)
    try:
        dmuon.set_optimizer_state_dict(model, opt, opt_sd)
        opt_message = None
    except dmuon.StateDictError as exc:
        opt_message = str(exc)
    return {"message": message, "unchanged": max_abs_diff(after, good), "opt_message": opt_message}


def test_bad_input_names_every_problem_and_changes_nothing():
    for res in run_ranks(bad_input_worker, 2):
        msg = res["message"]
        assert msg is not None
        for key in ("layers.0.q_proj.weight", "layers.9.extra.weight", "embed.weight", "layers.1.k_proj.weight"):
            assert key in msg, (key, msg)
        assert "(65, 32)" in msg and "(64, 32)" in msg
        assert res["unchanged"] == 0.0
        assert "layers.0.v_proj.weight" in res["opt_message"]
        assert "embed.weight.exp_avg" in res["opt_message"]


def memory_worker(rank, world):
    return_freed_memory_to_os()
    torch.manual_seed(0)
    model = Wide()
    predicate = lambda n, p: int(n.split(".")[1]) % 2 == 0  # noqa: E731
    shard_model(model, make_mesh(), predicate, wrap=("blocks",))
    with PeakRSS() as rss:
        sd = dmuon.get_model_state_dict(model)
    return {"growth": rss.growth, "keys": len(sd),
            "model_bytes": sum(p.numel() * 4 for p in Wide().parameters())}


def test_rank0_only_other_ranks_never_hold_the_model():
    results = run_ranks(memory_worker, 4)
    model_bytes = results[0]["model_bytes"]
    assert results[0]["keys"] == 16 and all(r["keys"] == 0 for r in results[1:])
    assert results[0]["growth"] >= 0.9 * model_bytes
    for res in results[1:]:
        # a rank may hold one in-flight tensor (1 MiB) plus padding buffers, never the model
        assert res["growth"] < 0.25 * model_bytes, res["growth"]
