"""Expert stacks: Muon per expert, whatever the layout, each expert orthogonalised once per job.

The reference is the plainest one: the same experts held as separate 2-D parameters, updated by
a single-process Muon (``tests/helpers/reference.py``), with the same gradients. Every layout
FSDP2 and expert parallelism give a stack is run on real gloo ranks: experts sharded unevenly,
replicated (HSDP), cut along their rows (fewer experts than ranks), and sharded over an
expert-parallel and a data-parallel dimension at once (DTensor's strided shard).
"""
import math

import pytest
import torch
from torch import nn

import dmuon
from dmuon.dedicated import get_registry
from dmuon.optim.expert_stacks import StackLayoutError, plan_stacks
from dmuon.optim.homes import newton_schulz_cost
from tests.helpers.launch import run_ranks
from tests.helpers.reference import HPARAMS, ReferenceOptimizer

STEPS = 3


class Experts(nn.Module):
    """A stack of expert matrices and a dense matrix beside it, as an MoE layer holds them."""

    def __init__(self, experts: int, rows: int, cols: int) -> None:
        super().__init__()
        self.num_experts = experts
        self.w = nn.Parameter(torch.randn(experts, rows, cols) / math.sqrt(cols))
        self.dense = nn.Parameter(torch.randn(rows, cols) / math.sqrt(cols))


def stacks_only(fqn, param):
    return fqn.endswith(".w") or fqn == "w"


def expert_grads(step: int, shape) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(1000 + step))


def reference_run(w0: torch.Tensor, steps: int = STEPS) -> torch.Tensor:
    """The experts as separate 2-D parameters, single-process Muon."""
    separate = nn.ParameterDict({str(e): nn.Parameter(w0[e].clone()) for e in range(w0.shape[0])})
    ref = ReferenceOptimizer(separate, set(separate))
    for step in range(steps):
        grads = expert_grads(step, w0.shape)
        for e, param in separate.items():
            param.grad = grads[int(e)].clone()
        ref.step()
    return torch.stack([separate[str(e)].detach() for e in range(w0.shape[0])])


def test_a_stack_is_updated_as_its_experts_alone_and_not_as_one_flattened_matrix():
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        from torch.distributed.device_mesh import init_device_mesh

        torch.manual_seed(0)
        mesh = init_device_mesh("cpu", (1,))
        stacked, flattened = Experts(4, 48, 32), Experts(4, 48, 32)
        flattened.load_state_dict(stacked.state_dict())
        w0 = stacked.w.detach().clone()
        separate = nn.ParameterDict({str(e): nn.Parameter(w0[e].clone()) for e in range(4)})
        dmuon.dedicate_params(separate, mesh, lambda f, p: True)  # dmuon's own 2-D path
        dmuon.dedicate_params(stacked, mesh, lambda f, p: False, expert_stacks=stacks_only)
        # the convolution convention, still there for a 3-D weight that is one matrix: flattened
        del flattened.num_experts  # (a module that says it holds experts is refused that way)
        dmuon.dedicate_params(flattened, mesh, lambda f, p: f == "w")
        optimizers = [dmuon.Muon(m, **HPARAMS) for m in (stacked, flattened, separate)]
        for step in range(STEPS):
            grads = expert_grads(step, w0.shape)
            stacked.w.grad = grads.clone()
            get_registry(flattened).records["w"].held_master.grad = grads.clone()
            for e, rec in get_registry(separate).records.items():
                rec.held_master.grad = grads[int(e)].clone()
            for opt in optimizers:
                opt.step()
        alone = dmuon.get_model_state_dict(separate)
        # bit for bit the 2-D update of each expert: batched, one call for the four
        assert torch.equal(stacked.w.detach(), torch.stack([alone[str(e)] for e in range(4)]))
        expected = reference_run(w0)  # and an independent single-process Muon agrees
        torch.testing.assert_close(stacked.w.detach(), expected, rtol=1e-6, atol=1e-6)
        flat_w = dmuon.get_model_state_dict(flattened)["w"]
        assert (flat_w - expected).abs().max() > 1e-3  # the convolution convention differs
    finally:
        dist.destroy_process_group()


def test_a_module_s_experts_named_by_the_predicate_alone_are_refused_not_flattened():
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        from torch.distributed.device_mesh import init_device_mesh

        with pytest.raises(ValueError, match=r"'w'.*holds 4 experts.*expert_stacks="):
            dmuon.dedicate_params(Experts(4, 8, 8), init_device_mesh("cpu", (1,)), lambda f, p: p.ndim >= 2)
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------
# the layouts, on real ranks
# ---------------------------------------------------------------------------------------------
def _local_grad(param, full: torch.Tensor):
    """``full`` laid out as ``param`` is (found by content where DTensor cannot place it)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    from dmuon import compat

    if not any(compat.is_strided_shard(p) for p in param.placements):
        return distribute_tensor(full, param.device_mesh, param.placements)
    whole, local = param.full_tensor(), param.to_local()
    index = [next(e for e in range(whole.shape[0]) if torch.equal(whole[e], local[j])) for j in range(local.shape[0])]
    return DTensor.from_local(full[index], param.device_mesh, param.placements, shape=full.shape, stride=full.stride())


def layout_worker(rank, world, layout, experts, rows, cols):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor

    torch.manual_seed(0)
    model = Experts(experts, rows, cols)
    w0 = model.w.detach().clone()
    dense0 = model.dense.detach().clone()
    if layout == "ep":
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("efsdp", "ep"))
        dmuon.dedicate_params(model, mesh._flatten("dp"), lambda f, p: f == "dense", expert_stacks=stacks_only)
        model.w = nn.Parameter(distribute_tensor(model.w.detach(), mesh["ep"], [Shard(0)]))
        fully_shard(model, mesh=mesh["efsdp"])
    elif layout.startswith("hsdp"):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        dmuon.dedicate_params(model, mesh, lambda f, p: f == "dense", expert_stacks=stacks_only)
        rows_cut = layout == "hsdp_rows"
        fully_shard(model, mesh=mesh, shard_placement_fn=(lambda p: Shard(1)) if rows_cut else None)
    else:
        mesh = init_device_mesh("cpu", (world,))
        dmuon.dedicate_params(model, mesh, lambda f, p: f == "dense", expert_stacks=stacks_only)
        fully_shard(model, mesh=mesh, shard_placement_fn=(lambda p: Shard(1)) if layout == "rows" else None)
    opt = dmuon.Muon(model, **HPARAMS)
    plan = opt.stack_plans[id(model.w)]
    for step in range(STEPS):
        model.w.grad = _local_grad(model.w, expert_grads(step, w0.shape))
        opt.step()
    counts = torch.tensor([len(plan.mine())])
    dist.all_reduce(counts)
    return {
        "placements": [repr(p) for p in model.w.placements],
        "w": model.w.full_tensor(),
        "w0": w0,
        "dense0": dense0,
        "orthogonalised": int(counts.item()),
        "momentum": opt.state[model.w]["momentum_buffer"].full_tensor(),
    }


LAYOUTS = {
    # layout: (ranks, experts, rows, cols, a placement the run must show)
    "fsdp_uneven": (4, 6, 24, 16, "Shard(dim=0)"),
    "hsdp": (4, 6, 24, 16, "Replicate()"),
    "rows": (4, 2, 32, 16, "Shard(dim=1)"),  # (FSDP2 cuts dims past 0 evenly only)
    "hsdp_rows": (4, 3, 18, 24, "Shard(dim=1)"),
    "ep": (4, 8, 16, 24, "_StridedShard(dim=0, sf=2)"),
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_every_layout_updates_each_expert_as_its_own_matrix_once_in_the_job(layout):
    world, experts, rows, cols, placement = LAYOUTS[layout]
    out = run_ranks(layout_worker, world, layout, experts, rows, cols, timeout=90)
    assert placement in out[0]["placements"], out[0]["placements"]
    expected = reference_run(out[0]["w0"])
    for rank in range(world):
        # the same math, in another order of floating-point sums only where a DTensor moved data
        torch.testing.assert_close(out[rank]["w"], expected, rtol=1e-6, atol=1e-6)
        assert torch.equal(out[rank]["w"], out[0]["w"])
    assert out[0]["orthogonalised"] == experts  # every expert once, on one rank of the job


def test_plans_spread_experts_by_cost_and_refuse_partial_sums():
    plans = plan_stacks([("a", torch.zeros(4, 8, 16))])
    assert plans["a"].mine() == [0, 1, 2, 3]  # a plain tensor: every expert here
    assert newton_schulz_cost(8, 16) == newton_schulz_cost(16, 8) == 8 * 8 * 16
    with pytest.raises(StackLayoutError, match="'b' has shape"):
        plan_stacks([("b", torch.zeros(4, 8))])


def per_layer_meshes_worker(rank, world):
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Shard, distribute_tensor

    stacks = []
    for layer in range(4):  # a mesh object per layer over the same ranks, as fully_shard per block makes
        mesh = DeviceMesh("cpu", list(range(world)))
        stacks.append((f"layers.{layer}.w", distribute_tensor(torch.zeros(1, 8, 16), mesh, [Shard(1)])))
    return [plan.split_homes for plan in plan_stacks(stacks).values()]


def test_the_balance_of_homes_spans_layers_whose_meshes_are_separate_objects():
    homes = run_ranks(per_layer_meshes_worker, 2, timeout=60)
    assert homes[0] == homes[1] == [(0,), (1,), (0,), (1,)]  # not every layer's expert on rank 0
