"""Save-plan caching: repeated saves of an unchanged layout reuse their plans, each save still
writes its own files and loads bit-exactly, a changed layout (a dtype) is planned afresh, and
caches that saw different saves fail loudly before anything is written."""
import os

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import dmuon
import dmuon.dcp as ddcp
from dmuon.dcp.errors import PlanCacheError
from dmuon.dcp.format.layout import METADATA, rank_of_data_file
from dmuon.dcp.plan_cache import SavePlanCache
from tests.helpers.launch import run_ranks
from tests.helpers.setup import max_abs_diff
from tests.helpers.training import build, train


def repeated_saves_worker(rank, world, root):
    model, opt = build()
    cache = SavePlanCache()
    expected = []
    for i in range(3):
        train(model, opt, rank, world, range(i, i + 1))
        ddcp.save(model, opt, f"{root}/step{i}", extra={"step": i}, plan_cache=cache)
        expected.append({"model": dmuon.get_model_state_dict(model, rank0_only=False),
                         "optim": dmuon.get_optimizer_state_dict(model, opt, rank0_only=False)})
    out = {"local_hits": cache.local_hits, "global_hits": cache.global_hits, "diffs": []}
    for i in range(3):  # every checkpoint holds the state at its own save, read from its own files
        fresh, fresh_opt = build()
        extra = ddcp.load(fresh, fresh_opt, f"{root}/step{i}")
        got = dmuon.get_model_state_dict(fresh, rank0_only=False)
        got_opt = dmuon.get_optimizer_state_dict(fresh, fresh_opt, rank0_only=False)
        diff = max_abs_diff(got, expected[i]["model"])
        for section in ("fsdp2", "dedicated"):
            for fqn, entry in expected[i]["optim"][section].items():
                diff = max(diff, max_abs_diff(got_opt[section][fqn], entry))
        out["diffs"].append((extra, diff))
    return out


def test_repeated_saves_reuse_plans_and_each_loads_bit_exactly(tmp_path):
    results = run_ranks(repeated_saves_worker, 2, str(tmp_path))
    assert [r["local_hits"] for r in results] == [2, 2]  # saves 2 and 3 sent no plan
    assert results[0]["global_hits"] == 2  # and the coordinator re-planned nothing
    for extra_and_diff in results[0]["diffs"]:
        assert extra_and_diff[1] == 0.0
    assert [extra for extra, _ in results[0]["diffs"]] == [{"step": 0}, {"step": 1}, {"step": 2}]
    # each save's metadata names data files of its own directory, and every one of them exists;
    # the steady saves keep the first save's names (in their own directories), each its own id
    from dmuon.dcp.checkpoint import open_checkpoint

    names, ids = [], set()
    for i in range(3):
        listing = open_checkpoint(str(tmp_path / f"step{i}"))
        files = {info.relative_path for info in listing.metadata.storage_data.values()}
        assert all(rank_of_data_file(name) is not None and (tmp_path / f"step{i}" / name).exists() for name in files)
        assert listing.verify_files() == []  # each file's trailer names its own save
        names.append(files)
        ids.add(listing.manifest.save_id)
    assert names[0] == names[1] == names[2] and len(ids) == 3


def dtype_change_worker(rank, world, root):
    model, _ = build()
    planner = ddcp.DMuonSavePlanner(plan_cache=SavePlanCache())
    state = model.state_dict()
    dcp.save(state, storage_writer=ddcp.DMuonStorageWriter(f"{root}/fp32"), planner=planner)
    bf16 = {k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}
    dcp.save(bf16, storage_writer=ddcp.DMuonStorageWriter(f"{root}/bf16"), planner=planner)
    return planner.plan_cache.local_hits


def test_a_changed_dtype_is_planned_afresh(tmp_path):
    from dmuon.dcp.checkpoint import open_checkpoint

    assert run_ranks(dtype_change_worker, 2, str(tmp_path)) == [0, 0]
    metadata = open_checkpoint(str(tmp_path / "bf16")).metadata.state_dict_metadata
    dtypes = {md.properties.dtype for md in metadata.values() if hasattr(md, "properties")}
    assert dtypes == {torch.bfloat16}


def out_of_step_worker(rank, world, root, kind):
    model, opt = build()
    checkpointer = ddcp.AsyncCheckpointer() if kind == "async" else ddcp.Checkpointer()
    checkpointer.save(model, opt, f"{root}/first").wait()
    if rank == 0:
        checkpointer.plan_cache.clear()  # the coordinator forgets; rank 1 still offers its cached plan
    out = {}
    try:
        checkpointer.save(model, opt, f"{root}/second").wait()
    except PlanCacheError as exc:  # the error's type, from the async save's writer thread too
        out["error"] = str(exc)
    out["cleared"] = checkpointer.plan_cache.token is None
    dist.barrier()
    out["second_files"] = sorted(os.listdir(f"{root}/second")) if os.path.exists(f"{root}/second") else []
    # the failed save cleared the caches on every rank: the next save plans in full and works
    checkpointer.save(model, opt, f"{root}/third").wait()
    checkpointer.close()
    fresh, fresh_opt = build()
    ddcp.load(fresh, fresh_opt, f"{root}/third")
    out["diff"] = max_abs_diff(dmuon.get_model_state_dict(fresh, rank0_only=False),
                               dmuon.get_model_state_dict(model, rank0_only=False))
    return out


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_caches_out_of_step_fail_before_writing_and_recover(tmp_path, kind):
    results = run_ranks(out_of_step_worker, 2, str(tmp_path), kind)
    for res in results:
        assert "ranks [1]" in res["error"] and "clear()" in res["error"] and res["cleared"]
        assert METADATA not in res["second_files"]
        assert not [name for name in res["second_files"] if rank_of_data_file(name) is not None]
        assert res["diff"] == 0.0


def async_cache_worker(rank, world, root):
    model, opt = build()
    checkpointer = ddcp.AsyncCheckpointer()
    for i in range(3):
        train(model, opt, rank, world, range(i, i + 1))
        checkpointer.save(model, opt, f"{root}/step{i}").wait()
    want = dmuon.get_model_state_dict(model, rank0_only=False)
    hits = checkpointer.plan_cache.local_hits
    checkpointer.close()
    fresh, fresh_opt = build()
    ddcp.load(fresh, fresh_opt, f"{root}/step2")
    return {"hits": hits, "diff": max_abs_diff(dmuon.get_model_state_dict(fresh, rank0_only=False), want)}


@pytest.mark.parametrize("world", [2])
def test_async_saves_reuse_plans(tmp_path, world):
    for res in run_ranks(async_cache_worker, world, str(tmp_path)):
        assert res == {"hits": 2, "diff": 0.0}
