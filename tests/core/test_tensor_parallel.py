"""Tensor parallelism: sharded matrices updated by Muon whole, once per job, on a home rank.

A tiny Llama-like model (``tests/helpers/tensor_parallel.py``) on a ``("dp_shard", "tp")``
mesh of 4 gloo ranks, torch's tensor-parallel plan then ``fully_shard`` over ``dp_shard``, its
matrices named in ``dedicate_params(sharded_matrices=)``. Checked: the pieces DTensor gives
each rank assemble to the full matrix and come back; the update equals a single-process Muon
on the full matrices; five training steps equal the same model on a 1-D FSDP mesh with
dedicated matrices, on dp 2 x tp 2 and on HSDP x TP (2 replicas x tp 2); the optimizer step's
collectives do not grow with the number of matrices.
"""
import pytest
import torch
import torch.distributed as dist

import dmuon
from dmuon.optim.homes import newton_schulz_cost
from tests.helpers import tensor_parallel as tp
from tests.helpers.launch import run_ranks
from tests.helpers.reference import HPARAMS, ReferenceOptimizer

STEPS = 5
COLLECTIVES = (
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_to_all", "all_to_all_single", "broadcast",
    "reduce", "reduce_scatter_tensor", "reduce_scatter", "gather", "scatter", "send", "recv", "isend", "irecv",
    "batch_isend_irecv", "all_gather_object", "broadcast_object_list",
)


def build(layout: str, layers: int = 2):
    """The model on this rank as ``layout`` lays it out, with its optimizer and data share."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = tp.Tiny(layers)
    full = {name: p.detach().clone() for name, p in model.named_parameters()}
    if layout in ("dp2xtp2", "dp2xtp2_sp"):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))
        dp_mesh = mesh["dp_shard"]
        dmuon.dedicate_params(model, dp_mesh, lambda f, p: False, sharded_matrices=tp.is_matrix)
        sequence_parallel = layout == "dp2xtp2_sp"
        tp.tensor_parallel(model, mesh["tp"], sequence_parallel=sequence_parallel)
        dp, tp_rank = mesh.get_coordinate()
        share = tp.Share(dp, 2, tp_rank, 2) if sequence_parallel else tp.Share(dp, 2)
    elif layout in ("hsdp2xtp2", "hsdp2x2xtp2"):  # HSDP x TP: 2 replicas of dp_shard 1 (or 2), each TP 2
        shards = 2 if layout == "hsdp2x2xtp2" else 1  # (8 ranks)
        mesh = init_device_mesh("cpu", (2, shards, 2), mesh_dim_names=("dp_replicate", "dp_shard", "tp"))
        dp_mesh = mesh["dp_replicate", "dp_shard"]
        replicas = mesh["dp_replicate"]
        dmuon.dedicate_params(
            model, mesh["dp_shard"], lambda f, p: False, replicate_mesh=replicas, sharded_matrices=tp.is_matrix
        )
        tp.tensor_parallel(model, mesh["tp"])
        replica, shard, _ = mesh.get_coordinate()
        share = tp.Share(replica * shards + shard, 2 * shards)
    else:
        dp_mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        if layout == "dp4_dedicated":
            dmuon.dedicate_params(model, dp_mesh, tp.is_matrix)
        else:  # "dp4_sharded": FSDP2's Shard(0) pieces, assembled on homes as TP pieces are
            dmuon.dedicate_params(model, dp_mesh, lambda f, p: False, sharded_matrices=tp.is_matrix)
        share = tp.Share(dist.get_rank(), dist.get_world_size())
    for block in model.layers:
        fully_shard(block, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)
    if layout.startswith("hsdp"):
        assert repr(tuple(model.layers[0].attention.wo.weight.placements)) == "(Replicate(), Shard(dim=0), Shard(dim=1))"
    return model, dmuon.Muon(model, **HPARAMS), full, share


def count_collectives(calls: list[str]):
    """Wrap every torch.distributed collective to note its name when called."""
    originals = {name: getattr(dist, name) for name in COLLECTIVES}

    def wrap(name, fn):
        def counted(*args, **kwargs):
            calls.append(name)
            return fn(*args, **kwargs)

        return counted

    for name, fn in originals.items():
        setattr(dist, name, wrap(name, fn))
    return lambda: [setattr(dist, name, fn) for name, fn in originals.items()]


# ---------------------------------------------------------------------------------------------
# pieces, homes, the update
# ---------------------------------------------------------------------------------------------
def pieces_worker(rank, world):
    from torch.distributed.tensor import DTensor

    from dmuon.optim.sharded_matrices import _from_homes, _to_homes

    model, opt, full, _ = build("dp2xtp2")
    named = {name: p for name, p in model.named_parameters() if p.ndim == 2}
    plans = {name: opt.matrix_plans[id(p)] for name, p in named.items()}
    bucket = [(i, plans[name], p.to_local()) for i, (name, p) in enumerate(named.items())]
    wholes = _to_homes(bucket)
    homed = {name for i, (name, _) in enumerate(named.items()) if i in wholes}
    assembled = all(torch.equal(wholes[i], full[name]) for i, name in enumerate(named) if i in wholes)
    back = _from_homes(bucket, wholes)
    returned = all(torch.equal(back[i], p.to_local()) for i, p in enumerate(named.values()))
    # the same full gradient on every layout, laid out as each parameter is
    grads = {name: torch.randn(p.shape, generator=torch.Generator().manual_seed(7)) for name, p in named.items()}
    calls: list[str] = []
    for step in range(3):
        for name, p in named.items():
            block = plans[name].blocks[plans[name].rank]
            local = block.of(grads[name] * (step + 1)).contiguous()
            p.grad = DTensor.from_local(local, p.device_mesh, p.placements, shape=p.shape, stride=p.stride())
        restore = count_collectives(calls) if step == 2 else None
        opt.step()
        if restore is not None:
            restore()
    return {
        "placements": {name: repr(tuple(p.placements)) for name, p in named.items()},
        "homed": homed,
        "assembled": assembled,
        "returned": returned,
        "full": full,
        "grads": grads,
        "after": {name: p.full_tensor() for name, p in named.items()},
        "calls": calls,
    }


def test_pieces_assemble_on_homes_and_the_update_is_single_process_muon():
    out = run_ranks(pieces_worker, 4, timeout=60)
    placements = out[0]["placements"]
    # what torch 2.13 makes of the plan under fully_shard (dp_shard, tp)
    assert placements["layers.0.attention.wq.weight"] == "(_StridedShard(dim=0, sf=2), Shard(dim=0))"
    assert placements["layers.0.feed_forward.w2.weight"] == "(Shard(dim=0), Shard(dim=1))"
    assert out[0]["full"]["output.weight"].shape == (tp.VOCAB, tp.DIM)  # 37 rows: 19 + 18 over TP 2
    assert all(o["assembled"] and o["returned"] for o in out)
    homed = [o["homed"] for o in out]
    assert sorted(n for h in homed for n in h) == sorted(placements)  # each matrix on one home
    # balanced by Newton-Schulz cost: no home more than one matrix's cost above another
    costs = [sum(newton_schulz_cost(*out[0]["full"][n].shape) for n in h) for h in homed]
    assert max(costs) - min(costs) <= newton_schulz_cost(tp.HIDDEN, tp.DIM), costs
    # three steps of single-process Muon on the full matrices, the same gradients
    full = out[0]["full"]
    reference = torch.nn.ParameterDict({n.replace(".", "_"): torch.nn.Parameter(full[n].clone()) for n in placements})
    ref_opt = ReferenceOptimizer(reference, set(reference))
    for step in range(3):
        for name in placements:
            reference[name.replace(".", "_")].grad = out[0]["grads"][name] * (step + 1)
        ref_opt.step()
    for name in placements:
        for o in out:
            torch.testing.assert_close(o["after"][name], reference[name.replace(".", "_")].detach(), rtol=1e-6, atol=1e-6)
    assert out[0]["calls"] == ["all_to_all_single", "all_to_all_single"], out[0]["calls"]


def collectives_worker(rank, world, layers):
    model, opt, _, share = build("dp2xtp2", layers)
    x, y = share.inputs(0)
    tp.loss_of(model(x), y).backward()
    calls: list[str] = []
    restore = count_collectives(calls)
    opt.step()
    restore()
    return calls, len(opt.matrix_plans)


def test_collectives_per_step_do_not_grow_with_the_number_of_matrices():
    one = run_ranks(collectives_worker, 4, 1, timeout=60)
    two = run_ranks(collectives_worker, 4, 2, timeout=60)
    assert two[0][1] - one[0][1] == one[0][1] - 1 == 7  # 7 more with a block (and the output)
    assert all(calls == ["all_to_all_single", "all_to_all_single"] for calls, _ in one + two), one[0][0]


# ---------------------------------------------------------------------------------------------
# training: dp 2 x tp 2 against the same model on a 1-D FSDP mesh
# ---------------------------------------------------------------------------------------------
def train_worker(rank, world, layout):
    model, opt, _, share = build(layout)
    losses = []
    for step in range(STEPS):
        losses.append(tp.train_step(model, opt, share, step))
    homed = sum(1 for plan in opt.matrix_plans.values() if plan.home == plan.rank)
    if layout == "dp4_dedicated":
        return losses, dmuon.get_model_state_dict(model), homed
    # (dmuon's whole-job state dict sees the data mesh only: 2 of the 4 ranks under TP)
    return losses, {name: value.full_tensor() for name, value in model.state_dict().items()}, homed


def test_five_steps_on_dp2_x_tp2_match_a_1d_fsdp_mesh():
    """Against dedicated matrices on dp 4; and FSDP2's own pieces (dp 4, sharded_matrices=).

    Only the order of floating-point sums differs (the row-wise matrices' partial products
    summed over TP, the gradients reduced over 2 ranks, not 4): measured 1.2e-7 apart at most
    in any weight after five steps, 1e-7 relative in the losses.
    """
    layouts = ("dp2xtp2", "dp4_dedicated", "dp4_sharded", "hsdp2xtp2", "dp2xtp2_sp")
    results = {layout: run_ranks(train_worker, 4, layout, timeout=90) for layout in layouts}
    ref_losses, ref_weights, _ = results["dp4_dedicated"][0]
    for layout in ("dp2xtp2", "dp4_sharded", "hsdp2xtp2", "dp2xtp2_sp"):
        losses, weights, _ = results[layout][0]
        # each matrix orthogonalised on one rank of the job (with HSDP: of one replica)
        assert sum(homed for _, _, homed in results[layout]) == 15, layout
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-6, atol=0, msg=layout)
        assert weights.keys() == ref_weights.keys()
        for name, value in weights.items():
            torch.testing.assert_close(value, ref_weights[name], rtol=1e-6, atol=1e-6, msg=f"{layout} {name}")


# ---------------------------------------------------------------------------------------------
# refusals
# ---------------------------------------------------------------------------------------------
def test_plans_refuse_layouts_they_cannot_update():
    from dmuon.optim.sharded_matrices import Block, MatrixLayoutError, _check_tiling, plan_matrices

    assert plan_matrices([("w", torch.zeros(3, 5))])["w"].group is None  # a plain tensor: held whole here
    with pytest.raises(MatrixLayoutError, match="'v' has shape"):
        plan_matrices([("v", torch.zeros(4))])
    rows = [Block(0, 2, 0, 4), Block(2, 2, 0, 4), Block(4, 0, 0, 4)]  # an empty piece (uneven) is fine
    _check_tiling("m", (4, 4), rows)
    _check_tiling("m", (4, 4), [Block(r, 2, c, 2) for r in (0, 2) for c in (0, 2)])
    for bad in ([Block(0, 2, 0, 4), Block(1, 3, 0, 4)], [Block(0, 2, 0, 4)], [Block(0, 2, 0, 2), Block(2, 2, 2, 2)]):
        with pytest.raises(MatrixLayoutError, match="'m' of shape \\(4, 4\\).*do not tile"):
            _check_tiling("m", (4, 4), bad)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import DTensor, Partial

        partial = DTensor.from_local(torch.zeros(2, 2), init_device_mesh("cpu", (1,)), [Partial()])
        with pytest.raises(MatrixLayoutError, match=r"'p' has placement P\(sum\).*partial sum"):
            plan_matrices([("p", partial)])
        with pytest.raises(ValueError, match="'bias'.*sharded_matrices.*a matrix is 2-D"):
            dmuon.dedicate_params(torch.nn.Linear(2, 2), init_device_mesh("cpu", (1,)), lambda f, p: False,
                                  sharded_matrices=lambda f, p: True)
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------
# checkpoints: written at dp 2 x tp 2, read at tp 1
# ---------------------------------------------------------------------------------------------
def _full(value):
    return value.full_tensor() if hasattr(value, "full_tensor") else value


def momenta(model, opt) -> dict:
    """Every Muon matrix's momentum, whole, by name (a dedicated one's from its owner)."""
    from dmuon.dedicated import get_registry

    registry = get_registry(model)
    out = {}
    for name, param in model.named_parameters():
        rec = registry.records.get(name)
        if rec is None and param.ndim == 2:
            out[name] = _full(opt.state[param]["momentum_buffer"])
        elif rec is not None:  # a dedicated matrix: the full buffer on its owner, sent to every rank
            full = torch.zeros(rec.shape)
            if rec.is_global_owner:
                full.copy_(opt.state[param]["momentum_buffer"])
            dist.all_reduce(full)
            out[name] = full
    return out


def weights(model, layout) -> dict:
    if layout == "dp4_dedicated":
        return dmuon.get_model_state_dict(model, rank0_only=False)
    return {name: _full(value) for name, value in model.state_dict().items()}


def checkpoint_worker(rank, world, path, door, layout, role):
    """``role`` "save": three steps, then a checkpoint; "load": other initial values, then the load."""
    import torch.distributed.checkpoint as dcp

    if role == "save":
        model, opt, _, share = build(layout)
        for step in range(3):
            tp.train_step(model, opt, share, step)
        if door == "dmuon":
            dmuon.dcp.save(model, opt, path)
        elif door == "flat":  # dmuon's flat dicts, gathered on rank 0
            flat = {"model": dmuon.get_model_state_dict(model), "optim": dmuon.get_optimizer_state_dict(model, opt)}
            if rank == 0:
                torch.save(flat, path)
        else:
            dcp.save(model.state_dict(), checkpoint_id=path)
    else:
        torch.manual_seed(1)
        model, opt, _, _ = build(layout)  # other initial values: the load must replace them
        if door == "dmuon":
            dmuon.dcp.load(model, opt, path)
        elif door == "flat":
            flat = torch.load(path, weights_only=False)
            dmuon.set_model_state_dict(model, flat["model"])
            dmuon.set_optimizer_state_dict(model, opt, flat["optim"])
        else:
            state = model.state_dict()
            dcp.load(state, checkpoint_id=path)
            model.load_state_dict(state)
    return weights(model, layout), momenta(model, opt) if door != "torch" else {}


def _restores(path: str, door: str, saved_at: str, loads_at: tuple[str, ...]) -> None:
    saved_weights, saved_momenta = run_ranks(checkpoint_worker, 4, path, door, saved_at, "save", timeout=90)[0]
    assert len(saved_momenta) == (0 if door == "torch" else 15)
    for layout in loads_at:
        loaded_weights, loaded_momenta = run_ranks(checkpoint_worker, 4, path, door, layout, "load", timeout=90)[0]
        assert loaded_weights.keys() == saved_weights.keys()
        for name, value in saved_weights.items():
            assert torch.equal(loaded_weights[name], value), (door, layout, name)
        assert loaded_momenta.keys() == saved_momenta.keys()
        for name, value in saved_momenta.items():
            assert torch.equal(loaded_momenta[name], value), (door, layout, name)


def test_a_tp_checkpoint_loads_at_tp_1_model_and_momentum_exact(tmp_path):
    """TP 2 -> 1, through dmuon.dcp (model and optimizer) and torch's dcp (the model's state
    dict): into dedicated matrices and into FSDP2's own pieces."""
    _restores(str(tmp_path / "dmuon"), "dmuon", "dp2xtp2", ("dp4_dedicated", "dp4_sharded"))
    _restores(str(tmp_path / "torch"), "torch", "dp2xtp2", ("dp4_dedicated",))


def test_flat_state_dicts_move_between_tp_2_and_tp_1_model_and_momentum_exact(tmp_path):
    """dmuon's flat dicts (gathered on rank 0): a matrix's momentum comes under "fsdp2" from a
    TP job and under "dedicated" from a job that dedicates it; either loads into the other."""
    _restores(str(tmp_path / "tp2.pt"), "flat", "dp2xtp2", ("dp4_dedicated",))
    _restores(str(tmp_path / "tp1.pt"), "flat", "dp4_dedicated", ("dp2xtp2",))


def test_a_tp_1_checkpoint_loads_at_tp_2_and_hsdp_x_tp(tmp_path):
    """TP 1 -> 2 (dedicated matrices on dp 4 to dp 2 x tp 2 and to 2 replicas x tp 2)."""
    _restores(str(tmp_path / "dmuon"), "dmuon", "dp4_dedicated", ("dp2xtp2", "hsdp2xtp2"))
