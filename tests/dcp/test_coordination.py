"""What a save and a load ask of the other ranks, counted from outside (issue 35, items 1-2).

Every ``torch.distributed`` collective a rank calls is wrapped to record its name and the
pickled size of what the rank puts in. A save of a layout saved before (the plan cache's case)
must gather nothing: three all-reduces of a few integers (the last: did the commit fail); a load
from a local path on one machine likewise; and what they write stays readable by torch's own
reader.
"""

import os

import torch
import torch.distributed.checkpoint as dcp

import dmuon
import dmuon.dcp as ddcp
from dmuon.dcp.checkpoint import open_checkpoint
from dmuon.dcp.format.layout import METADATA
from tests.helpers.collectives import count_collectives as _count_collectives
from tests.helpers.collectives import names as _names
from tests.helpers.launch import run_ranks
from tests.helpers.setup import max_abs_diff
from tests.helpers.training import build, train

def counted_worker(rank, world, root):
    log: list = []
    model, opt = build()
    train(model, opt, rank, world, range(1))
    checkpointer = ddcp.Checkpointer()
    checkpointer.save(model, opt, f"{root}/first", extra={"note": "a"})
    train(model, opt, rank, world, range(1, 2))
    _count_collectives(log)
    checkpointer.save(model, opt, f"{root}/steady", extra={"note": "b"})
    steady = list(log)
    expected = dmuon.get_model_state_dict(model, rank0_only=False)
    log.clear()
    checkpointer.save(model, opt, f"{root}/grown", extra={"note": "longer " * 200})
    grown = list(log)
    fresh, fresh_opt = build()
    log.clear()
    extra = checkpointer.load(fresh, fresh_opt, f"{root}/steady")
    load = list(log)
    diff = max_abs_diff(dmuon.get_model_state_dict(fresh, rank0_only=False), expected)
    grown_extra = checkpointer.load(fresh, fresh_opt, f"{root}/grown")
    checkpointer.close()
    if rank == 0:
        torch.save(expected, f"{root}/expected.pt")
    return {
        "steady": steady,
        "grown": grown,
        "load": load,
        "diff": diff,
        "extra": extra,
        "grown_extra": grown_extra,
        "hits": checkpointer.plan_cache.global_hits,
    }


def test_a_steady_save_and_a_load_gather_nothing_and_stay_readable_by_torch(tmp_path):
    results = run_ranks(counted_worker, 4, str(tmp_path))
    for rank, result in enumerate(results):
        # the steady save: a few integers, twice, and the commit's outcome from the coordinator
        assert _names(result["steady"]) == ["all_reduce"] * 3, result["steady"]
        # an object entry that grew: the write results are gathered, no plan is
        assert "scatter_object_list" not in _names(result["grown"]) and "gather_object" in _names(result["grown"])
        # the load: open_once's broadcast of the small files, two all-reduces, no gather
        assert not set(_names(result["load"])) & {"gather_object", "scatter_object_list", "all_gather_object"}
        assert _names(result["load"]).count("broadcast_object_list") == 1, result["load"]
        assert result["diff"] == 0.0 and result["extra"] == {"note": "b"}
        assert result["grown_extra"] == {"note": "longer " * 200}
    assert results[0]["hits"] == 1  # the coordinator reused the plans and metadata once
    # open_once sends .metadata's bytes compressed, not the decoded Metadata pickled again
    (sent,) = [size for name, size in results[0]["load"] if name == "broadcast_object_list"]
    assert 0 < sent < os.path.getsize(tmp_path / "steady" / METADATA) / 3
    # torch's own reader reads the steady save (its data files end in checksum trailers)
    listing = open_checkpoint(str(tmp_path / "steady"))
    assert listing.manifest.version == "dmuon-manifest/4"
    expected = torch.load(tmp_path / "expected.pt")
    state = {f"model.{fqn}": torch.empty_like(value) for fqn, value in expected.items()}
    dcp.load(state, storage_reader=dcp.FileSystemReader(str(tmp_path / "steady")), no_dist=True)
    assert max_abs_diff({k[len("model.") :]: v for k, v in state.items()}, expected) == 0.0
    assert listing.verify_files() == []
    assert os.path.exists(tmp_path / "grown" / ".metadata")


def again_worker(rank, world, root):
    model, opt = build()
    checkpointer = ddcp.Checkpointer()
    log: list = []
    checkpointer.save(model, opt, f"{root}/a")
    train(model, opt, rank, world, range(1))
    _count_collectives(log)
    checkpointer.save(model, opt, f"{root}/a", overwrite=True)  # the same directory: new names
    again = list(log)
    log.clear()
    checkpointer.save(model, opt, f"{root}/b")  # a new one: steady, with the names of a's last save
    steady = list(log)
    expected = dmuon.get_model_state_dict(model, rank0_only=False)
    diffs = []
    for name in ("a", "b"):
        fresh, fresh_opt = build()
        checkpointer.load(fresh, fresh_opt, f"{root}/{name}")
        diffs.append(max_abs_diff(dmuon.get_model_state_dict(fresh, rank0_only=False), expected))
    return {"again": _names(again), "steady": _names(steady), "diffs": diffs}


def test_a_steady_save_commits_the_same_metadata_bytes_and_never_overwrites_a_commit(tmp_path):
    """A steady save keeps its files' names, so its .metadata is the previous commit's bytes,
    unedited (no URL or save id is pickled: the manifest and each file's trailer name the save);
    saving the same directory again names the files afresh, so no file of the committed save is
    written over."""

    results = run_ranks(counted_worker, 2, str(tmp_path / "counted"))
    first, steady = (open_checkpoint(str(tmp_path / "counted" / name)) for name in ("first", "steady"))
    assert (tmp_path / "counted" / "first" / METADATA).read_bytes() == (
        tmp_path / "counted" / "steady" / METADATA).read_bytes()
    assert set(first.manifest.files) == set(steady.manifest.files)  # the same names, other directories
    assert first.manifest.save_id != steady.manifest.save_id
    assert steady.metadata.storage_meta is None or steady.metadata.storage_meta.checkpoint_id is None
    assert results[0]["hits"] == 1
    results = run_ranks(again_worker, 2, str(tmp_path / "again"))
    a, b = (open_checkpoint(str(tmp_path / "again" / name)) for name in ("a", "b"))
    for result in results:
        assert "gather_object" in result["again"]  # not steady: the names had to change
        assert result["steady"] == ["all_reduce"] * 3
        assert result["diffs"] == [0.0, 0.0]
    assert set(a.manifest.files) == set(b.manifest.files)
    assert sorted(p.name for p in (tmp_path / "again" / "a").glob("*.distcp")) == sorted(a.manifest.files)
    assert a.verify_files() == [] and b.verify_files() == []


def replica_plans_worker(rank, world, root):
    model, opt = build(replicate=2)
    train(model, opt, rank, world, range(1))
    checkpointer = ddcp.Checkpointer()
    checkpointer.save(model, opt, root)
    expected = dmuon.get_model_state_dict(model, rank0_only=False)
    fresh, fresh_opt = build(replicate=2)
    checkpointer.load(fresh, fresh_opt, root)
    diff = max_abs_diff(dmuon.get_model_state_dict(fresh, rank0_only=False), expected)
    items = [(item.index.fqn, tuple(item.index.offset or ())) for item in checkpointer.plan_cache.local_plan.items]
    return {"items": items, "diff": diff}


def test_hsdp_replicas_plan_each_chunk_once_between_them(tmp_path):
    """HSDP 2x2: a sharded tensor's chunk is held by both replicas; one of them plans it (chosen
    alike on every rank), so the coordinator gathers no copies to de-duplicate. So do the
    entries every rank holds alike (AdamW's step counts, the hyper-parameters: the AppState
    says which). What is left to the coordinator: plain model tensors (nothing guarantees that
    every rank holds them alike)."""
    results = run_ranks(replica_plans_worker, 4, str(tmp_path / "ckpt"))
    assert all(r["diff"] == 0.0 for r in results)
    offered = [chunk for r in results for chunk in r["items"]]
    from collections import Counter

    twice = sorted(chunk for chunk, count in Counter(offered).items() if count > 1)
    assert all(fqn == "model.logit_scale" for fqn, _ in twice), twice  # (a plain tensor of the model)
    assert any(fqn.endswith(".step") for fqn, _ in offered) and any("param_groups" in fqn for fqn, _ in offered)
    # the replicas share the work: ranks 0-1 form one replica, 2-3 the other (make_mesh's order)
    assert all(results[rank]["items"] for rank in range(4))
