"""Save and load wall time and CPU of dmuon.dcp against torch's DCP, the storage limit and the
flat path, in each page-cache state a user meets, made to be read on a noisy machine.

    python benchmarks/save_load.py [--mib 512] [--repeats 5] [--warmup 1] [--worlds 2 4]
                                   [--methods raw dmuon torch flat async] [--reshard 2:4 4:2]
                                   [--states natural cold warm] [--roots DIR ...] [--json PATH]
                                   [--profile N]

The model: ``--mib`` worth of square fp32 1024x1024 matrices (``nn.Linear``, no bias), every
other one dedicated to one rank, the rest FSDP2; model weights only (optimizer state is more
tensors of the same kinds). torch's DCP saves the same model built all-FSDP2 (the fair peer:
it has no dedicated parameters), with ``FileSystemWriter``'s defaults. Methods:

  raw      the storage limit, measured as carefully as dmuon: each rank writes exactly the
           bytes of its own dmuon data file(s) to its own file, in four ways (``raw_io.py``),
           each a method of its own, interleaved with the others and every fsynced:
           raw-plain (write + fsync), raw-behind (writeback started every 16 MiB as it goes),
           raw-threads (two threads' pwrites, writeback as they go), raw-direct (O_DIRECT
           from aligned memory); each reads its file back its own way (4 MiB reads; 16 MiB
           reads after fadvise(SEQUENTIAL); two threads; O_DIRECT). ``raw-best`` is, in each
           repeat and for each operation, the fastest of them (slowest rank's wall): the
           limit the targets are stated against. ``raw`` on the command line means all four.
  dmuon    dmuon.dcp.save(model, None, path) / dmuon.dcp.load(model, None, path), defaults
  torch    dcp.save(plain_model.state_dict(), storage_writer=FileSystemWriter(path)) / dcp.load
  flat     the seed's path: dmuon.get_model_state_dict + rank-0 torch.save + fsync /
           torch.load(mmap=True) on every rank + dmuon.set_model_state_dict
  async    dmuon.dcp.async_save: the time until it returns (training is blocked that long)
  dmuon-buffered, dmuon-direct   dmuon with ``direct_io=False`` / ``True`` (not by default:
           the two ways the write-path rule chooses between; dmuon-buffered is also
           what a copy meant for a restore on this node is written as)

Every save is followed by three loads, one per page-cache state:

  natural  right after the save, the files as that method's own save left them (a job that
           rolls back to its own latest checkpoint on the same node)
  cold     every file's pages dropped first (written back, then ``posix_fadvise(DONTNEED)``,
           no root needed): a restart on a node that never had the files
  warm     every file read once first: the loads measure CPU work alone

What is measured, and why this way:

* Wall time, barrier to barrier, of the slowest rank: what the job waits. CPU-s/GiB: user +
  sys of each rank's process (every thread: DCP's writer threads count) around the call only,
  summed over ranks, per GiB of model: how much work a method does. Users feel wall time
  first; a CPU gain that costs wall time is a regression.
* Interleaved: each repeat runs every method once (save, its three loads, delete) in an order
  rotated one place per repeat, so drifting machine load hits all alike. ``--warmup`` rounds
  run the same way, unrecorded (first calls: lazy imports, staging buffers).
* Paired ratios: within a repeat dmuon and its peer ran back to back; the median over repeats
  of the per-repeat ratio is what a comparison rests on (``harness.paired_ratio``). Min and
  median of each method's own times are printed too, with the spread (max - min) / median.
* Storage roots: a local-disk temp dir and ``/dev/shm`` by default. Each run writes under one
  unique directory per root, removed at the end (also on errors, Ctrl-C and SIGTERM); each
  checkpoint is deleted once measured. A root without room for 4x the model is skipped.
* Reproducibility: run it twice (``compare_runs.py`` puts two JSON reports side by side).
* The device: at the start, per root, one process writes 1 GiB with ``O_DIRECT`` (+ fsync)
  and reads it back the same way: its sequential bandwidth, printed and in the JSON.
* ``--profile N``: after the measurements, per world size, N more steady dmuon saves with
  cProfile on every rank; the slowest rank's time by phase (planning, copy into the page
  cache, checksums, writeback kicks, fsyncs, collectives, commit) and its top functions.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import shlex
import shutil
import signal
import statistics
import sys
import tempfile
import time

import harness
import raw_io
import torch

DIM = 1024
RAW_METHODS = tuple(f"raw-{w}" for w in raw_io.WRITES)  # each read back as raw_io.READS, in order
RAW_READ = dict(zip(raw_io.WRITES, raw_io.READS))
METHODS = ("raw", "dmuon", "torch", "flat", "async")
EXTRA_METHODS = ("dmuon-buffered", "dmuon-direct", "dmuon-direct-read", *RAW_METHODS)
STATES = ("natural", "cold", "warm")
LOADS = tuple(f"load-{state}" for state in STATES)
ROOM_FACTOR = 4  # a root needs free space for this many models
LABELS = {
    "raw-plain": "raw write+fsync / 4M reads", "raw-behind": "raw write-behind / seq reads",
    "raw-threads": "raw 2 threads / 2 threads", "raw-direct": "raw O_DIRECT / O_DIRECT",
    "raw-best": "raw best of the four", "dmuon": "dmuon.dcp", "torch": "torch DCP (all FSDP2)",
    "flat": "flat: gather + torch.save", "async": "dmuon.dcp.async_save (blocking)",
    "dmuon-buffered": "dmuon.dcp direct_io=False", "dmuon-direct": "dmuon.dcp direct_io=True",
    "dmuon-direct-read": "dmuon.dcp, loaded direct_io=True",
}
# The targets, each (ours, peer, operation, measure, bound, kind): "max" means ours /
# peer's must stay at or below the bound, "min" at or above it.
TARGETS = (
    *(("dmuon", "torch", op, "wall", 0.9 if op == "save" else 0.8, "max") for op in ("save", *LOADS)),
    ("dmuon", "raw-best", "save", "wall", 1.2, "max"),  # issue 36
    ("dmuon", "raw-best", "load-cold", "wall", 1.1, "max"),
    ("dmuon", "torch", "save", "cpu", 0.5, "max"),
    *(("dmuon", "torch", op, "cpu", 0.6, "max") for op in LOADS),
    ("flat", "dmuon", "save", "wall", 2.0, "min"),
)


# ---------------------------------------------------------------------------------------------
# inside each rank
# ---------------------------------------------------------------------------------------------
def build(n_matrices: int, dedicated: bool, replicate: int = 1, meta: bool = False):
    """The model on every rank: 1-D FSDP2, or HSDP ``replicate`` x the rest. ``meta``: built on
    the meta device, sharded, then given memory and random values: no rank ever holds the whole
    model (4 ranks of a 4 GiB model would otherwise hold 16 GiB at once while they build)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import dmuon

    world = dist.get_world_size()
    if replicate == 1:
        mesh = init_device_mesh("cpu", (world,))
    else:
        mesh = init_device_mesh("cpu", (replicate, world // replicate), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0)
    device = "meta" if meta else "cpu"
    model = torch.nn.Sequential(*[torch.nn.Linear(DIM, DIM, bias=False, device=device) for _ in range(n_matrices)])
    predicate = (lambda n, p: int(n.split(".")[0]) % 2 == 0) if dedicated else (lambda n, p: False)
    dmuon.dedicate_params(model, mesh, predicate)
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if meta:
        model.to_empty(device="cpu")
        with torch.no_grad():
            for param in model.parameters():
                (param.to_local() if hasattr(param, "to_local") else param).normal_()
    return model


def on_rank_zero(fn, *args) -> None:
    """Collective: ``fn(*args)`` on rank 0 while the others wait (files on one machine)."""
    import torch.distributed as dist

    dist.barrier()
    if dist.get_rank() == 0:
        fn(*args)
    dist.barrier()


def operations(rank: int, model, plain_model, share: int) -> dict:
    """method -> (save, load), each taking the checkpoint path."""
    import torch.distributed.checkpoint as dcp

    import dmuon
    import dmuon.dcp as ddcp

    source = raw_io.Source()

    def raw_with(how):
        def save(path):
            os.makedirs(path, exist_ok=True)
            raw_io.write(how, f"{path}/{rank}.bin", share, source)

        return save, lambda path: raw_io.read(RAW_READ[how], f"{path}/{rank}.bin", source)

    def flat_save(path):
        state = dmuon.get_model_state_dict(model)  # rank 0 gets everything, the others {}
        if rank == 0:
            os.makedirs(path, exist_ok=True)
            with open(f"{path}/model.pt", "wb") as f:
                torch.save(state, f)
                f.flush()
                os.fsync(f.fileno())

    def dmuon_with(options, load_options=None):
        return (lambda path: ddcp.save(model, None, path, storage_options=options),
                lambda path: ddcp.load(model, None, path, storage_options=load_options or options))

    return {
        **{f"raw-{how}": raw_with(how) for how in raw_io.WRITES},
        "dmuon": dmuon_with(None),
        "dmuon-buffered": dmuon_with({"direct_io": False}),
        "dmuon-direct": dmuon_with({"direct_io": True}),
        # the default save, then a load that reads cold files past the page cache
        "dmuon-direct-read": dmuon_with(None, {"direct_io": True}),
        "torch": (
            lambda path: dcp.save(plain_model.state_dict(), storage_writer=dcp.FileSystemWriter(path)),
            lambda path: dcp.load(plain_model.state_dict(), storage_reader=dcp.FileSystemReader(path)),
        ),
        "flat": (flat_save,
                 lambda path: dmuon.set_model_state_dict(model, torch.load(f"{path}/model.pt", mmap=True))),
    }


def measure_async(model, path: str) -> dict:
    """Wall and CPU time until async_save returns; ``total_s`` until every rank's write is done."""
    import gc

    import torch.distributed as dist

    import dmuon.dcp as ddcp

    gc.collect()
    dist.barrier()
    start, cpu_start = time.perf_counter(), harness.cpu_seconds()
    handle = ddcp.async_save(model, None, path)
    blocking, cpu = time.perf_counter() - start, harness.cpu_seconds() - cpu_start
    handle.wait()
    dist.barrier()
    return {"wall_s": blocking, "cpu_s": cpu, "total_s": time.perf_counter() - start}


def write_path_chosen() -> str:
    """Which way dmuon's saves wrote in this process (after its first save): direct I/O or
    buffered writes, and the rule that said so; it decides most of a save's time here."""
    from dmuon.dcp.storage.write_path import known_choices

    return "; ".join(choice.describe() for choice in known_choices().values()) or "no streamed write yet"


def prepare(path: str, state: str) -> None:
    """Collective: put the checkpoint's files in ``state`` before a load."""
    if state == "cold":
        on_rank_zero(harness.drop_pages, path)
    elif state == "warm":
        on_rank_zero(harness.warm_pages, path)


def worker(rank, world, n_matrices, run_dir, methods, repeats, warmup, states=STATES):
    """Every method, interleaved, at one world size: this rank's samples of each operation."""
    import dmuon.dcp as ddcp
    from dmuon.dcp.format import rank_of_data_file

    model = build(n_matrices, dedicated=True, meta=True)
    plain_model = build(n_matrices, dedicated=False, meta=True) if "torch" in methods else None
    # The raw baseline writes exactly the bytes of this rank's dmuon data file(s).
    sizing = f"{run_dir}/w{world}-sizing"
    ddcp.save(model, None, sizing)
    share = sum(os.path.getsize(f"{sizing}/{n}") for n in os.listdir(sizing) if rank_of_data_file(n) == rank)
    on_rank_zero(shutil.rmtree, sizing)
    write_path = write_path_chosen()
    ops = operations(rank, model, plain_model, share)

    loads = tuple(f"load-{state}" for state in states)
    samples: dict = {m: ({"block": []} if m == "async" else {op: [] for op in ("save", *loads)}) for m in methods}
    orders = []
    for repeat in range(-warmup, repeats):
        order = harness.rotated(methods, repeat)
        results: dict = {}
        for method in order:
            path = f"{run_dir}/w{world}-r{repeat}-{method}"
            if method == "async":
                results[method] = {"block": measure_async(model, path)}
            else:
                save, load = ops[method]
                results[method] = {"save": harness.measure(lambda save=save, path=path: save(path))}
                for state in states:  # natural first: right after the save
                    prepare(path, state)
                    results[method][f"load-{state}"] = harness.measure(lambda load=load, path=path: load(path))
            on_rank_zero(shutil.rmtree, path)
        if repeat >= 0:
            orders.append(order)
            for method, by_op in results.items():
                for op, sample in by_op.items():
                    samples[method][op].append(sample)
    if "async" in methods:
        ddcp.api.model_checkpointer(model).close()  # frees its staging buffers
    return {"share_bytes": share, "orders": orders, "samples": samples, "write_path": write_path}


# Where a save's time goes. Disjoint leaves of cProfile's own time (tottime), matched in its
# function names, plus the fsyncs timed one by one (split by what they made durable); the
# planner's calls by their time with callees (they do no I/O and wait for no one).
LEAVES = (
    ("copy into the page cache (write)", ("of '_io.BufferedWriter' objects", "posix.write", "posix.pwrite")),
    ("writeback kicks (sync_file_range)", ("start_writeback",)),
    ("checksums (XXH3 of every 16 KiB)", ("xxh", "crc32")),
    ("collectives (waiting for the other ranks)", ("_distributed_c10d",)),
)
PLANNING = ("save_planner.py", "plan_cache.py", "prepare_local_plan", "prepare_global_plan")
COMMIT = ("_commit_reused", "_commit_gathered")
FSYNC_SMALL = 1 << 20  # fsyncs of smaller files (metadata, manifest) and of directories: the commit's


def _timed_fsyncs(log: list):
    """``os.fsync`` that appends (seconds, bytes of the file or -1 for a directory) to ``log``."""
    import stat

    fsync = os.fsync

    def timed(fd):
        start = time.perf_counter()
        try:
            return fsync(fd)
        finally:
            info = os.fstat(fd)
            log.append((time.perf_counter() - start, -1 if stat.S_ISDIR(info.st_mode) else info.st_size))

    return timed


def profile_worker(rank, world, n_matrices, run_dir, rounds):
    """``rounds`` steady dmuon saves under cProfile (after one unprofiled), each deleted after:
    wall per save, this rank's profile rows and its fsyncs."""
    import cProfile
    import pstats

    import dmuon.dcp as ddcp

    model = build(n_matrices, dedicated=True, meta=True)
    ddcp.save(model, None, f"{run_dir}/w{world}-profile-warm")  # first save: the full rounds
    on_rank_zero(shutil.rmtree, f"{run_dir}/w{world}-profile-warm")
    walls, stats, fsyncs = [], None, []
    for round_ in range(rounds):
        path = f"{run_dir}/w{world}-profile-{round_}"
        profiler = cProfile.Profile()
        harness.measure(lambda: None)  # (a barrier and a gc outside the profile)
        plain_fsync, os.fsync = os.fsync, _timed_fsyncs(fsyncs)
        start = time.perf_counter()
        profiler.enable()
        try:
            ddcp.save(model, None, path)
        finally:
            profiler.disable()
            os.fsync = plain_fsync
        walls.append(time.perf_counter() - start)
        stats = pstats.Stats(profiler) if stats is None else stats.add(profiler)
        on_rank_zero(shutil.rmtree, path)
    rows = [(pstats.func_std_string(func), tt, ct, nc) for func, (_cc, nc, tt, ct, _callers) in stats.stats.items()]
    return {"walls": walls, "rows": rows, "fsyncs": fsyncs, "write_path": write_path_chosen()}


def phases_of(result: dict) -> tuple[list[tuple[str, float]], float, float]:
    """Seconds per phase over all profiled saves (disjoint; the rest is Python around them: the
    plan's items, staging, framing, torch's DCP glue), the profiled total, and the commit's
    step's time with callees (it overlaps the phases: its writes, fsyncs and waits)."""
    rows = [r for r in result["rows"] if "timed" not in r[0]]  # (the fsync wrapper: timed apart)
    total = sum(tt for _n, tt, _ct, _nc in result["rows"])
    big = sum(t for t, size in result["fsyncs"] if size >= FSYNC_SMALL)
    small = sum(t for t, size in result["fsyncs"] if size < FSYNC_SMALL)
    out = [("fsync of the data file", big), ("fsyncs of the small files and directories (commit)", small)]
    out += [(phase, sum(tt for name, tt, _ct, _nc in rows if any(m in name for m in matches)))
            for phase, matches in LEAVES]
    out.append(("planning (planner, plan cache)",
                sum(ct for name, _tt, ct, _nc in rows if any(m in name for m in PLANNING)
                    and name.rsplit("(", 1)[-1].rstrip(")") in ("set_up_planner", "create_local_plan",
                                                                "create_global_plan", "finish_plan",
                                                                "prepare_local_plan", "prepare_global_plan"))))
    out.append(("everything else (Python: items, staging, framing, DCP glue)", total - sum(s for _, s in out)))
    commit = max((ct for name, _tt, ct, _nc in rows if any(m in name for m in COMMIT)), default=0.0)
    return out, total, commit


def print_profile(label: str, world: int, per_rank: list[dict], share: float) -> list[dict]:
    rounds = len(per_rank[0]["walls"])
    print(f"\n[{label}] profile of {rounds} steady dmuon saves, {world} ranks, {share:.0f} MiB per rank "
          f"(cProfile on every rank; its overhead inflates the Python phases)")
    report = []
    for rank, result in enumerate(per_rank):
        phases, total, commit = phases_of(result)
        wall = statistics.median(result["walls"])
        report.append({"rank": rank, "walls": result["walls"], "profiled_s": total, "phases": phases,
                       "commit_s": commit, "fsyncs": result["fsyncs"], "write_path": result.get("write_path")})
        print(f"  rank {rank}: save wall median {wall:.3f} s; per save, profiled {total / rounds:.3f} s; "
              f"write path {result.get('write_path')}:")
        for phase, seconds in phases:
            print(f"    {phase:<62}{seconds / rounds:>8.3f} s {100 * seconds / total:>5.1f}%")
        if commit:
            print(f"    (the commit step, with everything it called, overlapping the above: {commit / rounds:.3f} s)")
    top = sorted(per_rank[0]["rows"], key=lambda r: -r[1])[:10]
    print("  rank 0, top functions by own time per save:")
    for name, tt, _ct, nc in top:
        print(f"    {tt / rounds:>8.4f} s {nc // rounds:>7} calls  {name[-90:]}")
    return report


def reshard_save_worker(rank, world, n_matrices, path):
    """The checkpoints a resharded load starts from, dmuon's and torch DCP's."""
    import torch.distributed.checkpoint as dcp

    import dmuon.dcp as ddcp

    ddcp.save(build(n_matrices, dedicated=True), None, f"{path}/dmuon")
    dcp.save(build(n_matrices, dedicated=False).state_dict(), storage_writer=dcp.FileSystemWriter(f"{path}/torch"))


def reshard_load_worker(rank, world, n_matrices, path, repeats, warmup):
    """Load checkpoints saved at another world size, dmuon and torch DCP interleaved, cold and warm."""
    import torch.distributed.checkpoint as dcp

    import dmuon.dcp as ddcp

    model = build(n_matrices, dedicated=True)
    plain_model = build(n_matrices, dedicated=False)
    loads = {
        "dmuon": lambda: ddcp.load(model, None, f"{path}/dmuon"),
        "torch": lambda: dcp.load(plain_model.state_dict(), storage_reader=dcp.FileSystemReader(f"{path}/torch")),
    }
    samples: dict = {m: {f"load-{s}": [] for s in ("cold", "warm")} for m in loads}
    for repeat in range(-warmup, repeats):
        for method in harness.rotated(tuple(loads), repeat):
            for state in ("cold", "warm"):
                prepare(f"{path}/{method}", state)
                sample = harness.measure(loads[method])
                if repeat >= 0:
                    samples[method][f"load-{state}"].append(sample)
    return {"samples": samples}


# ---------------------------------------------------------------------------------------------
# summarising (parent process)
# ---------------------------------------------------------------------------------------------
def merge(per_rank: list[dict]) -> dict:
    """Per-rank samples -> one per repeat: wall of the slowest rank, CPU of every rank (a list);
    with ``raw-best``, each repeat's fastest raw method per operation, if any raw ran."""
    merged: dict = {}
    for method, by_op in per_rank[0]["samples"].items():
        merged[method] = {}
        for op in by_op:
            rows = zip(*(r["samples"][method][op] for r in per_rank))
            merged[method][op] = [
                {key: ([s[key] for s in row] if key == "cpu_s" else max(s[key] for s in row)) for key in row[0]}
                for row in rows
            ]
    raws = [m for m in RAW_METHODS if m in merged]
    if raws:
        merged["raw-best"] = {}
        for op in merged[raws[0]]:
            merged["raw-best"][op] = [
                {**min(row, key=lambda sample: sample["wall_s"]),
                 "method": raws[min(range(len(row)), key=lambda i: row[i]["wall_s"])]}
                for row in zip(*(merged[m][op] for m in raws))
            ]
    return merged


def series(samples: list[dict], measure: str, gib: float) -> list[float]:
    """One value per repeat: wall seconds, or CPU-s/GiB summed over ranks."""
    if measure == "wall":
        return [s["wall_s"] for s in samples]
    return [sum(s["cpu_s"]) / gib for s in samples]


def target_lines(samples: dict, gib: float, world: int) -> list[tuple[str, float, bool]]:
    """(description, paired ratio, met) for each of the issue's targets this run can check."""
    lines = []
    for ours, peer, op, measure, bound, kind in TARGETS:
        if kind == "min" and world < 4:
            continue  # the flat path's bound is set at 4 ranks
        if op not in samples.get(ours, {}) or op not in samples.get(peer, {}):
            continue
        ratio = harness.paired_ratio(series(samples[ours][op], measure, gib), series(samples[peer][op], measure, gib))
        met = ratio <= bound if kind == "max" else ratio >= bound
        sign = "<=" if kind == "max" else ">="
        lines.append((f"{op:<13} {measure:<4} {ours} / {peer}", ratio, met, f"{sign} {bound}"))
    return lines


WIDTH = 42


def print_table(title: str, samples: dict, gib: float, peer: str = "torch") -> None:
    print(f"\n{title}")
    print(f"  {'':<{WIDTH}}{'wall s':>17}{'':>8}{'CPU-s/GiB':>16}{'÷ ' + peer + ' (paired)':>20}")
    print(f"  {'':<{WIDTH}}{'min':>8}{'median':>9}{'spread':>8}{'min':>8}{'median':>8}{'wall':>10}{'CPU':>10}")
    for op in ("save", "load", *LOADS, "block"):
        for method, by_op in samples.items():
            if op not in by_op:
                continue
            wall, cpu = series(by_op[op], "wall", gib), series(by_op[op], "cpu", gib)
            w, c = harness.summary(wall), harness.summary(cpu)
            line = (f"  {op + ' ' + LABELS.get(method, method):<{WIDTH}}{w['min']:>8.3f}{w['med']:>9.3f}"
                    f"{100 * w['spread']:>7.0f}%{c['min']:>8.2f}{c['med']:>8.2f}")
            if method != peer and op in samples.get(peer, {}):
                peer_wall, peer_cpu = series(samples[peer][op], "wall", gib), series(samples[peer][op], "cpu", gib)
                line += f"{harness.paired_ratio(wall, peer_wall):>10.2f}{harness.paired_ratio(cpu, peer_cpu):>10.2f}"
            print(line)


def print_world(label: str, world: int, result: dict, gib: float) -> None:
    share = [round(b / 2**20, 1) for b in result["share_bytes"]]
    samples = result["samples"]
    print_table(f"[{label}] {world} ranks; dmuon data file per rank {share} MiB", samples, gib)
    for rank, chosen in enumerate(result.get("write_path") or []):
        print(f"  rank {rank}: dmuon's write path {chosen}")
    if "raw-best" in samples:
        for op, rows in samples["raw-best"].items():
            won = [r["method"] for r in rows]
            print(f"  raw-best {op}: " + ", ".join(f"{m} {won.count(m)}x" for m in dict.fromkeys(won)))
    if "async" in samples and "dmuon" in samples:
        block = harness.paired_ratio(series(samples["async"]["block"], "wall", gib),
                                     series(samples["dmuon"]["save"], "wall", gib))
        total = statistics.median(s["total_s"] for s in samples["async"]["block"])
        print(f"  async_save blocks for {100 * block:.1f}% of a sync dmuon save (paired median); "
              f"written after {total:.3f} s (median)")
    print_targets(target_lines(samples, gib, world))


def print_targets(lines) -> None:
    for text, ratio, met, bound in lines:
        print(f"  target {text:<40} {ratio:>6.2f}  ({bound}: {'met' if met else 'NOT met'})")


# ---------------------------------------------------------------------------------------------
# storage roots and cleanup (parent process)
# ---------------------------------------------------------------------------------------------
def room(root: str) -> int:
    """Bytes this run may put under ``root``: free space, and for tmpfs also available RAM."""
    where = os.path.abspath(root)
    while not os.path.exists(where):
        where = os.path.dirname(where)
    free = shutil.disk_usage(where).free
    if harness.fs_type(where) in harness.TMPFS:
        with open("/proc/meminfo") as meminfo:
            available = next(int(line.split()[1]) * 1024 for line in meminfo if line.startswith("MemAvailable:"))
        free = min(free, available)
    return free


def default_roots() -> list[str]:
    """A local-disk temp dir (the repository's parent if the temp dir is tmpfs) and /dev/shm."""
    local = tempfile.gettempdir()
    if harness.fs_type(local) in harness.TMPFS:
        local = os.path.dirname(harness.REPO)
    roots = [local]
    if os.path.isdir("/dev/shm") and os.path.realpath("/dev/shm") != os.path.realpath(local):
        roots.append("/dev/shm")
    return roots


def cleanup(run_dirs: list[str]) -> None:
    """Stop any rank still running (this script's own children only), then delete what it wrote."""
    for proc in multiprocessing.active_children():
        proc.kill()
        proc.join(5)
    for path in run_dirs:
        shutil.rmtree(path, ignore_errors=True)
        if os.path.exists(path):
            print(f"WARNING: could not remove {path}; delete it by hand", file=sys.stderr)


def _interrupted(signum, _frame):
    raise SystemExit(128 + signum)  # unwinds through the finally block that cleans up


def _pair(text: str) -> tuple[int, int]:
    a, b = (int(x) for x in text.split(":"))
    if a == b or min(a, b) < 1:
        raise argparse.ArgumentTypeError(f"{text}: want A:B with A != B")
    return a, b


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=int, default=512, help="model size in MiB (4 MiB per matrix; default 512)")
    parser.add_argument("--repeats", type=int, default=5, help="measured repeats (default 5)")
    parser.add_argument("--warmup", type=int, default=1, help="unrecorded rounds before them (default 1)")
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4], help="world sizes (default 2 4)")
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS + EXTRA_METHODS,
                        help="methods, interleaved (default: " + " ".join(METHODS) + ")")
    parser.add_argument("--states", nargs="+", default=list(STATES), choices=STATES,
                        help="page-cache states each save's loads are measured in (default: all three)")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="after the measurements, N cProfiled steady dmuon saves per world size")
    parser.add_argument("--no-device", action="store_true", help="skip the device bandwidth at the start")
    parser.add_argument("--reshard", type=_pair, nargs="*", default=[], metavar="A:B",
                        help="resharded loads, saved at A ranks, loaded at B (default: none)")
    parser.add_argument("--roots", nargs="+", default=None, metavar="DIR",
                        help="storage roots (default: a local-disk temp dir and /dev/shm)")
    parser.add_argument("--json", default=None, metavar="PATH", help="write every repeat's numbers here")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds per launch of ranks (default 3600)")
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.warmup < 0:
        parser.error("--repeats must be >= 1 and --warmup >= 0")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _interrupted)
    signal.signal(signal.SIGHUP, _interrupted)
    n_matrices = max(2, args.mib * 2**20 // (DIM * DIM * 4))
    model_bytes = n_matrices * DIM * DIM * 4
    gib = model_bytes / 2**30
    methods = tuple(dict.fromkeys(m for name in args.methods for m in (RAW_METHODS if name == "raw" else (name,))))
    print("command: " + " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv]))
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f} (1 min)")
    print(f"model: {n_matrices} x ({DIM}x{DIM}) fp32 = {model_bytes / 2**20:.0f} MiB, every other matrix "
          "dedicated; torch DCP on the same model all-FSDP2")
    print(f"{args.repeats} repeats (+{args.warmup} warm-up), methods interleaved, order rotated; each save is "
          f"followed by a load in each page-cache state of {args.states} (natural: as the save left it; cold: "
          "dropped; warm: read once first)")
    report = {
        "command": [sys.executable, *sys.argv], "torch": torch.__version__, "cpus": os.cpu_count(),
        "loadavg_start": os.getloadavg(), "args": {k: v for k, v in vars(args).items()},
        "n_matrices": n_matrices, "model_bytes": model_bytes, "roots": [], "worlds": [], "reshard": [],
        "complete": False,
    }
    run_dirs: list[str] = []
    try:
        for root in args.roots or default_roots():
            label = f"{root} ({harness.fs_type(root)})"
            need, free = ROOM_FACTOR * model_bytes, room(root)
            if free < need:
                print(f"\nSKIPPING {label}: {free / 2**30:.2f} GiB free, need {need / 2**30:.2f} GiB")
                report["roots"].append({"root": root, "label": label, "skipped": f"free {free} < need {need}"})
                continue
            os.makedirs(root, exist_ok=True)
            run_dir = tempfile.mkdtemp(prefix="dmuon-bench-", dir=root)
            run_dirs.append(run_dir)
            report["roots"].append({"root": root, "label": label, "run_dir": run_dir, "skipped": None})
            print(f"\n== storage root {label}: writing under {run_dir}", flush=True)
            if not args.no_device and harness.fs_type(root) not in harness.TMPFS:
                device = raw_io.device_bandwidth(run_dir)
                report["roots"][-1]["device"] = device
                print(f"device, one process, 1 GiB O_DIRECT in 64 MiB calls: write + fsync "
                      f"{device['write_gib_s']:.2f} GiB/s, read {device['read_gib_s']:.2f} GiB/s", flush=True)
            for world in args.worlds:
                per_rank = harness.run_ranks(worker, world, n_matrices, run_dir, methods, args.repeats,
                                             args.warmup, tuple(args.states), timeout=args.timeout)
                result = {"share_bytes": [r["share_bytes"] for r in per_rank], "orders": per_rank[0]["orders"],
                          "samples": merge(per_rank), "write_path": [r.get("write_path") for r in per_rank]}
                report["worlds"].append({"root": root, "world": world, **result})
                print_world(label, world, result, gib)
                sys.stdout.flush()
            for world in args.worlds if args.profile else ():
                per_rank = harness.run_ranks(profile_worker, world, n_matrices, run_dir, args.profile,
                                             timeout=args.timeout)
                profile = print_profile(label, world, per_rank, model_bytes / 2**20 / world)
                report.setdefault("profiles", []).append({"root": root, "world": world, "ranks": profile})
                sys.stdout.flush()
            for source in sorted({a for a, _ in args.reshard}):
                path = f"{run_dir}/reshard-from-{source}"
                harness.run_ranks(reshard_save_worker, source, n_matrices, path, timeout=args.timeout)
                for a, b in args.reshard:
                    if a == source:
                        per_rank = harness.run_ranks(reshard_load_worker, b, n_matrices, path, args.repeats,
                                                     args.warmup, timeout=args.timeout)
                        samples = merge(per_rank)
                        report["reshard"].append({"root": root, "from": a, "to": b, "samples": samples})
                        print_table(f"[{label}] resharded load {a} -> {b} ranks", samples, gib)
                        print_targets(target_lines(samples, gib, b))
                        sys.stdout.flush()
                shutil.rmtree(path)
        report["complete"] = True
    finally:
        cleanup(run_dirs)
        report["loadavg_end"] = os.getloadavg()
        print(f"\nload average {report['loadavg_end'][0]:.2f} (1 min) at the end; removed {run_dirs}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(report, f, indent=1)
            print(f"every repeat's numbers: {args.json}" + ("" if report["complete"] else " (incomplete run)"))


if __name__ == "__main__":
    main()
