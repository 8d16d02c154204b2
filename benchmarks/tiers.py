"""TieredCheckpointManager on two nodes: restore from local / peer replica / S3, save blocking
time per tier, and what replication costs the training loop.

    python benchmarks/tiers.py [--dim 512] [--hidden 2048] [--layers 4] [--repeats 3]
                               [--steps 6] [--json PATH]

Two torchrun agents on localhost (c10d rendezvous), one worker each, stand for two nodes:
each has its own local directory, and bytes between them go over loopback gloo (the job's own
network). The persistent tier is a local SeaweedFS S3 server (the tests' one), started here
and stopped by its process group. The model is the tests' TinyTransformer scaled up (FSDP2,
every projection dedicated), trained with dmuon.Muon. Per repeat:

  save      ``manager.save(step, persistent=True)``: the blocking local save, then in the
            background the replication to the other node and the copy to S3; and, for
            comparison, a plain ``ddcp.save`` of the same state straight to S3 (what a job
            with one persistent tier blocks for)
  training  ``--steps`` training steps right after a save (replication in flight) against the
            same steps with no background work, and with no manager at all (the preemption
            check's one small all-reduce per step is the difference)
  restore   ``manager.restore`` with every file in place (local); with node 0's directory
            deleted (node 0's bytes come from its replica on node 1); with both deleted (S3).
            The local files were written moments before: their pages are cached.

Times are the slowest rank's, barrier to barrier; medians over the repeats.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from tests.helpers.nodes import launch_nodes  # noqa: E402


def worker(args) -> None:
    import torch
    import torch.distributed as dist

    import dmuon.dcp as ddcp
    from tests.helpers.training import build, train

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    world = dist.get_world_size()
    node = int(os.environ["GROUP_RANK"])
    local = f"{args.run_dir}/node{node}"
    options = json.loads(args.options)
    model, opt = build(dim=args.dim, hidden=args.hidden, layers=args.layers, vocab=1024)
    torch.set_num_threads(1)

    def slowest(fn) -> float:
        dist.barrier()
        started = time.perf_counter()
        fn()
        mine = torch.tensor([time.perf_counter() - started], dtype=torch.float64)
        dist.all_reduce(mine, op=dist.ReduceOp.MAX)
        return float(mine.item())

    def largest(value: float) -> float:
        mine = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(mine, op=dist.ReduceOp.MAX)
        return float(mine.item())

    def agreement(manager, calls: int = 200) -> float:
        """Seconds per call of the step boundary's one collective (nothing due, no notice)."""
        return slowest(lambda: [manager._preempted(step, model, opt, None) for _ in range(calls)]) / calls

    samples: dict[str, list[float]] = {}

    def record(name: str, value: float) -> None:
        samples.setdefault(name, []).append(value)

    step = 0

    def steps(n: int, manager=None) -> None:
        nonlocal step
        for _ in range(n):
            step += 1
            train(model, opt, rank, world, range(step - 1, step))
            if manager is not None:
                manager.step(step, model, opt)

    idle = ddcp.TieredCheckpointManager(local, local_every=10**9)  # checks for preemption only
    quiet = ddcp.TieredCheckpointManager(local, local_every=10**9, preemption_signals=None)
    manager = ddcp.TieredCheckpointManager(local, f"{args.persistent}", local_every=10**9, storage_options=options,
                                           preemption_signals=None)
    steps(2)  # warm up
    step += 1
    manager.save(step, model, opt)  # warm up (the first local write probes the filesystem)
    manager.wait()
    for repeat in range(args.repeats):
        base = slowest(lambda: steps(args.steps))
        record("train: step, no manager", base / args.steps)
        record("train: step + manager.step, nothing due", slowest(lambda: steps(args.steps, idle)) / args.steps)
        record("train: step + manager.step, no preemption check",
               slowest(lambda: steps(args.steps, quiet)) / args.steps)
        for promote, label in ((False, "replication"), (True, "replication + copy to S3")):
            step += 1
            # partial, not a lambda: the step and the tier are bound now, not looked up at the call
            record(f"save: local, blocking ({label} after)",
                   slowest(functools.partial(manager.save, step, model, opt, persistent=promote)))
            during = slowest(lambda: steps(args.steps, quiet))
            busy = manager.background.busy()
            record(f"train: {args.steps} steps with {label} in flight, extra s", during - base)
            manager.wait()
            record(f"train: ... {label} still running after them (1 = yes)", float(largest(float(busy))))
        for name, label in (("replication", "replication"), ("promotion", "copy to S3")):
            record(f"save: {label} (background)", largest(manager.background_seconds[name]))
        for promote, label in ((False, "replication"), (True, "replication + copy to S3")):
            step += 1
            manager.save(step, model, opt, persistent=promote)
            cpu = time.process_time()
            manager.wait()  # nothing else running: all of this process's CPU is the background work's
            record(f"save: {label}, CPU s of the process, alone", largest(time.process_time() - cpu))
        saved = step
        record("step boundary: the preemption all-reduce alone (ms)", agreement(idle) * 1000)
        record("save: plain ddcp.save to S3 (blocking)", slowest(functools.partial(
            ddcp.save, model, opt, f"{args.persistent}-direct/{repeat}", storage_options=options)))
        record("restore: local tier", slowest(lambda: manager.resume(model, opt)))
        assert manager.last_restore.source == "local" and manager.last_restore.step == saved
        if node == 0:  # one worker per node here
            shutil.rmtree(local)
        dist.barrier()
        record("restore: peer replica (node 0's directory gone)", slowest(lambda: manager.resume(model, opt)))
        assert manager.last_restore.source == "local" and manager.last_restore.step == saved
        record("restore: bytes fetched from the peer (MiB, rank 0)", manager.last_restore.fetched_bytes / 2**20)
        shutil.rmtree(local, ignore_errors=True)
        dist.barrier()
        record("restore: S3", slowest(lambda: manager.resume(model, opt)))
        assert manager.last_restore.source == "persistent" and manager.last_restore.step == saved
        step = saved  # the restored state: train on from there
    sizes = sum(p.numel() * p.element_size() for p in model.parameters())
    files = ddcp.inspect(f"{args.persistent}/step-{saved}", storage_options=options)["files"]
    for m in (idle, quiet, manager):
        m.close()
    if rank == 0:
        Path(args.out).write_text(json.dumps({"samples": samples, "checkpoint_bytes": sum(files.values()),
                                              "param_bytes_rank0": sizes, "world": world}))
    dist.destroy_process_group()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--json", default=None)
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--run-dir", help=argparse.SUPPRESS)
    parser.add_argument("--persistent", help=argparse.SUPPRESS)
    parser.add_argument("--options", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return
    from tests.helpers.object_storage import SeaweedS3

    print("command: " + " ".join([sys.executable, *sys.argv]))
    print(f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}")
    work = Path(tempfile.mkdtemp(prefix="dmuon-bench-tiers-"))
    server = SeaweedS3(work / "s3")
    try:
        out = work / "result.json"
        job = launch_nodes(str(Path(__file__).resolve()), [
            "--worker", "--run-dir", str(work / "local"), "--persistent", server.url("bench"),
            "--options", json.dumps(server.storage_options), "--out", str(out), "--dim", str(args.dim),
            "--hidden", str(args.hidden), "--layers", str(args.layers), "--repeats", str(args.repeats),
            "--steps", str(args.steps)], work / "logs")
        codes = job.wait(args.timeout)
        if codes != [0, 0]:
            raise SystemExit(f"agents exited with {codes}:\n{job.output()}")
        result = json.loads(out.read_text())
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)
    print(f"model: TinyTransformer dim {args.dim}, hidden {args.hidden}, {args.layers} layers, vocab 1024; "
          f"checkpoint {result['checkpoint_bytes'] / 2**20:.0f} MiB (model + optimizer) on 2 nodes x 1 rank; "
          f"median of {args.repeats}")
    print(f"{'':56s} {'median':>9s} {'min':>9s} {'max':>9s}")
    for name, values in result["samples"].items():
        unit = "" if "MiB" in name or "(ms)" in name else " s"
        print(f"{name:56s} {statistics.median(values):9.3f} {min(values):9.3f} {max(values):9.3f}{unit}")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), **result}, indent=1))


if __name__ == "__main__":
    main()
