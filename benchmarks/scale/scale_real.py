"""How checkpoint cost grows with the number of tensors and ranks: dmuon against torch DCP.

    python benchmarks/scale real [--tensors 2000 10000] [--worlds 8 16] [--saves 2] [--nodes]
                               [--peer-gc-paused] [--profile DIR] [--root DIR] [--json PATH]

The model: ``--tensors`` small fp32 matrices (32x32, 4 KiB each: the cost here is per item, not
per byte) in blocks of 50, every other one dedicated, the rest FSDP2; torch's DCP saves the same model built
with nothing dedicated (all FSDP2, as many tensors). Model weights only. For each (tensors,
world) pair, one launch of ranks runs, interleaved: ``--saves`` saves in a row of each method
into fresh directories (the second one is what a training job pays every time: layout
unchanged), then a load of the last one.

Per operation the slowest rank's wall time, barrier to barrier, and the CPU seconds of every
rank summed; and, from timers around each DCP step (the planner's and storage layer's
methods, subclassed here), where the time goes: ``local plan`` (every rank), ``global plan``
(coordinator: de-duplication, validation, dmuon's checks), ``write``/``read`` (slowest rank),
``commit`` (coordinator: ``finish``, which for dmuon includes the manifest), and for loads
``metadata`` (every rank reads and unpickles ``.metadata``). Sizes: ``.metadata`` and dmuon's
manifest.

dmuon's ``save``/``load`` pause Python's garbage collector; ``--peer-gc-paused`` adds torch's
DCP with the collector paused the same way, to tell that part of the difference from the rest.
torch's planner runs with its own plan caching on (the peer at its best on repeated saves).

``--nodes`` adds a 2-"node" run: two ``torchrun --nnodes 2`` agents on this machine meeting
through c10d rendezvous, 4 ranks each, an HSDP mesh (replicate across the two nodes, shard
within one), ``--tensors`` of the first value.

All ranks share this machine's cores: absolute seconds are not a cluster's; what carries over
is how each cost grows (linear in items or not) and dmuon's cost next to torch's in the same
run. Everything written goes under one temporary directory that is removed at the end.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections import defaultdict

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.dirname(HERE))  # (benchmarks/: the harness; run directly under torchrun)

import torch  # noqa: E402
from harness import cpu_seconds  # noqa: E402

SHAPE = (32, 32)
METHODS = ("dmuon", "torch")
PEER_GC_PAUSED = "torch, gc paused"  # --peer-gc-paused: torch's DCP with the collector paused too


# ---------------------------------------------------------------------------------------------
# timers around DCP's steps: subclasses of the planner / storage classes each method uses
# ---------------------------------------------------------------------------------------------
STEPS = {  # method name -> phase it belongs to
    "create_local_plan": "local plan",
    "create_global_plan": "global plan",
    "write_data": "write",
    "finish": "commit",
    "read_metadata": "metadata",
    "read_data": "read",
}


def timed(cls, clock: dict, tag: str = ""):
    """A subclass of ``cls`` whose DCP steps add their seconds to ``clock[phase]`` (``tag`` in
    its name: torch's plan caching keys its class-level cache by class name)."""

    def wrap(name):
        base = getattr(cls, name)

        def method(self, *args, **kwargs):
            t0 = time.perf_counter()
            try:
                result = base(self, *args, **kwargs)
                if name in ("write_data", "read_data"):
                    result.wait()  # the futures are complete already for these writers
                return result
            finally:
                clock[STEPS[name]] += time.perf_counter() - t0

        return method

    return type(f"Timed{tag}{cls.__name__}", (cls,), {n: wrap(n) for n in STEPS if hasattr(cls, n)})


# ---------------------------------------------------------------------------------------------
# ranks
# ---------------------------------------------------------------------------------------------
BLOCK = 50  # tensors per block: a model is nested like a real one (torch's load_state_dict
# filters keys per child, so a flat 10,000-child Sequential costs it 10^8 string compares)


def _model(n_tensors: int):
    torch.manual_seed(0)
    blocks = []
    for start in range(0, n_tensors, BLOCK):
        count = min(BLOCK, n_tensors - start)
        blocks.append(torch.nn.Sequential(*[torch.nn.Linear(SHAPE[1], SHAPE[0], bias=False) for _ in range(count)]))
    return torch.nn.Sequential(*blocks)


def _is_dedicated(name: str) -> bool:
    """Every other tensor, counted over the whole model ("<block>.<index>.weight")."""
    block, index = name.split(".")[:2]
    return (int(block) * BLOCK + int(index)) % 2 == 0


def _build(n_tensors: int, dedicated: bool, replicate: int):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import dmuon

    world = dist.get_world_size()
    if replicate > 1:
        mesh = init_device_mesh("cpu", (replicate, world // replicate), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh("cpu", (world,))
    model = _model(n_tensors)
    predicate = (lambda n, p: _is_dedicated(n)) if dedicated else (lambda n, p: False)
    dmuon.dedicate_params(model, mesh, predicate)
    fully_shard(model, mesh=mesh)  # one FSDP2 group: per-tensor costs are what is measured
    return model


def _measure(fn, clock: dict) -> dict:
    import torch.distributed as dist

    gc.collect()
    clock.clear()
    dist.barrier()
    t0, c0 = time.perf_counter(), cpu_seconds()
    fn()
    cpu = cpu_seconds() - c0
    dist.barrier()
    return {"wall_s": time.perf_counter() - t0, "cpu_s": cpu, "phases": dict(clock)}


def _profiled(fn, path: str | None):
    """``fn`` under cProfile, stats written to ``path`` (or just ``fn`` without a path)."""
    if path is None:
        return fn
    import cProfile

    def run():
        profile = cProfile.Profile()
        profile.enable()
        try:
            fn()
        finally:
            profile.disable()
            profile.dump_stats(path)

    return run


def worker(rank, world, n_tensors, run_dir, saves, replicate=1, profile_dir=None, methods=METHODS):
    """The methods, interleaved: ``saves`` saves of each, then a load of the last."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import dmuon.dcp as ddcp
    from dmuon.dcp.format import METADATA, is_manifest_name
    from dmuon.dcp.gc_pause import paused_gc

    t0 = time.perf_counter()
    model = _build(n_tensors, True, replicate)
    plain = _build(n_tensors, False, replicate)
    build_s = time.perf_counter() - t0
    clock: dict = defaultdict(float)
    dmuon_planner = timed(ddcp.DMuonSavePlanner, clock)
    dmuon_loader = timed(ddcp.DMuonLoadPlanner, clock)
    dmuon_writer = timed(ddcp.DMuonStorageWriter, clock)
    dmuon_reader = timed(ddcp.DMuonStorageReader, clock)
    torch_planner = timed(dcp.DefaultSavePlanner, clock)
    torch_planner_gc_paused = timed(dcp.DefaultSavePlanner, clock, "GcPaused")
    torch_loader = timed(dcp.DefaultLoadPlanner, clock)
    torch_writer = timed(dcp.FileSystemWriter, clock)
    torch_reader = timed(dcp.FileSystemReader, clock)
    # One planner object per method for the whole run, as a training job keeps one: the
    # repeated saves are where caching the plan of an unchanged layout can pay.
    from dmuon.dcp.plan_cache import SavePlanCache

    planners = {"dmuon": dmuon_planner(plan_cache=SavePlanCache()),
                "torch": torch_planner(enable_plan_caching=True),
                PEER_GC_PAUSED: torch_planner_gc_paused(enable_plan_caching=True)}
    collector = {"dmuon": paused_gc, "torch": contextlib.nullcontext, PEER_GC_PAUSED: paused_gc}

    # dmuon's two methods are dmuon.dcp.save / load spelled out (to put timers in): AppState,
    # dmuon's planner, writer / reader, garbage collector paused.
    def save(method, path):
        if method == "dmuon":
            state = ddcp.AppState(model).state_dict()
            with paused_gc():
                dcp.save(state, storage_writer=dmuon_writer(path), planner=planners["dmuon"])
        else:
            with collector[method]():
                dcp.save(plain.state_dict(), storage_writer=torch_writer(path), planner=planners[method])

    def load(method, path):
        if method == "dmuon":
            app = ddcp.AppState(model)
            state = app.state_dict()
            with paused_gc():
                dcp.load(state, storage_reader=dmuon_reader(path), planner=dmuon_loader())
            app.load_state_dict(state)
        else:  # FSDP2's DTensors are loaded in place: no load_state_dict needed
            with collector[method]():
                dcp.load(plain.state_dict(), storage_reader=torch_reader(path), planner=torch_loader())

    def directory(method, i):
        return f"{run_dir}/{method.replace(', ', '-').replace(' ', '-')}-{i}"

    samples: dict = {m: {"save": [], "load": []} for m in methods}
    sizes: dict = {}
    for i in range(saves):
        for method in methods if i % 2 == 0 else methods[::-1]:
            path = directory(method, i)
            prof = f"{profile_dir}/{method.split(',')[0]}-save{i}-rank{rank}.prof" if profile_dir else None
            samples[method]["save"].append(_measure(_profiled(lambda m=method, p=path: save(m, p), prof), clock))
    for method in methods:
        path = directory(method, saves - 1)
        prof = f"{profile_dir}/{method.split(',')[0]}-load-rank{rank}.prof" if profile_dir else None
        samples[method]["load"].append(_measure(_profiled(lambda m=method, p=path: load(m, p), prof), clock))
        if rank == 0:
            names = os.listdir(path)
            sizes[method] = {
                "metadata_bytes": os.path.getsize(f"{path}/{METADATA}"),
                "manifest_bytes": sum(os.path.getsize(f"{path}/{n}") for n in names if is_manifest_name(n)),
                "files": len(names),
            }
    dist.barrier()
    if rank == 0:
        for i in range(saves):
            for method in methods:
                shutil.rmtree(directory(method, i), ignore_errors=True)
    dist.barrier()
    return {"samples": samples, "sizes": sizes, "build_s": build_s}


def torchrun_main(args) -> None:
    """Entry point of one rank under torchrun (the 2-node run)."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    result = worker(dist.get_rank(), dist.get_world_size(), args.tensors[0], args.run_dir, args.saves,
                    replicate=args.replicate)
    torch.save(result, f"{args.out_dir}/rank{dist.get_rank()}.pt")
    dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------
# summary (parent)
# ---------------------------------------------------------------------------------------------
def _merge(per_rank: list[dict]) -> dict:
    """Per-rank samples -> one per sample: wall and phases of the slowest rank, CPU summed."""
    merged: dict = {}
    for method, ops in per_rank[0]["samples"].items():
        merged[method] = {}
        for op, first in ops.items():
            rows = []
            for j in range(len(first)):
                row = [r["samples"][method][op][j] for r in per_rank]
                phases = {k: max(s["phases"].get(k, 0.0) for s in row) for k in row[0]["phases"]}
                rows.append({"wall_s": max(s["wall_s"] for s in row), "cpu_s": sum(s["cpu_s"] for s in row),
                             "phases": phases})
            merged[method][op] = rows
    return merged


SAVE_PHASES = ("local plan", "global plan", "write", "commit")
LOAD_PHASES = ("metadata", "local plan", "global plan", "read")


def print_case(label: str, merged: dict, sizes: dict, build_s: float) -> None:
    print(f"\n[{label}] (model build {build_s:.1f}s)")
    head = f"  {'':<30}{'wall s':>8}{'CPU s':>8}" + "".join(f"{p:>13}" for p in SAVE_PHASES)
    methods = list(merged)
    print(head)
    for method in methods:
        for j, s in enumerate(merged[method]["save"]):
            cells = "".join(f"{s['phases'].get(p, 0.0):>13.3f}" for p in SAVE_PHASES)
            print(f"  {method + ' save #' + str(j + 1):<30}{s['wall_s']:>8.2f}{s['cpu_s']:>8.2f}{cells}")
    print(f"  {'':<30}{'':>16}" + "".join(f"{p:>13}" for p in LOAD_PHASES))
    for method in methods:
        s = merged[method]["load"][0]
        cells = "".join(f"{s['phases'].get(p, 0.0):>13.3f}" for p in LOAD_PHASES)
        print(f"  {method + ' load':<30}{s['wall_s']:>8.2f}{s['cpu_s']:>8.2f}{cells}")
    for method in methods:
        sz = sizes[method]
        print(f"  {method}: .metadata {sz['metadata_bytes'] / 2**20:.2f} MiB, manifest "
              f"{sz['manifest_bytes'] / 2**20:.2f} MiB, {sz['files']} files")
    last = {m: merged[m]["save"][-1]["wall_s"] for m in methods}
    load = {m: merged[m]["load"][0]["wall_s"] for m in methods}
    for peer in methods[1:]:
        print(f"  dmuon / {peer}: last save {last['dmuon'] / last[peer]:.2f}x, load {load['dmuon'] / load[peer]:.2f}x")


# ---------------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_two_nodes(args, run_dir: str, per_node: int = 4) -> tuple[list[dict], str]:
    """Two torchrun agents on localhost, c10d rendezvous, HSDP 2 x ``per_node``."""
    out_dir = tempfile.mkdtemp(prefix="ranks-", dir=run_dir)
    port = _free_port()
    common = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", str(per_node),
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "dmuon-scale",
        "--max-restarts", "0", os.path.abspath(__file__), "--torchrun-worker", "--tensors", str(args.tensors[0]),
        "--saves", str(args.saves), "--replicate", "2", "--run-dir", run_dir, "--out-dir", out_dir,
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO)
    agents = [subprocess.Popen(common, env=env) for _ in range(2)]
    try:
        codes = [agent.wait(timeout=args.timeout) for agent in agents]
    finally:
        for agent in agents:
            if agent.poll() is None:
                agent.kill()
                agent.wait()
    if any(codes):
        raise RuntimeError(f"torchrun agents exited with {codes}")
    world = 2 * per_node
    return [torch.load(f"{out_dir}/rank{r}.pt", weights_only=False) for r in range(world)], f"2 nodes x {per_node}"


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tensors", type=int, nargs="+", default=[2000, 10000])
    parser.add_argument("--worlds", type=int, nargs="*", default=[8, 16])
    parser.add_argument("--saves", type=int, default=2, help="saves in a row per method (default 2)")
    parser.add_argument("--nodes", action="store_true", help="also the 2-node torchrun run (HSDP 2x4)")
    parser.add_argument("--peer-gc-paused", action="store_true",
                        help="also torch's DCP with Python's garbage collector paused, as dmuon's save/load pause it")
    parser.add_argument("--root", default=None, help="where checkpoints go (default: a temp dir)")
    parser.add_argument("--json", default=None)
    parser.add_argument("--timeout", type=float, default=3600)
    parser.add_argument("--profile", default=None, metavar="DIR",
                        help="write a cProfile of every save and load of every rank here (times inflate)")
    # the torchrun worker's own arguments
    parser.add_argument("--torchrun-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--replicate", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--run-dir", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out-dir", default=None, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.torchrun_worker:
        torchrun_main(args)
        return
    from harness import run_ranks

    print("command: " + " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv]))
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}")
    print(f"model: N x {SHAPE} fp32, every other one dedicated; torch DCP: the same N all-FSDP2; "
          f"{args.saves} saves in a row per method, then one load")
    run_dir = tempfile.mkdtemp(prefix="dmuon-bench-scale-", dir=args.root)
    report: dict = {"command": sys.argv, "torch": torch.__version__, "cases": []}
    try:
        cases = [(n, w) for n in args.tensors for w in args.worlds]
        for n, world in cases:
            methods = METHODS + ((PEER_GC_PAUSED,) if args.peer_gc_paused else ())
            per_rank = run_ranks(worker, world, n, run_dir, args.saves, profile_dir=args.profile, methods=methods,
                                 timeout=args.timeout)
            merged = _merge(per_rank)
            label = f"{n} tensors, {world} ranks"
            print_case(label, merged, per_rank[0]["sizes"], max(r["build_s"] for r in per_rank))
            report["cases"].append({"tensors": n, "world": world, "samples": merged, "sizes": per_rank[0]["sizes"]})
            sys.stdout.flush()
        if args.nodes:
            per_rank, how = run_two_nodes(args, run_dir)
            merged = _merge(per_rank)
            print_case(f"{args.tensors[0]} tensors, {how}, HSDP", merged, per_rank[0]["sizes"],
                       max(r["build_s"] for r in per_rank))
            report["cases"].append({"tensors": args.tensors[0], "world": how, "samples": merged,
                                    "sizes": per_rank[0]["sizes"]})
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
        print(f"\nremoved {run_dir}; load average {os.getloadavg()[0]:.2f}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
