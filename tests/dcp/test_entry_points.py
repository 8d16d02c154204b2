"""The ecosystem's DCP entry points: each one restores every dedicated weight bit for bit, or
fails loudly before anything is committed. Never a silent loss (issue 12's table, row by row).
"""
import copy
from functools import partial

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

import dmuon
import dmuon.dcp as ddcp
from tests.helpers.launch import RankFailed, run_ranks
from tests.helpers.models import TinyTransformer, proj_predicate
from tests.helpers.setup import make_mesh, max_abs_diff, shard_model
from tests.helpers.training import build, check_bit_exact_resume, train

DEDICATED = "layers.0.q_proj.weight"


def full_state(model, opt):
    return {"model": dmuon.get_model_state_dict(model, rank0_only=False),
            "optim": dmuon.get_optimizer_state_dict(model, opt, rank0_only=False)}


def assert_optim_equal(got, want):
    for section in ("fsdp2", "dedicated"):
        assert got[section].keys() == want[section].keys()
        for fqn, entry in want[section].items():
            assert max_abs_diff(got[section][fqn], entry) == 0.0, (section, fqn)
    assert got["param_groups"] == want["param_groups"]


# ---------------------------------------------------------------------------------------------
# model.state_dict() itself
# ---------------------------------------------------------------------------------------------
def state_dict_shape_worker(rank, world):
    model, opt = build()
    registry = model._dmuon_registry
    sd = model.state_dict()
    out = {"shapes": {k: tuple(v.shape) for k, v in sd.items()},
           "held": sorted(rec.fqn for rec in registry if rec.holds_master)}
    # what this rank's state_dict() gave is accepted back by strict loading
    out["own_missing"] = list(model.load_state_dict(model.state_dict()).missing_keys)
    # a full single-process state dict (the seed's flat path) loads into a model whose other
    # parameters are plain tensors (FSDP2's DTensors never accept a full plain tensor)
    full = dmuon.get_model_state_dict(model, rank0_only=False)
    torch.manual_seed(1)
    plain = TinyTransformer()
    shard_model(plain, make_mesh(), proj_predicate, fsdp=False)
    result = plain.load_state_dict(full)
    out["flat_missing"] = list(result.missing_keys)
    out["flat_diff"] = max_abs_diff(dmuon.get_model_state_dict(plain, rank0_only=False), full)
    return out


def test_state_dict_holds_each_dedicated_weight_whole_where_held_and_nowhere_else():
    results = run_ranks(state_dict_shape_worker, 2)
    model_keys = set()
    for res in results:
        model_keys |= set(res["shapes"])
        assert all(0 not in shape for shape in res["shapes"].values()), res["shapes"]
        for fqn in res["held"]:
            assert res["shapes"][fqn] == (32, 32) or "proj" in fqn
        assert res["flat_missing"] == [] and res["flat_diff"] == 0.0
        assert res["own_missing"] == []
    held = [set(res["held"]) for res in results]
    assert held[0] and held[1] and not held[0] & held[1]  # each weight on exactly one rank
    for res, mine in zip(results, held):
        others = set().union(*held) - mine
        assert not others & set(res["shapes"])  # no entry at all where not held


# ---------------------------------------------------------------------------------------------
# plain dcp.save(model.state_dict()) / dcp.load + model.load_state_dict, any topology
# ---------------------------------------------------------------------------------------------
def plain_save_worker(rank, world, replicate, root):
    model, opt = build(replicate)
    train(model, opt, rank, world, range(2))
    dcp.save(model.state_dict(), checkpoint_id=f"{root}/torch")                       # torch's writer
    dcp.save(model.state_dict(), storage_writer=ddcp.DMuonStorageWriter(f"{root}/dmuon"))  # dmuon's
    return dmuon.get_model_state_dict(model)


def plain_load_worker(rank, world, replicate, root):
    out = {}
    for name in ("torch", "dmuon"):
        model, _ = build(replicate)  # fresh initialisation, not the trained weights
        sd = model.state_dict()
        reader = ddcp.DMuonStorageReader(f"{root}/{name}") if name == "dmuon" else None
        dcp.load(sd, checkpoint_id=None if reader else f"{root}/{name}", storage_reader=reader)
        model.load_state_dict(sd)
        out[name] = dmuon.get_model_state_dict(model)
    return out


@pytest.mark.parametrize("source,targets", [
    ((2, 1), [(2, 1), (4, 1)]),
    ((4, 1), [(2, 1)]),
    ((4, 2), [(4, 1)]),
], ids=["2to2+4", "4to2", "hsdp2x2to4"])
def test_plain_dcp_save_and_load_restore_every_dedicated_weight(tmp_path, source, targets):
    import pickle

    root = str(tmp_path)
    saved = run_ranks(plain_save_worker, source[0], source[1], root)[0]
    md = pickle.loads((tmp_path / "torch" / ".metadata").read_bytes())
    assert tuple(md.state_dict_metadata[DEDICATED].size) == (32, 32)
    for world, replicate in targets:
        loaded = run_ranks(plain_load_worker, world, replicate, root)[0]
        for name in ("torch", "dmuon"):
            assert max_abs_diff(loaded[name], saved) == 0.0, (name, world, replicate)


# ---------------------------------------------------------------------------------------------
# torch's state-dict API (sharded, and full + cpu_offload) with dmuon.Muon
# ---------------------------------------------------------------------------------------------
def torch_api_save(model, opt, step, *, path):
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt), "step": step}
    dcp.save(state, checkpoint_id=path)


def torch_api_load(model, opt, *, path):
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt), "step": -1}
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, opt, state["optim"])
    return state["step"]


@pytest.mark.parametrize("world,replicate", [(2, 1), (4, 2)], ids=["2ranks", "hsdp2x2"])
def test_torch_state_dict_api_with_default_planner_resumes_bit_exactly(tmp_path, world, replicate):
    where = dict(path=str(tmp_path / "ckpt"))
    check_bit_exact_resume(world, replicate, partial(torch_api_save, **where), partial(torch_api_load, **where))


FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


def full_api_worker(rank, world):
    model, opt = build()
    train(model, opt, rank, world, range(2))
    reference = full_state(model, opt)
    full_model = get_model_state_dict(model, options=FULL)
    full_optim = get_optimizer_state_dict(model, opt, options=FULL)
    # every rank loads rank 0's full dicts into a fresh model
    payload = [full_model, full_optim]
    torch.distributed.broadcast_object_list(payload, src=0)
    fresh, fresh_opt = build()
    # (torch's set_* rewrite the dict they are given: hand them copies)
    set_model_state_dict(fresh, copy.deepcopy(payload[0]), options=StateDictOptions(full_state_dict=True))
    set_optimizer_state_dict(fresh, fresh_opt, copy.deepcopy(payload[1]),
                             options=StateDictOptions(full_state_dict=True))
    return {"reference": reference, "full_model": full_model, "full_optim": full_optim,
            "round_trip": full_state(fresh, fresh_opt)}


def test_torch_full_state_dicts_hold_every_dedicated_weight_and_round_trip():
    results = run_ranks(full_api_worker, 2)
    ref = results[0]["reference"]
    full_model, full_optim = results[0]["full_model"], results[0]["full_optim"]
    assert max_abs_diff(full_model, ref["model"]) == 0.0  # every key, full shapes, same values
    for fqn, entry in ref["optim"]["dedicated"].items():
        assert max_abs_diff(full_optim["state"][fqn], entry) == 0.0, fqn
    for fqn, entry in ref["optim"]["fsdp2"].items():
        assert max_abs_diff(full_optim["state"][fqn], entry) == 0.0, fqn
    assert results[1]["full_model"] == {} and results[1]["full_optim"] == {}  # cpu_offload: rank 0 only
    for res in results:
        assert max_abs_diff(res["round_trip"]["model"], ref["model"]) == 0.0
        assert_optim_equal(res["round_trip"]["optim"], ref["optim"])


# ---------------------------------------------------------------------------------------------
# refusals: a wrong entry under a dedicated key never reaches storage
# ---------------------------------------------------------------------------------------------
def refuse_worker(rank, world, path, variant):
    model, _ = build()
    sd = model.state_dict()
    params = dict(model.named_parameters())
    if variant == "placeholder_copy":  # what older dmuon's state_dict() gave on non-owners
        sd = {k: params[k].detach().clone() if k.endswith("proj.weight") else v for k, v in params.items()}
    elif variant == "wrong_shape":
        sd[DEDICATED] = torch.zeros(3, 32) if DEDICATED in sd else torch.zeros(3, 32)
    # the caller says whose state dict this is: the planner checks its dedicated keys
    dcp.save(sd, checkpoint_id=path, planner=ddcp.DMuonSavePlanner(models={"": model}))


@pytest.mark.parametrize("variant,needle", [
    ("placeholder_copy", "a copy of a rank's placeholder"),
    ("wrong_shape", "shape (3, 32), but the dmuon dedicated tensor has shape (32, 32)"),
])
def test_dmuon_planner_refuses_a_wrong_dedicated_entry_before_writing(tmp_path, variant, needle):
    path = tmp_path / "ckpt"
    with pytest.raises(RankFailed) as info:
        run_ranks(refuse_worker, 2, str(path), variant)
    assert needle in str(info.value) and "SaveRefusedError" in str(info.value)
    assert DEDICATED in str(info.value)
    assert not (path / ".metadata").exists()
    assert not list(path.glob("*.distcp")) if path.exists() else True


def lossy_save_worker(rank, world, path):
    """A checkpoint as torch's default planner wrote it with older dmuon: empty weights."""
    model, _ = build()
    sd = dict(model.state_dict())
    for rec in model._dmuon_registry:
        sd[rec.fqn] = torch.empty(0, 32)
    dcp.save({"model": sd}, checkpoint_id=path)


def lossy_load_worker(rank, world, path):
    model, opt = build()
    before = full_state(model, opt)
    outcome = {}
    try:
        state = {"model": model.state_dict()}
        dcp.load(state, checkpoint_id=path, planner=ddcp.DMuonLoadPlanner())
    except BaseException as exc:  # noqa: BLE001 - DCP raises a BaseException
        outcome["planner"] = str(exc)
    try:
        ddcp.load(model, None, path)
    except ddcp.CheckpointMismatchError as exc:
        outcome["api"] = str(exc)
    outcome["unchanged"] = max_abs_diff(full_state(model, opt)["model"], before["model"]) == 0.0
    return outcome


def test_a_checkpoint_with_empty_dedicated_weights_is_refused_and_the_model_kept(tmp_path):
    path = str(tmp_path / "lossy")
    run_ranks(lossy_save_worker, 2, path)
    for res in run_ranks(lossy_load_worker, 2, path):
        assert "CheckpointMismatchError" in res["planner"] and f"model.{DEDICATED}" in res["planner"]
        assert "lost the weight" in res["api"] and f"model.{DEDICATED}" in res["api"]
        assert res["unchanged"]


def flat_refuse_worker(rank, world):
    model, _ = build()
    full = dmuon.get_model_state_dict(model, rank0_only=False)
    full[DEDICATED] = torch.empty(0, 32)
    try:
        model.load_state_dict(full)
    except RuntimeError as exc:
        return str(exc)
    return None


def test_load_state_dict_refuses_an_empty_dedicated_weight_on_every_rank():
    for message in run_ranks(flat_refuse_worker, 2):
        assert message and DEDICATED in message and "placeholder" in message


# ---------------------------------------------------------------------------------------------
# a bf16 model-only export of model.state_dict(), with either planner
# ---------------------------------------------------------------------------------------------
def bf16_worker(rank, world, root):
    model, opt = build()
    train(model, opt, rank, world, range(1))
    export = {k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}
    dcp.save(export, checkpoint_id=f"{root}/default")
    dcp.save(export, checkpoint_id=f"{root}/dmuon", planner=ddcp.DMuonSavePlanner())
    return {k: v.to(torch.bfloat16) for k, v in dmuon.get_model_state_dict(model).items()}


def test_bf16_export_holds_full_dedicated_weights(tmp_path):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    want = run_ranks(bf16_worker, 2, str(tmp_path))[0]
    for name in ("default", "dmuon"):
        dcp_to_torch_save(tmp_path / name, tmp_path / f"{name}.pt")
        got = torch.load(tmp_path / f"{name}.pt", weights_only=True)
        got = {k: v for k, v in got.items() if k in want}
        assert got[DEDICATED].shape == (32, 32) and got[DEDICATED].dtype == torch.bfloat16
        assert max_abs_diff(got, want) == 0.0, name


# ---------------------------------------------------------------------------------------------
# torch's dcp.async_save: thread- and process-based, AppState or a plain state dict
# ---------------------------------------------------------------------------------------------
def torch_async_worker(rank, world, path, how):
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    model, opt = build()
    train(model, opt, rank, world, range(2))
    snapshot = full_state(model, opt)
    group = dist.new_group(backend="gloo")  # never the training group (see shared/notes/dcp.md)
    kind = AsyncCheckpointerType.PROCESS if how.startswith("process") else AsyncCheckpointerType.THREAD
    stager = DefaultStager(StagingOptions(False, False, False, False))  # torch's defaults need a GPU
    if how.endswith("app"):
        state, planner = {"app": ddcp.AppState(model, opt)}, ddcp.DMuonSavePlanner()
    else:
        state, planner = {"model": model.state_dict(), "optim": get_optimizer_state_dict(model, opt)}, None
    future = dcp.async_save(state, checkpoint_id=path, planner=planner, process_group=group,
                            async_checkpointer_type=kind, async_stager=stager)
    train(model, opt, rank, world, range(2, 4))  # must not leak into the checkpoint
    future.result()
    fresh, fresh_opt = build()
    if how.endswith("app"):
        dcp.load({"app": ddcp.AppState(fresh, fresh_opt)}, checkpoint_id=path, planner=ddcp.DMuonLoadPlanner())
    else:
        loaded = {"model": fresh.state_dict(), "optim": get_optimizer_state_dict(fresh, fresh_opt)}
        dcp.load(loaded, checkpoint_id=path)
        fresh.load_state_dict(loaded["model"])
        set_optimizer_state_dict(fresh, fresh_opt, loaded["optim"])
    return {"snapshot": snapshot, "loaded": full_state(fresh, fresh_opt), "live": full_state(model, opt)}


@pytest.mark.parametrize("how", ["thread-app", "thread-plain", "process-app"])
def test_torch_async_save_is_bit_exact_and_captured_at_the_call(tmp_path, how):
    results = run_ranks(torch_async_worker, 2, str(tmp_path / "ckpt"), how, daemon=how.startswith("thread"))
    for res in results:
        assert max_abs_diff(res["loaded"]["model"], res["snapshot"]["model"]) == 0.0
        assert_optim_equal(res["loaded"]["optim"], res["snapshot"]["optim"])
        assert max_abs_diff(res["live"]["model"], res["snapshot"]["model"]) > 0.0  # training went on


def staging_worker(rank, world):
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    from torch.utils._pytree import tree_leaves

    model, opt = build()
    stager = DefaultStager(StagingOptions(False, False, False, False))
    out = {}
    for name, make in (("app", lambda: {"app": ddcp.AppState(model, opt).state_dict()}),
                       ("plain", lambda: {"model": model.state_dict()})):
        first = [t.data_ptr() for t in tree_leaves(stager.stage(make())) if isinstance(t, torch.Tensor)]
        train(model, opt, rank, world, range(1))
        staged = stager.stage(make())
        second = [t.data_ptr() for t in tree_leaves(staged) if isinstance(t, torch.Tensor)]
        out[name] = {"same_buffers": first == second, "count": len(first)}
    out["fresh"] = max_abs_diff({k: v.to_local() if hasattr(v, "to_local") else v for k, v in staged["model"].items()},
                                {k: v.to_local() if hasattr(v, "to_local") else v for k, v in model.state_dict().items()})
    stager.close()
    return out


def test_staging_memory_is_reused_across_saves():
    for res in run_ranks(staging_worker, 2):
        for name in ("app", "plain"):
            assert res[name]["count"] > 0 and res[name]["same_buffers"], (name, res)
        assert res["fresh"] == 0.0  # the reused buffers hold the new values


def named_parameters_worker(rank, world, path):
    model, _ = build()
    dcp.save(dict(model.named_parameters()), checkpoint_id=path)  # torch's default planner


def test_default_planner_refuses_the_dedicated_parameters_themselves(tmp_path):
    path = tmp_path / "params"
    with pytest.raises(RankFailed, match="is a dmuon dedicated parameter itself"):
        run_ranks(named_parameters_worker, 2, str(path))
    assert not (path / ".metadata").exists()


# ---------------------------------------------------------------------------------------------
# torch's dcp.save over a process group that is not the whole job
# ---------------------------------------------------------------------------------------------
def subgroup_save_worker(rank, world, root):
    import os

    import torch.distributed as dist

    model, opt = build()
    train(model, opt, rank, world, range(1))
    groups = [dist.new_group([r], backend="gloo") for r in range(world)]  # (every rank makes every group)
    path = f"{root}/rank{rank}"
    try:
        dcp.save({"app": ddcp.AppState(model, opt)}, checkpoint_id=path, planner=ddcp.DMuonSavePlanner(),
                 process_group=groups[rank])
    except BaseException as error:  # (torch raises CheckpointException, a BaseException)
        raised = f"{type(error).__name__}: {error}"
    else:
        raised = None
    committed = os.path.exists(f"{path}/.metadata")
    return {"raised": raised, "committed": committed}


def test_a_save_over_a_group_smaller_than_the_job_is_refused_before_anything_is_committed(tmp_path):
    results = run_ranks(subgroup_save_worker, 2, str(tmp_path))
    for result in results:
        assert result["raised"] is not None and not result["committed"], result
    # rank 1's group lacks what rank 0 writes for all (the keys held alike), rank 0's lacks
    # rank 1's dedicated weights: each is named
    assert "planned by none" in results[1]["raised"], results[1]["raised"]
    assert "written by ranks []" in results[0]["raised"], results[0]["raised"]
