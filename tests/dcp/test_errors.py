"""Bad checkpoints and wrong models give clear errors and change nothing."""
import os
import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp

import dmuon
import dmuon.dcp as ddcp
from tests.helpers.launch import RankFailed, run_ranks
from tests.helpers.models import TinyTransformer, proj_predicate
from tests.helpers.setup import max_abs_diff
from tests.helpers.training import build, train


def save_worker(rank, world, path):
    model, opt = build()
    train(model, opt, rank, world, range(2))
    ddcp.save(model, opt, path, extra={"step": 2})
    return dmuon.get_model_state_dict(model)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("errors") / "ckpt")
    return path, run_ranks(save_worker, 2, path)[0]


class ExtraLayer(TinyTransformer):
    def __init__(self):
        super().__init__()
        self.extra_head = torch.nn.Linear(32, 8)


def wrong_model_worker(rank, world, path, variant):
    if variant == "extra_layer":
        model, opt = build(model_cls=ExtraLayer)
    elif variant == "wrong_shape":
        model, opt = build(hidden=40)  # up_proj / down_proj change shape
    else:  # wrong dtype on an FSDP2 and on a dedicated parameter
        torch.manual_seed(0)
        model = TinyTransformer()
        model.layers[0].attn_norm.double()
        model.layers[1].q_proj.double()
        from tests.helpers.setup import make_mesh, shard_model

        _, opt = shard_model(model, make_mesh(), proj_predicate)
    before = (dmuon.get_model_state_dict(model, rank0_only=False),
              dmuon.get_optimizer_state_dict(model, opt, rank0_only=False))
    try:
        ddcp.load(model, opt, path)
        error = None
    except ddcp.CheckpointMismatchError as exc:
        error = str(exc)
    after = (dmuon.get_model_state_dict(model, rank0_only=False),
             dmuon.get_optimizer_state_dict(model, opt, rank0_only=False))
    unchanged = max_abs_diff(before[0], after[0]) == 0.0 and all(
        max_abs_diff(before[1][s][k], after[1][s][k]) == 0.0 for s in ("fsdp2", "dedicated") for k in before[1][s])
    return {"error": error, "unchanged": unchanged}


@pytest.mark.parametrize("variant,keys", [
    ("extra_layer", ["model.extra_head.weight", "model.extra_head.bias", "optim.state.extra_head.weight.exp_avg"]),
    ("wrong_shape", ["model.layers.0.up_proj.weight", "model.layers.1.down_proj.weight",
                     "optim.state.layers.0.up_proj.weight.momentum_buffer"]),
    ("wrong_dtype", ["model.layers.0.attn_norm.weight", "model.layers.1.q_proj.weight"]),
])
def test_wrong_model_one_error_naming_keys_and_nothing_changes(saved, variant, keys):
    path, _ = saved
    for res in run_ranks(wrong_model_worker, 2, path, variant):
        assert res["error"] is not None, variant
        for key in keys:
            assert key in res["error"], (key, res["error"])
        assert "nothing was loaded" in res["error"]
        assert res["unchanged"]
    if variant == "wrong_dtype":
        assert "float64 in the model" in res["error"] and "float32 in the checkpoint" in res["error"]


def load_worker(rank, world, path):
    model, opt = build()
    return ddcp.load(model, opt, path)


def test_incomplete_checkpoint_is_refused(saved, tmp_path):
    import shutil

    path, _ = saved
    broken = tmp_path / "broken"
    shutil.copytree(path, broken)
    os.remove(broken / ".metadata")
    with pytest.raises(RankFailed, match="incomplete: it has no .metadata"):
        run_ranks(load_worker, 2, str(broken))
    with pytest.raises(ddcp.CheckpointIncompleteError):
        ddcp.DMuonStorageReader(str(broken)).read_metadata()
    with pytest.raises(ddcp.CheckpointNotFoundError):
        ddcp.DMuonStorageReader(str(tmp_path / "nothing-here")).read_metadata()


def test_corrupted_data_file_names_the_file(saved, tmp_path):
    import shutil

    path, _ = saved
    broken = tmp_path / "corrupt"
    shutil.copytree(path, broken)
    data_file = sorted(p for p in os.listdir(broken) if p.endswith(".distcp"))[1]
    raw = bytearray((broken / data_file).read_bytes())
    raw[len(raw) // 2] ^= 0x40
    (broken / data_file).write_bytes(bytes(raw))
    with pytest.raises(RankFailed, match=rf"checksum mismatch in .*{data_file}"):
        run_ranks(load_worker, 2, str(broken))


def test_good_checkpoint_loads_and_returns_extra(saved):
    path, _ = saved
    assert run_ranks(load_worker, 2, path) == [{"step": 2}, {"step": 2}]


def overwrite_worker(rank, world, path):
    model, opt = build()
    outcome = {}
    try:
        ddcp.save(model, opt, path)
        outcome["plain"] = "saved"
    except ddcp.CheckpointExistsError as exc:
        outcome["plain"] = str(exc)
    train(model, opt, rank, world, range(1))
    ddcp.save(model, opt, path, overwrite=True, extra={"step": 1})
    outcome["files"] = sorted(os.listdir(path))
    fresh, fresh_opt = build()
    outcome["extra"] = ddcp.load(fresh, fresh_opt, path)
    fresh_sd, trained_sd = dmuon.get_model_state_dict(fresh), dmuon.get_model_state_dict(model)
    outcome["equal"] = max_abs_diff(fresh_sd, trained_sd) if rank == 0 else 0.0
    return outcome


def test_overwrite_needs_opt_in_and_replaces_cleanly(saved, tmp_path):
    import shutil

    path, _ = saved
    target = tmp_path / "ow"
    shutil.copytree(path, target)
    res = run_ranks(overwrite_worker, 2, str(target))[0]
    assert "already holds a committed checkpoint" in res["plain"]
    assert res["extra"] == {"step": 1} and res["equal"] == 0.0
    manifests = [f for f in res["files"] if f.startswith(".dmuon-manifest-")]
    data = [f for f in res["files"] if f.endswith(".distcp")]
    assert len(manifests) == 1 and len(data) == 2  # the old save's files were collected
    save_id = manifests[0][len(".dmuon-manifest-"):-len(".json")]
    assert all(save_id in f for f in data)


def plain_state_dict_worker(rank, world, path, phase):
    """torch's own dcp.save/load of a plain model.state_dict() with dmuon's planners."""
    model, opt = build()
    if phase == "save":
        train(model, opt, rank, world, range(2))
        dcp.save({"model": model.state_dict()}, checkpoint_id=path, planner=ddcp.DMuonSavePlanner())
    else:
        state = {"model": model.state_dict()}
        dcp.load(state, checkpoint_id=path, planner=ddcp.DMuonLoadPlanner())
        model.load_state_dict(state["model"])  # placeholders stay placeholders; masters were filled
    return dmuon.get_model_state_dict(model)


def test_plain_model_state_dict_works_with_the_planners(tmp_path):
    path = str(tmp_path / "plain")
    saved = run_ranks(plain_state_dict_worker, 2, path, "save")[0]
    md = pickle.loads((tmp_path / "plain" / ".metadata").read_bytes())
    q = md.state_dict_metadata["model.layers.0.q_proj.weight"]
    assert tuple(q.size) == (32, 32), "a placeholder must never be what gets written"
    loaded = run_ranks(plain_state_dict_worker, 2, path, "load")[0]
    assert max_abs_diff(loaded, saved) == 0.0


def missing_embedding_worker(rank, world, path, models):
    """A model without the checkpoint's embedding: no rank holds that key."""
    model, _ = build()
    state = {"model": model.state_dict()}
    del state["model"]["embed.weight"]
    planner = ddcp.DMuonLoadPlanner(models={"model": model} if models else None)
    try:
        dcp.load(state, checkpoint_id=path, planner=planner)
    except BaseException as exc:  # noqa: BLE001 - DCP raises a BaseException
        return str(exc)
    return None


@pytest.mark.parametrize("models", [False, True], ids=["from-the-plans", "from-the-caller"])
def test_a_checkpoint_key_no_rank_holds_is_refused_and_dedicated_ones_are_not(tmp_path, models):
    path = str(tmp_path / "plain")
    run_ranks(plain_state_dict_worker, 2, path, "save")
    for message in run_ranks(missing_embedding_worker, 2, path, models):
        assert message is not None and "CheckpointMismatchError" in message
        assert "model.embed.weight: in the checkpoint but not in the model" in message
        assert "proj.weight" not in message  # held by one rank only: a dedicated weight, not extra


def test_default_planner_refuses_an_app_state_before_writing(tmp_path):
    with pytest.raises(RankFailed, match=r"save it with planner=dmuon\.dcp\.DMuonSavePlanner\(\)"):
        run_ranks(default_planner_worker, 2, str(tmp_path / "x"))
    assert not (tmp_path / "x" / ".metadata").exists()
    assert not list((tmp_path / "x").glob("*.distcp")) if (tmp_path / "x").exists() else True


def default_planner_worker(rank, world, path):
    model, opt = build()
    dcp.save(ddcp.AppState(model, opt).state_dict(), checkpoint_id=path)
