"""How long an async save stops the training loop, and how much it slows the next step.

    python benchmarks/snapshot_window.py [--world-size 2] [--mib 64] [--rounds 5] [--ns-steps 5]
                                         [--async-direct-io rule on off] [--root DIR]

One training job per run: a model of about ``--mib`` MiB of fp32 parameters (matrices, each
dedicated; Muon with momentum, so the checkpoint holds about twice that), on ``--world-size``
CPU ranks. Interleaved in every round, each timed on every rank and reported for the slowest:

* ``sync save``: ``dmuon.dcp.save``, wall time (the loop is stopped for all of it);
* ``async call``: the time ``dmuon.dcp.async_save`` takes to return (the loop is stopped for
  this only; the copy of the state runs behind the next forward and backward, ``snapshot.py``);
* ``step``: one training step with no save in flight;
* ``step after call``: the first step right after ``async_save`` returned, which waits in
  ``Muon.step()`` for whatever of the copy is not done yet and shares the cores with it.

With several ``--async-direct-io`` ways, each round runs an async save (and the step after it)
in each way, order rotated. ``--ns-steps 0`` makes the step short (no Newton-Schulz), so the
copy and the write have less time to hide behind.

The targets of issues 36 and 44: async call <= 0.05x sync save; step after call <= 1.25x step.
Ratios are of medians over rounds; min and median of each are printed, wall and CPU.
"""
from __future__ import annotations

import argparse
import functools
import os
import shutil
import statistics
import tempfile
import time

from harness import cpu_seconds, run_ranks

WAYS = {"rule": None, "on": {"direct_io": True}, "off": {"direct_io": False}}  # --async-direct-io


def worker(rank, world, mib, rounds, root, ns_steps=5, ways=(("rule", None),)):
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import dmuon
    import dmuon.dcp as ddcp

    dim = 512
    layers = max(1, int(mib * 2**20 / (4 * dim * dim)))
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(dim, dim, bias=False) for _ in range(layers)])
    mesh = init_device_mesh("cpu", (world,))
    dmuon.dedicate_params(model, mesh, lambda n, p: p.ndim == 2)
    fully_shard(model, mesh=mesh)
    opt = dmuon.Muon(model, ns_steps=ns_steps)
    x = torch.randn(64, dim, generator=torch.Generator().manual_seed(rank))

    def step():
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()

    def timed(fn):
        dist.barrier()
        wall, cpu = time.perf_counter(), cpu_seconds()
        fn()
        return time.perf_counter() - wall, cpu_seconds() - cpu

    for _ in range(3):
        step()
    out = {name: [] for name in ("sync save", "step")}
    for name, _ in ways:
        out[f"async call{_suffix(name, ways)}"] = []
        out[f"step after call{_suffix(name, ways)}"] = []
    checkpointer = ddcp.api.model_checkpointer(model)
    for r in range(rounds):
        out["sync save"].append(timed(functools.partial(ddcp.save, model, opt, f"{root}/sync-{r}")))
        out["step"].append(timed(step))
        for name, options in ways[r % len(ways):] + ways[:r % len(ways)]:  # (order rotated)
            started: list = []
            call = functools.partial(_start, started, ddcp.async_save, model, opt, f"{root}/async-{name}-{r}",
                                     storage_options=options)
            out[f"async call{_suffix(name, ways)}"].append(timed(call))
            out[f"step after call{_suffix(name, ways)}"].append(timed(step))
            started[0].wait()
    checkpointer.close()
    return out


def _suffix(name: str, ways) -> str:
    return "" if len(ways) == 1 else f" ({name})"


def _start(started: list, async_save, *args, **kwargs) -> None:
    started.append(async_save(*args, **kwargs))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--mib", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--ns-steps", type=int, default=5,
                        help="Newton-Schulz iterations: fewer make a shorter step, which leaves less time "
                             "for the copy and the write to hide behind")
    parser.add_argument("--async-direct-io", nargs="+", choices=tuple(WAYS), default=["rule"],
                        help="the async saves' direct_io storage option, each interleaved with the others: "
                             "rule (default: direct on ext4/XFS for a background save), on (True), off (False)")
    parser.add_argument("--root", default=None, help="where checkpoints go (default: a temporary directory)")
    args = parser.parse_args()
    root = tempfile.mkdtemp(prefix="dmuon-snapshot-", dir=args.root)
    try:
        ways = tuple((name, WAYS[name]) for name in dict.fromkeys(args.async_direct_io))
        per_rank = run_ranks(worker, args.world_size, args.mib, args.rounds, root, args.ns_steps, ways)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"{args.world_size} CPU ranks, ~{args.mib} MiB of parameters (+ momentum), {args.rounds} rounds; "
          f"slowest rank per measurement; on {os.cpu_count()} cores")
    medians = {}
    for name in per_rank[0]:
        walls = [max(rank[name][i][0] for rank in per_rank) for i in range(args.rounds)]
        cpus = [max(rank[name][i][1] for rank in per_rank) for i in range(args.rounds)]
        medians[name] = statistics.median(walls)
        print(f"  {name:<16} wall min {min(walls) * 1e3:8.1f} ms  median {medians[name] * 1e3:8.1f} ms   "
              f"CPU median {statistics.median(cpus) * 1e3:8.1f} ms")
    for name, _ in ways:
        suffix = _suffix(name, ways)
        print(f"  async call{suffix} / sync save:  {medians['async call' + suffix] / medians['sync save']:.3f}"
              "  (target <= 0.05)")
        print(f"  step after call{suffix} / step:  {medians['step after call' + suffix] / medians['step']:.2f}"
              "  (target <= 1.25)")


if __name__ == "__main__":
    main()
