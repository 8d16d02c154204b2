"""Tensor parallelism across topologies: HSDP x TP on 8 ranks, and training on after a TP change.

The model, layouts and checks of ``test_tensor_parallel.py``. Here: a 3-D mesh
``("dp_replicate", "dp_shard", "tp")`` of 2 x 2 x 2 gloo ranks (HSDP x TP with dp_shard > 1,
which 4 ranks cannot lay out) trains as dp 4 does, and its checkpoint loads at dp 4 and at
dp_shard 2 x tp 2 with model and momentum exact; a dp 2 x tp 2 checkpoint loaded at dp 4 trains
on as the job that stayed at TP 2 does.
"""

import torch

import dmuon
from tests.core.test_tensor_parallel import build, momenta, weights
from tests.helpers import tensor_parallel as tp
from tests.helpers.launch import run_ranks

WORLD = {"hsdp2x2xtp2": 8}  # every other layout: 4 ranks


def steps_worker(rank, world, layout, steps, load=None, save=None, save_after=None):
    """Train ``layout`` on ``steps`` (the job's batches of those step numbers), after loading
    ``load`` if given; checkpoint to ``save`` after step ``save_after`` (default: the last).

    Returns the job's mean loss of each step, every weight and momentum whole at the end, and
    how many matrices this rank orthogonalises.
    """
    model, opt, _, share = build(layout)
    if load is not None:
        dmuon.dcp.load(model, opt, load)
    losses = []
    for step in steps:
        losses.append(tp.train_step(model, opt, share, step))
        if save is not None and step == (steps[-1] if save_after is None else save_after):
            dmuon.dcp.save(model, opt, save)
    homed = sum(1 for plan in opt.matrix_plans.values() if plan.home == plan.rank)
    return losses, weights(model, layout), momenta(model, opt), homed


def run(layout, *args, **kwargs):
    return run_ranks(steps_worker, WORLD.get(layout, 4), layout, *args, timeout=60, **kwargs)


def close(got: dict, want: dict, what: str) -> None:
    """Within fp32 reduction order (1e-6, as ``test_tensor_parallel.py`` asserts)."""
    assert got.keys() == want.keys(), what
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=1e-6, atol=1e-6, msg=f"{what} {name}")


def test_hsdp_2x2_x_tp_2_trains_as_dp_4_and_its_checkpoint_loads_at_dp_4_and_tp_2(tmp_path):
    """8 ranks: 2 replicas x dp_shard 2 x tp 2, five steps, then a checkpoint."""
    path = str(tmp_path / "hsdp")
    out = run("hsdp2x2xtp2", range(5), save=path)
    losses, saved_weights, saved_momenta, _ = out[0]
    ref_losses, ref_weights, ref_momenta, _ = run("dp4_dedicated", range(5))[0]
    # each matrix orthogonalised on one rank of the job, the output's 37 rows (19 + 18 over TP) among them
    assert sum(o[3] for o in out) == len(saved_momenta) == 15
    assert saved_weights["output.weight"].shape == (tp.VOCAB, tp.DIM)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-6, atol=0)
    close(saved_weights, ref_weights, "weight")
    close(saved_momenta, ref_momenta, "momentum")
    for layout in ("dp4_dedicated", "dp2xtp2"):
        _, loaded_weights, loaded_momenta, _ = run(layout, (), load=path)[0]
        assert loaded_weights.keys() == saved_weights.keys()
        for name, value in saved_weights.items():
            assert torch.equal(loaded_weights[name], value), (layout, name)
        assert loaded_momenta.keys() == saved_momenta.keys()
        for name, value in saved_momenta.items():
            assert torch.equal(loaded_momenta[name], value), (layout, name)


def test_a_tp_2_checkpoint_trains_on_at_tp_1_as_the_job_that_stayed_at_tp_2(tmp_path):
    """Saved at dp 2 x tp 2 after three steps; three more there, and three at dp 4 from the load."""
    path = str(tmp_path / "tp2")
    stayed_losses, stayed_weights, stayed_momenta, _ = run("dp2xtp2", range(6), save=path, save_after=2)[0]
    moved_losses, moved_weights, moved_momenta, _ = run("dp4_dedicated", range(3, 6), load=path)[0]
    torch.testing.assert_close(torch.tensor(moved_losses), torch.tensor(stayed_losses[3:]), rtol=1e-6, atol=0)
    close(moved_weights, stayed_weights, "weight")
    close(moved_momenta, stayed_momenta, "momentum")
