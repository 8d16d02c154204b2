"""torchtitan 0.3.0's real CheckpointManager with dmuon.Muon on 2 CPU ranks (gloo)."""
import os
import pickle
from functools import partial

import pytest
import torch
from torch.distributed.checkpoint.stateful import Stateful

import dmuon
from tests.helpers.launch import run_ranks
from tests.helpers.training import build, check_bit_exact_resume, train

DEDICATED = "layers.0.q_proj.weight"


class TrainState(Stateful):
    def __init__(self, step: int = 0) -> None:
        self.step = step

    def state_dict(self):
        return {"step": self.step}

    def load_state_dict(self, state_dict):
        self.step = state_dict["step"]


class IdentityHFAdapter:
    """The smallest state-dict adapter torchtitan's HF export accepts: keys unchanged."""

    fqn_to_index_mapping = None
    hf_assets_path = None

    def to_hf(self, state_dict):
        return dict(state_dict)

    def from_hf(self, state_dict):
        return dict(state_dict)


def manager(folder, model, opt, train_state, sd_adapter=None, **config):
    from torchtitan.components.checkpoint import CheckpointManager

    from dmuon.integrations.torchtitan import MuonOptimizersContainer

    return CheckpointManager(
        CheckpointManager.Config(enable=True, folder=folder, **config),
        dataloader=None, model_parts=[model], optimizers=MuonOptimizersContainer([model], [opt]),
        lr_schedulers=None, states={"train_state": train_state}, sd_adapter=sd_adapter, base_folder="",
    )


def titan_save(model, opt, step, *, folder, async_mode):
    ckpt = manager(folder, model, opt, TrainState(step), interval=step, keep_latest_k=0, async_mode=async_mode)
    ckpt.save(step)
    ckpt.maybe_wait_for_saving()
    ckpt.close()


def titan_load(model, opt, *, folder, async_mode):
    state = TrainState()
    ckpt = manager(folder, model, opt, state, keep_latest_k=0, async_mode=async_mode)
    assert ckpt.load()
    ckpt.close()
    return state.step


@pytest.mark.parametrize("async_mode", ["disabled", "async"])
def test_resume_through_torchtitans_checkpoint_manager_is_bit_exact(tmp_path, async_mode):
    where = dict(folder=str(tmp_path / "ckpt"), async_mode=async_mode)
    check_bit_exact_resume(2, 1, partial(titan_save, **where), partial(titan_load, **where))


def retention_and_export_worker(rank, world, root):
    import torch.distributed as dist

    model, opt = build()
    state = TrainState()
    ckpt = manager(f"{root}/run", model, opt, state, interval=1, keep_latest_k=2,
                   last_save_model_only=True, export_dtype="bfloat16")
    for step in range(1, 6):
        state.step = step
        train(model, opt, rank, world, range(step - 1, step))
        ckpt.save(step, last_step=step == 5)
    ckpt.close()
    hf = manager(f"{root}/hf", model, opt, state, sd_adapter=IdentityHFAdapter(), interval=100,
                 keep_latest_k=0, last_save_model_only=True, last_save_in_hf=True, export_dtype="bfloat16")
    hf.save(5, last_step=True)
    hf.close()
    dist.barrier()
    return {k: v.to(torch.bfloat16) for k, v in dmuon.get_model_state_dict(model).items()}


def test_retention_keeps_the_newest_and_exports_hold_full_dedicated_weights(tmp_path):
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    want = run_ranks(retention_and_export_worker, 2, str(tmp_path))[0]
    # keep_latest_k=2 after the interval saves of steps 1-4; torchtitan does not purge after the
    # last-step export (step 5)
    assert sorted(os.listdir(tmp_path / "run")) == ["step-3", "step-4", "step-5"]
    metadata = pickle.loads((tmp_path / "run" / "step-5" / ".metadata").read_bytes())
    assert tuple(metadata.state_dict_metadata[DEDICATED].size) == (32, 32)
    dcp_to_torch_save(tmp_path / "run" / "step-5", tmp_path / "export.pt")
    exported = torch.load(tmp_path / "export.pt", weights_only=True)
    assert exported.keys() == want.keys()  # model only
    for key, value in want.items():
        assert exported[key].dtype == torch.bfloat16 and torch.equal(exported[key], value), key
    [hf_file] = [f for f in os.listdir(tmp_path / "hf" / "step-5") if f.endswith(".safetensors")]
    hf_weights = load_file(tmp_path / "hf" / "step-5" / hf_file)
    for key, value in want.items():
        assert torch.equal(hf_weights[key], value), key


def joint_clipping_worker(rank, world):
    """One step of the tiny MoE at EP 2 (stacks on (efsdp, ep), dense weights on 4 ranks, the
    proj matrices dedicated): the container's norm against every gradient gathered whole."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from dmuon.dedicated import get_registry
    from dmuon.integrations.torchtitan import MuonOptimizersContainer
    from tests.helpers import moe

    model, opt = moe.build(ep=2)
    gen = torch.Generator().manual_seed(7 + rank)
    tokens = torch.randint(0, moe.VOCAB, (2, moe.SEQ), generator=gen)
    logits = model(tokens[:, :-1])
    torch.nn.functional.cross_entropy(logits.reshape(-1, moe.VOCAB), tokens[:, 1:].reshape(-1)).backward()

    def whole_norm() -> float:
        squares = 0.0
        for param in model.parameters():
            if isinstance(param.grad, DTensor):
                squares += float(param.grad.full_tensor().double().pow(2).sum())
        owned = {rec.fqn: float(rec.master.grad.double().pow(2).sum())
                 for rec in get_registry(model) if rec.is_global_owner and rec.master.grad is not None}
        everyone = [None] * world
        dist.all_gather_object(everyone, owned)
        dedicated = {fqn: value for found in everyone for fqn, value in found.items()}
        assert len(dedicated) == len(get_registry(model).records)
        return (squares + sum(dedicated.values())) ** 0.5

    before = whole_norm()
    container = MuonOptimizersContainer([model], [opt], max_norm=before / 4)
    container.step()
    return before, float(container.grad_norm), whole_norm()


def test_joint_clipping_counts_every_gradient_once_across_meshes():
    """Gradients on two meshes and on their owners: one norm over all of them, each counted once
    (a norm per mesh, or a sharded one counted on every rank, would not match), then clipped."""
    for before, reported, after in run_ranks(joint_clipping_worker, 4):
        assert reported == pytest.approx(before, rel=1e-5)
        assert after == pytest.approx(before / 4, rel=1e-4)
