"""The optimizer step of a small Llama-like model at dp 2 x tp 2 on 4 CPU ranks, two ways.

dmuon against "gather and compute everywhere" Muon on tensor-parallel matrices (issue 45,
item 5).

    python benchmarks/tp_step.py [--quick] [--repeats 20] [--warmup 3] [--depths 2 8] [--json PATH]

The model is defined in ``tp_model.py`` (benchmarks do not import the tests): an embedding,
``layers`` blocks (an RMSNorm, attention ``wq wk wv wo``, an RMSNorm, a SwiGLU MLP
``w1 w2 w3``), a final norm and an output projection to a vocabulary (1001) that TP 2 does not
divide, so that one matrix is cut unevenly. 4 ranks on a ``("dp_shard", "tp")`` mesh of 2 x 2:
torchtitan's Llama 3 plan without sequence parallelism (``wq wk wv w1 w3`` ``ColwiseParallel``,
``wo w2`` ``RowwiseParallel``, the output ``ColwiseParallel`` with its logits replicated), then
``fully_shard`` of each block and of the model over ``dp_shard``. Muon takes every ``Linear``
weight, ``7 x layers + 1`` matrices, each a DTensor cut by TP and again by FSDP2; AdamW the
embedding and the norms. The two methods, on the same initial weights, the same batches and the
same ranks, one training step each in turn (``harness.rotated``), repeated:

* ``dmuon``: the matrices named in ``dmuon.dedicate_params(..., sharded_matrices=)``, one
  ``dmuon.Muon``: each matrix assembled on one home rank of the mesh, orthogonalised there, its
  pieces sent back (``dmuon/optim/sharded_matrices.py``);
* ``gather-everywhere``: every rank ``full_tensor()``s every matrix's momentum update, runs
  Newton-Schulz on all of them (dmuon's public ``dmuon.optim.orthogonalize``) and keeps its own
  piece of each result, written below (:class:`GatherEverywhereMuon`); ``torch.optim.AdamW`` on
  the rest.

Measured per method, at each depth (default 2 and 8 blocks): the optimizer step's wall time
(barrier to barrier, so the slowest rank's) and CPU time; the bytes each rank sends in the step
(``wire.tcp_bytes``: the kernel's count on every TCP socket of the process); the collectives of
one step (every ``c10d`` and ``_c10d_functional`` operator dispatched in it, counted by a
``TorchDispatchMode``: ``torch.distributed``'s calls and DTensor's functional collectives
alike); Newton-Schulz work per job (matrices orthogonalised per step summed over the ranks,
over the matrices in the model; counted by wrapping ``orthogonalize`` where dmuon calls it).
After the timing: the largest relative difference of any weight from dmuon's (the same update in
another order of sums: within 1e-5 is the check). All depths run in one 4-rank job, in turn.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import statistics
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from harness import TrainedMethod, paired_ratio, rotated, run_ranks, summary
from torch.utils._python_dispatch import TorchDispatchMode
from tp_model import Shape, batch, build_model, is_muon, matrices_in_model
from wire import barrier_bytes, metered, wire_check

METHODS = ("dmuon", "gather-everywhere")
MUON = dict(lr=0.02, momentum=0.95, nesterov=True, ns_steps=5, weight_decay=0.01)
ADAMW = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01)
COLLECTIVE_NAMESPACES = ("c10d", "_c10d_functional")
NOT_COLLECTIVES = ("wait_tensor", "_wrap_tensor_autograd")  # bookkeeping of functional collectives


# ---------------------------------------------------------------------------------------------
# counting: Newton-Schulz matrices, collectives
# ---------------------------------------------------------------------------------------------
class NewtonSchulzCount:
    """Matrices orthogonalised in this process: ``orthogonalize`` replaced, in the dmuon modules
    that call it, by a wrapper that counts (a batch ``[n, rows, cols]`` counts n); the
    gather-everywhere baseline calls the same wrapper."""

    count = 0
    orthogonalize: Callable = staticmethod(lambda matrix, steps: matrix)

    @classmethod
    def install(cls) -> None:
        from dmuon.optim import muon, newton_schulz, sharded_matrices

        original = newton_schulz.orthogonalize

        def counted(matrix: torch.Tensor, steps: int, *args: Any, **kwargs: Any) -> torch.Tensor:
            cls.count += matrix.shape[0] if matrix.ndim == 3 else 1
            return original(matrix, steps, *args, **kwargs)

        muon.orthogonalize = sharded_matrices.orthogonalize = counted
        cls.orthogonalize = staticmethod(counted)

    @classmethod
    def take(cls) -> int:
        count, cls.count = cls.count, 0
        return count


class CollectiveCount(TorchDispatchMode):
    """The collective operators dispatched while it is on, by name, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if func.namespace in COLLECTIVE_NAMESPACES and name not in NOT_COLLECTIVES:
            self.names.append(f"{func.namespace}.{name}")
        return func(*args, **(kwargs or {}))


# ---------------------------------------------------------------------------------------------
# the baseline
# ---------------------------------------------------------------------------------------------
class GatherEverywhereMuon:
    """Muon as FSDP2 and TP ports of it do: momentum on each rank's piece, then every rank
    gathers every matrix's update whole (``full_tensor()``: an all-gather per sharded mesh
    dimension), orthogonalises all of them and applies its own piece. The same update as
    dmuon's: ``buf = mu buf + g``, Nesterov ``g + mu buf``, ``ns_steps`` quintic iterations,
    decoupled weight decay, scale ``0.2 sqrt(max(rows, cols))``."""

    def __init__(self, params: list, lr, momentum, nesterov, ns_steps, weight_decay) -> None:
        self.params = params
        self.hp = dict(lr=lr, momentum=momentum, nesterov=nesterov, ns_steps=ns_steps, weight_decay=weight_decay)
        self.momentum = {p: torch.zeros_like(p.to_local()) for p in params}

    @torch.no_grad()
    def step(self) -> None:
        from torch.distributed.tensor import DTensor, Replicate

        hp, mu = self.hp, self.hp["momentum"]
        for param in self.params:
            grad, buf = param.grad.to_local(), self.momentum[param]
            buf.mul_(mu).add_(grad)
            update = grad.add(buf, alpha=mu) if hp["nesterov"] else buf
            mesh, placements = param.device_mesh, param.placements
            whole = DTensor.from_local(update, mesh, placements, shape=param.shape, stride=param.stride()).full_tensor()
            ortho = NewtonSchulzCount.orthogonalize(whole, hp["ns_steps"])
            # this rank's piece of the replicated result: a local slice, no communication
            mine = DTensor.from_local(ortho, mesh, [Replicate()] * mesh.ndim).redistribute(mesh, placements)
            value = param.to_local()
            value.mul_(1.0 - hp["lr"] * hp["weight_decay"])
            value.add_(mine.to_local(), alpha=-hp["lr"] * 0.2 * math.sqrt(max(whole.shape)))

    def zero_grad(self, set_to_none: bool = True) -> None:
        for param in self.params:
            param.grad = None


def build_method(name: str, shape: Shape, mesh) -> TrainedMethod:
    import dmuon

    model = build_model(shape, mesh, dedicate=name == "dmuon")
    if name == "dmuon":
        opt = dmuon.Muon(model, **MUON, adamw_lr=ADAMW["lr"], adamw_betas=ADAMW["betas"], adamw_eps=ADAMW["eps"],
                         adamw_weight_decay=ADAMW["weight_decay"])
        return TrainedMethod(name, model, [opt])
    named = list(model.named_parameters())
    muon = GatherEverywhereMuon([p for n, p in named if is_muon(n)], **MUON)
    return TrainedMethod(name, model, [muon, torch.optim.AdamW([p for n, p in named if not is_muon(n)], **ADAMW)])


# ---------------------------------------------------------------------------------------------
# the timed job
# ---------------------------------------------------------------------------------------------
def timed_job(rank: int, world: int, shapes: list[Shape], repeats: int, warmup: int) -> dict:
    """Every shape in turn on the same ranks and mesh: the meter's check, then one result per shape."""
    from torch.distributed.device_mesh import init_device_mesh

    # DTensor warns at every full_tensor() of a _StridedShard matrix that it takes two all-gathers: it does
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    NewtonSchulzCount.install()
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp_shard", "tp"))
    return {"wire_check": wire_check(), "depths": [one_shape(shape, mesh, repeats, warmup) for shape in shapes]}


def one_shape(shape: Shape, mesh, repeats: int, warmup: int) -> dict:
    import torch.distributed as dist

    methods = {name: build_method(name, shape, mesh) for name in METHODS}
    collectives: dict[str, list[str]] = {}
    for name, method in methods.items():
        for step in range(warmup):
            method.train_on(batch(shape, step, mesh))
            if step == warmup - 1:  # the last warm-up step, counted (not timed: the mode costs time)
                with CollectiveCount() as counter:
                    method.step()
                collectives[name] = counter.names
            else:
                method.step()
            NewtonSchulzCount.take()
            method.zero_grad()
    empty = barrier_bytes()
    rows: dict[str, dict[str, list]] = {name: {k: [] for k in ("step_wall", "step_cpu", "bytes_step", "ns")}
                                        for name in METHODS}
    for repeat in range(repeats):
        for name in rotated(METHODS, repeat):
            method, row = methods[name], rows[name]
            method.train_on(batch(shape, warmup + repeat, mesh))
            timing, sent = metered(method.step)
            row["ns"].append(NewtonSchulzCount.take())
            method.zero_grad()
            row["step_wall"].append(timing["wall_s"])
            row["step_cpu"].append(timing["cpu_s"])
            row["bytes_step"].append(sent - empty)
    ns_job = {}
    for name in METHODS:
        counts = torch.tensor(rows[name]["ns"], dtype=torch.int64)
        dist.all_reduce(counts)
        ns_job[name] = counts.tolist()
    return {"rows": rows, "ns_job": ns_job, "collectives": collectives, "agreement": agreement(methods),
            "losses": {name: m.losses for name, m in methods.items()}, "barrier_pair_bytes": empty}


def agreement(methods: dict[str, TrainedMethod]) -> dict[str, float]:
    """After the same steps on the same data: the largest relative difference (Frobenius) of a
    weight from dmuon's, among the Muon matrices and among the rest (gathered whole)."""
    ours, theirs = (dict(methods[name].model.state_dict()) for name in METHODS)
    worst = {"muon": 0.0, "adamw": 0.0}
    for key, value in ours.items():
        a, b = value.full_tensor(), theirs[key].full_tensor()
        kind = "muon" if is_muon(key) else "adamw"
        worst[kind] = max(worst[kind], float((a - b).norm() / a.norm()))
    return worst


# ---------------------------------------------------------------------------------------------
# report
# ---------------------------------------------------------------------------------------------
def report(results: list[dict], shape: Shape, repeats: int, wire: dict) -> dict:
    total = matrices_in_model(shape)
    table = {}
    walls = {}
    for name in METHODS:
        per_rank = [r["rows"][name] for r in results]
        walls[name] = [max(r["step_wall"][i] for r in per_rank) for i in range(repeats)]
        cpu = [statistics.mean(r["step_cpu"][i] for r in per_rank) for i in range(repeats)]
        sent = [statistics.median(r["bytes_step"]) for r in per_rank]
        calls = [r["collectives"][name] for r in results]
        table[name] = {
            "step_wall_ms": {k: v * 1e3 for k, v in summary(walls[name]).items() if k != "spread"},
            "step_wall_spread": summary(walls[name])["spread"],
            "step_cpu_ms": statistics.median(cpu) * 1e3,
            "bytes_per_opt_step": {"mean": statistics.mean(sent), "max": max(sent)},
            "collectives_per_step": max(len(c) for c in calls),
            "collectives_by_name": dict(Counter(calls[0])),
            "same_collectives_on_every_rank": all(c == calls[0] for c in calls),
            "ns_per_job": statistics.median(results[0]["ns_job"][name]) / total,
            "last_loss": results[0]["losses"][name][-1],
        }
    ratio = paired_ratio(walls["dmuon"], walls["gather-everywhere"])
    ours = table["dmuon"]
    targets = {"ns_per_job_1x": ours["ns_per_job"] == 1.0, "step_le_0.5x_gather": ratio,
               "collectives_le_8": ours["collectives_per_step"] <= 8,
               "weights_agree_1e-5": max(results[0]["agreement"].values()) <= 1e-5}
    return {"layers": shape.layers, "matrices_in_model": total, "shape": shape.__dict__, "repeats": repeats,
            "table": table, "paired_step_ratio_dmuon_over_gather": ratio, "targets": targets,
            "largest_relative_difference_from_dmuon": results[0]["agreement"],
            "wire_check": wire}


def print_table(reports: list[dict]) -> None:
    first = reports[0]
    print(f"\n4 ranks, dp_shard 2 x tp 2, {first['shape']} (layers varied), {first['repeats']} interleaved repeats")
    print("| blocks (Muon matrices) | method | opt step wall min | median | CPU median | bytes sent / rank in the"
          " step | collectives / step | NS work per job |")
    print("|---|---|---|---|---|---|---|---|")
    for rep in reports:
        for name, row in rep["table"].items():
            wall, sent = row["step_wall_ms"], row["bytes_per_opt_step"]["mean"]
            print(f"| {rep['layers']} ({rep['matrices_in_model']}) | {name} | {wall['min']:.1f} ms | "
                  f"{wall['med']:.1f} ms | {row['step_cpu_ms']:.1f} ms | {sent / 1024:.1f} KiB | "
                  f"{row['collectives_per_step']} | {row['ns_per_job']:.2f}x |")
    for rep in reports:
        print(f"\n{rep['layers']} blocks: paired step ratio dmuon / gather-everywhere "
              f"{rep['paired_step_ratio_dmuon_over_gather']:.3f}; targets {rep['targets']}")
        print("  collectives:", {name: row["collectives_by_name"] for name, row in rep["table"].items()},
              "same on every rank:", all(row["same_collectives_on_every_rank"] for row in rep["table"].values()))
        print("  largest relative difference from dmuon's weights:", rep["largest_relative_difference_from_dmuon"])
        print("  last losses:", {name: round(row["last_loss"], 6) for name, row in rep["table"].items()})
    print("wire check:", first["wire_check"])


def run(shape: Shape, depths: list[int], repeats: int, warmup: int) -> list[dict]:
    """One 4-rank job, every depth in turn; a report per depth."""
    shapes = [replace(shape, layers=layers) for layers in depths]
    results = run_ranks(timed_job, 4, shapes, repeats, warmup, timeout=1800)
    return [report([r["depths"][i] for r in results], deep, repeats, results[0]["wire_check"])
            for i, deep in enumerate(shapes)]


QUICK = Shape(dim=32, heads=2, hidden=48, vocab=37, seq=8, batch=2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a few repeats of a smaller model")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3,
                        help="steps before the timing (the last one's collectives counted)")
    parser.add_argument("--depths", type=int, nargs="+", default=[2, 8], help="blocks in the model, in turn")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    shape, repeats, warmup = Shape(), args.repeats, max(1, args.warmup)
    if args.quick:
        shape, repeats, warmup = QUICK, 3, 2
    started = time.monotonic()
    reports = run(shape, args.depths, repeats, warmup)
    print_table(reports)
    seconds = time.monotonic() - started
    print(f"\n{seconds:.0f} s")
    if args.json:
        args.json.write_text(json.dumps({"reports": reports, "seconds": seconds}, indent=2, default=str))


if __name__ == "__main__":
    main()
