"""Expert stacks through every checkpoint door, restored exactly when the expert-parallel or
data-parallel degree changes.

A tiny MoE (``tests/helpers/moe.py``: two stacks per layer, per-expert Muon, dense matrices
dedicated) trains with expert parallelism 2 over 4 ranks (experts are ``_StridedShard``
DTensors over ``efsdp`` x ``ep``) and saves through ``dmuon.dcp.save``, torch's ``dcp.save``
of ``model.state_dict()``, torch's ``dcp.async_save`` and a ``CheckpointManager``. Each checkpoint holds the stacks and
their momentum under the model's names, whole. The ``dmuon.dcp`` one loads at EP 1 on 4 and 2
ranks, EP 2 on 2 ranks and EP 4, and a checkpoint written at EP 1 loads at EP 2: after each
load the job saves again and every weight and momentum is bit for bit the one saved. A job
resumed at the same layout trains on as the uninterrupted one, bit for bit; at EP 1 within
float rounding. Plain torch reads the model, and the export writes the stacks as the model
names them.
"""
import pytest
import torch

from tests.helpers.launch import run_ranks

STEPS, SAVED_AT = 4, 2


def moe_worker(rank, world, ep, folder, *, experts=8, save=False, load_from=None, tag="", manager=False):
    import torch.distributed.checkpoint as torch_dcp

    import dmuon.dcp as ddcp
    from tests.helpers import moe

    model, opt = moe.build(ep, experts)
    losses = []
    if manager:  # the manager's door: resume the newest step of a run
        assert ddcp.CheckpointManager(f"{folder}/run-ep2").resume(model, opt) == SAVED_AT
        ddcp.save(model, opt, f"{folder}/reloaded-{tag}")
        return losses
    if load_from is not None:
        ddcp.load(model, opt, f"{folder}/{load_from}")
        ddcp.save(model, opt, f"{folder}/reloaded-{tag}")
        losses = moe.train(model, opt, STEPS - SAVED_AT, start=SAVED_AT)
        return losses
    losses = moe.train(model, opt, SAVED_AT)
    if save:
        ddcp.save(model, opt, f"{folder}/ddcp-{tag}")
        torch_dcp.save({"model": model.state_dict()}, checkpoint_id=f"{folder}/torch-{tag}")
        pending = torch_dcp.async_save({"model": model.state_dict()}, checkpoint_id=f"{folder}/async-{tag}")
        pending.result()
        if tag == "ep2":
            ddcp.CheckpointManager(f"{folder}/run-ep2").save(SAVED_AT, model, opt).wait()
    return losses + moe.train(model, opt, STEPS - SAVED_AT, start=SAVED_AT)


def read_back(folder, name, prefixes=("model.",), suffix=".momentum_buffer"):
    """A checkpoint's model (and momentum) tensors, read in this one process with torch's reader."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    path = f"{folder}/{name}"
    metadata = FileSystemReader(path).read_metadata()
    wanted = {
        key: torch.empty(md.size, dtype=md.properties.dtype)
        for key, md in metadata.state_dict_metadata.items()
        if hasattr(md, "size") and (key.startswith(prefixes) or key.endswith(suffix))
    }
    dcp.load(wanted, storage_reader=FileSystemReader(path), no_dist=True)
    return wanted


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    folder = tmp_path_factory.mktemp("moe")
    losses = run_ranks(moe_worker, 4, 2, str(folder), save=True, tag="ep2", timeout=120)
    uneven = run_ranks(moe_worker, 4, 2, str(folder), experts=6, save=True, tag="ep2-6", timeout=120)
    ep1 = run_ranks(moe_worker, 4, 1, str(folder), save=True, tag="ep1", timeout=120)
    return folder, losses, uneven, ep1


def test_every_door_writes_the_stacks_whole_under_their_model_names(saved):
    folder, _, _, _ = saved
    ours = read_back(folder, "ddcp-ep2")
    stacks = [key for key in ours if ".experts." in key and not key.endswith("momentum_buffer")]
    assert len(stacks) == 4 and all(ours[key].shape[0] == 8 for key in stacks)
    assert all(f"optim.state.{key[len('model.'):]}.momentum_buffer" in ours for key in stacks)
    for door in ("torch-ep2", "async-ep2"):
        theirs = read_back(folder, door)
        for key in (k for k in ours if k.startswith("model.")):
            assert torch.equal(theirs[key], ours[key]), (door, key)


def test_plain_torch_reads_the_model_and_the_export_names_the_stacks(saved, tmp_path):
    import torch.distributed.checkpoint as dcp

    import dmuon.dcp as ddcp
    from tests.helpers.moe import TinyMoE

    folder, _, _, _ = saved
    plain = TinyMoE()
    state = {"model": plain.state_dict()}
    dcp.load(state, checkpoint_id=str(folder / "ddcp-ep2"), no_dist=True)
    ours = read_back(folder, "ddcp-ep2")
    for key, value in plain.state_dict().items():
        assert torch.equal(value, ours[f"model.{key}"]), key
    for fmt, name in (("torch", "model.pt"), ("safetensors", "hf")):
        files = ddcp.export(str(folder / "ddcp-ep2"), str(tmp_path / name), format=fmt)
        if fmt == "torch":
            exported = torch.load(files[0], weights_only=True)
        else:
            from safetensors.torch import load_file

            exported = {k: v for f in files if f.endswith(".safetensors") for k, v in load_file(f).items()}
        assert exported.keys() == plain.state_dict().keys(), fmt
        for key, value in exported.items():
            assert torch.equal(value, ours[f"model.{key}"]), (fmt, key)


@pytest.mark.parametrize(
    "source,world,ep,experts",
    [("ep2", 4, 1, 8), ("ep2", 2, 1, 8), ("ep2", 2, 2, 8), ("ep2", 4, 4, 8), ("ep1", 4, 2, 8), ("ep2-6", 4, 1, 6)],
    ids=["ep2-to-ep1", "ep2-to-fsdp2", "ep2-to-ep2-efsdp1", "ep2-to-ep4", "ep1-to-ep2", "uneven-ep2-to-ep1"],
)
def test_weights_and_momentum_restore_exactly_at_another_degree(saved, source, world, ep, experts):
    folder, losses, uneven, ep1 = saved
    tag = f"{source}-to-{world}x{ep}"
    resumed = run_ranks(moe_worker, world, ep, str(folder), experts=experts, load_from=f"ddcp-{source}", tag=tag,
                        timeout=120)
    before, after = read_back(folder, f"ddcp-{source}"), read_back(folder, f"reloaded-{tag}")
    assert before.keys() == after.keys()
    for key, value in before.items():
        assert torch.equal(after[key], value), key
    uninterrupted = {"ep2": losses, "ep1": ep1, "ep2-6": uneven}[source][0][SAVED_AT:]
    if world == 4:  # the same data per rank: training goes on as it would have
        torch.testing.assert_close(resumed[0], uninterrupted, rtol=1e-5, atol=1e-5)


def test_the_manager_resumes_a_run_at_another_expert_parallel_degree(saved):
    folder, _, _, _ = saved
    run_ranks(moe_worker, 4, 1, str(folder), manager=True, tag="manager", timeout=120)
    before, after = read_back(folder, "ddcp-ep2"), read_back(folder, "reloaded-manager")
    for key, value in before.items():
        assert torch.equal(after[key], value), key


def test_a_resume_at_the_same_layout_is_bit_exact(saved):
    folder, losses, _, _ = saved
    resumed = run_ranks(moe_worker, 4, 2, str(folder), load_from="ddcp-ep2", tag="same", timeout=120)
    for rank in range(4):
        assert resumed[rank] == losses[rank][SAVED_AT:]


def test_an_expert_parallel_job_restores_on_fewer_data_parallel_ranks(tmp_path):
    """EP 2 x efsdp 4 on 8 ranks (one expert per rank, dense matrices owned over 8) saved; loaded
    at EP 2 x efsdp 2 on 4 ranks: FSDP 4 -> 2 within the expert-parallel job, model and momentum
    exact."""
    run_ranks(moe_worker, 8, 2, str(tmp_path), save=True, tag="ep2-8", timeout=180)
    run_ranks(moe_worker, 4, 2, str(tmp_path), load_from="ddcp-ep2-8", tag="ep2-8-to-4", timeout=120)
    before, after = read_back(tmp_path, "ddcp-ep2-8"), read_back(tmp_path, "reloaded-ep2-8-to-4")
    assert before.keys() == after.keys() and any(key.endswith(".momentum_buffer") for key in before)
    for key, value in before.items():
        assert torch.equal(after[key], value), key
