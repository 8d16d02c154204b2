"""Save / load cost of dmuon.dcp against the storage limit and the alternatives, made to be
read on a noisy machine.

    python benchmarks/save_load.py [--mib 512] [--repeats 5] [--warmup 1] [--worlds 2 4]
                                   [--reshard 2:4 4:2 4:3] [--roots DIR ...] [--cache warm|cold]
                                   [--json PATH]

The model: ``--mib`` worth of square fp32 1024x1024 matrices (``nn.Linear``, no bias), every
other one dedicated to one rank, the rest FSDP2. Model weights only (optimizer state is more
tensors of the same kinds). torch's DCP runs on the same model built without dedicated params
(all FSDP2). Methods:

  raw    each rank writes exactly the bytes of its own dmuon data file with plain write + fsync
         and reads them back with plain reads: the storage limit
  dmuon  dmuon.dcp.save(model, None, path) / dmuon.dcp.load(model, None, path)
  torch  dcp.save(plain_model.state_dict(), storage_writer=dcp.FileSystemWriter(path)) /
         dcp.load(..., storage_reader=dcp.FileSystemReader(path))
  flat   dmuon.get_model_state_dict + rank-0 torch.save + fsync /
         torch.load(mmap=True) on every rank + dmuon.set_model_state_dict
  async  dmuon.dcp.async_save(model, None, path): the time until it returns (then handle.wait()),
         also as % of the sync dmuon save

plus resharded loads (saved with world A, loaded with world B, dmuon and torch DCP) for the
``--reshard`` pairs, and everything once per storage root.

What is measured, and why this way:

* Two numbers per operation. **Wall time**, barrier to barrier, of the slowest rank. **CPU
  seconds per GiB**: user + sys CPU time of each rank's process, from
  ``getrusage(RUSAGE_SELF)`` (every thread of the process, so DCP's writer threads and
  async_save's background thread count), taken inside the rank around the call only -- not
  around the barriers -- summed over ranks and divided by the model's GiB. On a shared
  machine wall time moves 2-4x with other load while CPU time mostly does not: CPU-s/GiB says
  how much work a method does, wall time how long it took here and now.
* Interleaved. Each repeat runs every method once -- save, then load of what it just saved,
  then delete it -- in an order rotated by one position per repeat, so a drift in machine
  load hits all methods alike and none always runs first. ``--warmup`` rounds run the same
  way and are not recorded (first-call costs: lazy imports, async_save's staging buffers).
* Min and median over ``--repeats``: the min is the least disturbed run, the median the
  typical one; "spread" is (max - min) / median, a per-row noise gauge. Ratios (x raw,
  dmuon / torch DCP) are ratios of medians.
* Storage roots. By default a local-disk temp dir and tmpfs ``/dev/shm`` (no device at all,
  so only the CPU side remains). Each run makes one unique directory under each root and
  removes it at the end, also on errors, Ctrl-C and SIGTERM; each checkpoint is deleted as
  soon as it has been measured, so at most two exist at a time. A root without room for 4x
  the model (for tmpfs also in available RAM) is skipped with a printed line.
* Saves fsync (dmuon's writer and torch's FileSystemWriter do; raw and flat do it explicitly),
  so on a disk root save times include the device.
* Page cache: before each load (not timed) every file of the checkpoint is put in the same
  cache state, since the writers leave different ones: dmuon's bypasses the page cache on
  ext4/xfs (direct I/O), torch's and the raw baseline's fill it. ``--cache warm`` (default)
  reads each file once, so loads are served from memory and measure CPU work (read calls,
  checksums, copies); ``--cache cold`` drops the files' cached pages
  (``posix_fadvise(DONTNEED)``, no root needed), so loads read the device.
* Reproducibility: run it twice; medians should agree within +-15%. If they do not, the
  machine was too busy (the load average is printed at the start and the end): use more
  ``--repeats`` or a quieter moment, and compare ratios within one run rather than seconds
  across runs.
"""
from __future__ import annotations

import argparse
import gc
import json
import multiprocessing
import os
import resource
import shlex
import shutil
import signal
import statistics
import sys
import tempfile
import time

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, REPO)

import torch  # noqa: E402

from tests.helpers.launch import run_ranks  # noqa: E402

DIM = 1024
METHODS = ("raw", "dmuon", "torch", "flat", "async")
RESHARD_METHODS = ("dmuon", "torch")
RAW_BLOCK = 4 << 20  # bytes per write / read call of the raw baseline: one matrix
ROOM_FACTOR = 4  # a root needs free space for this many models
TMPFS = ("tmpfs", "ramfs")
ROWS = (  # (method, operation, label) in table order
    ("raw", "save", "raw write + fsync"),
    ("dmuon", "save", "dmuon.dcp.save"),
    ("torch", "save", "torch dcp.save (all FSDP2)"),
    ("flat", "save", "flat gather + torch.save"),
    ("raw", "load", "raw read"),
    ("dmuon", "load", "dmuon.dcp.load"),
    ("torch", "load", "torch dcp.load (all FSDP2)"),
    ("flat", "load", "flat torch.load + set"),
    ("async", "block", "dmuon.dcp.async_save blocking"),
)
# The targets for dmuon against torch's DCP: (operation, measure, max ratio of medians).
TARGETS = (("save", "cpu", 0.5), ("save", "wall", 1.0), ("load", "cpu", 0.6), ("load", "wall", 0.8))


# ---------------------------------------------------------------------------------------------
# the model (built inside each rank)
# ---------------------------------------------------------------------------------------------
def _model(n_matrices: int):
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(DIM, DIM, bias=False) for _ in range(n_matrices)])


def _build(n_matrices: int, dedicated: bool):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import dmuon

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = _model(n_matrices)
    predicate = (lambda n, p: int(n.split(".")[0]) % 2 == 0) if dedicated else (lambda n, p: False)
    dmuon.dedicate_params(model, mesh, predicate)
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, dmuon.Muon(model)


# ---------------------------------------------------------------------------------------------
# measuring one call (inside each rank)
# ---------------------------------------------------------------------------------------------
def _cpu_seconds() -> float:
    """User + sys CPU time of this process so far, all its threads included."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _measure(fn) -> dict:
    """Run the collective ``fn``: this rank's wall time barrier to barrier, CPU time around the call."""
    import torch.distributed as dist

    gc.collect()  # not inside the measurement
    dist.barrier()
    t0 = time.perf_counter()
    c0 = _cpu_seconds()
    fn()
    cpu = _cpu_seconds() - c0
    dist.barrier()
    return {"wall_s": time.perf_counter() - t0, "cpu_s": cpu}


def _measure_async(model, path: str) -> dict:
    """async_save: wall and CPU time until it returns; ``total_s`` until every rank's write is done."""
    import torch.distributed as dist

    import dmuon.dcp as ddcp

    gc.collect()
    dist.barrier()
    t0 = time.perf_counter()
    c0 = _cpu_seconds()
    handle = ddcp.async_save(model, None, path)
    blocking, cpu = time.perf_counter() - t0, _cpu_seconds() - c0
    handle.wait()
    dist.barrier()
    return {"wall_s": blocking, "cpu_s": cpu, "total_s": time.perf_counter() - t0}


def _set_cache(path: str, cache: str) -> None:
    """Collective: put every file of the checkpoint at ``path`` in the same page-cache state
    before a load, whatever the save did (dmuon's writer bypasses the cache on ext4/xfs,
    torch's does not): "warm" reads each file once (loads then measure CPU work), "cold"
    drops its cached pages with ``posix_fadvise(DONTNEED)`` (loads then read the device)."""
    import torch.distributed as dist

    dist.barrier()
    if dist.get_rank() == 0:
        buffer = bytearray(RAW_BLOCK)
        for folder, _, names in os.walk(path):
            for name in names:
                file = os.path.join(folder, name)
                if cache == "warm":
                    _raw_read(file, buffer)
                    continue
                with open(file, "rb", buffering=0) as f:
                    os.fsync(f.fileno())
                    os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    dist.barrier()


def _remove(path: str) -> None:
    """Collective: rank 0 deletes a measured checkpoint once every rank is done with it."""
    import torch.distributed as dist

    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(path, ignore_errors=True)
    dist.barrier()


def _rotated(methods: tuple, repeat: int) -> tuple:
    k = repeat % len(methods)
    return methods[k:] + methods[:k]


# ---------------------------------------------------------------------------------------------
# the raw baseline
# ---------------------------------------------------------------------------------------------
def _raw_write(path: str, nbytes: int, block: bytes) -> None:
    view = memoryview(block)
    with open(path, "wb") as f:
        left = nbytes
        while left > 0:
            n = min(left, len(view))
            f.write(view[:n])
            left -= n
        f.flush()
        os.fsync(f.fileno())


def _raw_read(path: str, buffer: bytearray) -> None:
    with open(path, "rb", buffering=0) as f:
        while f.readinto(buffer):
            pass


# ---------------------------------------------------------------------------------------------
# rank workers
# ---------------------------------------------------------------------------------------------
def worker(rank, world, n_matrices, run_dir, repeats, warmup, cache):
    """Every method, interleaved, at one world size: per-rank samples of each operation."""
    import torch.distributed.checkpoint as dcp

    import dmuon
    import dmuon.dcp as ddcp
    from dmuon.dcp.format import rank_of_data_file

    model, _ = _build(n_matrices, dedicated=True)
    plain_model, _ = _build(n_matrices, dedicated=False)

    # The raw baseline writes exactly the bytes of this rank's dmuon data file(s).
    sizing = f"{run_dir}/w{world}-sizing"
    ddcp.save(model, None, sizing)
    share = sum(os.path.getsize(f"{sizing}/{name}") for name in os.listdir(sizing) if rank_of_data_file(name) == rank)
    _remove(sizing)
    block, buffer = os.urandom(RAW_BLOCK), bytearray(RAW_BLOCK)

    def raw_save(path):
        os.makedirs(path, exist_ok=True)
        _raw_write(f"{path}/{rank}.bin", share, block)

    def flat_save(path):
        state = dmuon.get_model_state_dict(model)  # rank 0 gets everything, the others {}
        if rank == 0:
            os.makedirs(path, exist_ok=True)
            with open(f"{path}/model.pt", "wb") as f:
                torch.save(state, f)
                f.flush()
                os.fsync(f.fileno())

    operations = {  # method -> (save, load), each taking the checkpoint path
        "raw": (raw_save, lambda path: _raw_read(f"{path}/{rank}.bin", buffer)),
        "dmuon": (lambda path: ddcp.save(model, None, path), lambda path: ddcp.load(model, None, path)),
        "torch": (
            lambda path: dcp.save(plain_model.state_dict(), storage_writer=dcp.FileSystemWriter(path)),
            lambda path: dcp.load(plain_model.state_dict(), storage_reader=dcp.FileSystemReader(path)),
        ),
        "flat": (
            flat_save,
            lambda path: dmuon.set_model_state_dict(model, torch.load(f"{path}/model.pt", mmap=True)),
        ),
    }
    samples = {method: {"save": [], "load": []} for method in operations}
    samples["async"] = {"block": []}
    orders = []
    for repeat in range(-warmup, repeats):
        order = _rotated(METHODS, repeat)
        results = {}
        for method in order:
            path = f"{run_dir}/w{world}-r{repeat}-{method}"
            if method == "async":
                results[method] = {"block": _measure_async(model, path)}
            else:
                save, load = operations[method]
                saved = _measure(lambda save=save, path=path: save(path))
                _set_cache(path, cache)
                results[method] = {"save": saved, "load": _measure(lambda load=load, path=path: load(path))}
            _remove(path)
        if repeat >= 0:
            orders.append(order)
            for method, ops in results.items():
                for op, sample in ops.items():
                    samples[method][op].append(sample)
    ddcp.async_checkpointer(model).close()  # frees the staging buffers
    return {"share_bytes": share, "orders": orders, "samples": samples}


def reshard_save_worker(rank, world, n_matrices, path):
    """Save the checkpoints a resharded load starts from: dmuon's and torch DCP's."""
    import torch.distributed.checkpoint as dcp

    import dmuon.dcp as ddcp

    model, _ = _build(n_matrices, dedicated=True)
    plain_model, _ = _build(n_matrices, dedicated=False)
    ddcp.save(model, None, f"{path}/dmuon")
    dcp.save(plain_model.state_dict(), storage_writer=dcp.FileSystemWriter(f"{path}/torch"))


def reshard_load_worker(rank, world, n_matrices, path, repeats, warmup, cache):
    """Load checkpoints saved at another world size, dmuon and torch DCP interleaved."""
    import torch.distributed.checkpoint as dcp

    import dmuon.dcp as ddcp

    model, _ = _build(n_matrices, dedicated=True)
    plain_model, _ = _build(n_matrices, dedicated=False)
    loads = {
        "dmuon": lambda: ddcp.load(model, None, f"{path}/dmuon"),
        "torch": lambda: dcp.load(plain_model.state_dict(), storage_reader=dcp.FileSystemReader(f"{path}/torch")),
    }
    samples = {method: {"load": []} for method in loads}
    for repeat in range(-warmup, repeats):
        for method in _rotated(RESHARD_METHODS, repeat):
            _set_cache(f"{path}/{method}", cache)
            sample = _measure(loads[method])
            if repeat >= 0:
                samples[method]["load"].append(sample)
    return {"samples": samples}


# ---------------------------------------------------------------------------------------------
# summarising (parent process)
# ---------------------------------------------------------------------------------------------
def _merge(per_rank: list[dict]) -> dict:
    """Per-rank samples -> one sample per repeat: wall = slowest rank, CPU = every rank's."""
    merged = {}
    for method, ops in per_rank[0]["samples"].items():
        merged[method] = {}
        for op in ops:
            rows = zip(*(r["samples"][method][op] for r in per_rank))
            merged[method][op] = [
                {key: ([s[key] for s in row] if key == "cpu_s" else max(s[key] for s in row)) for key in row[0]}
                for row in rows
            ]
    return merged


def _stats(samples: list[dict], gib: float) -> dict:
    walls = [s["wall_s"] for s in samples]
    cpus = [sum(s["cpu_s"]) / gib for s in samples]
    median = statistics.median(walls)
    return {
        "wall_min": min(walls),
        "wall_med": median,
        "spread": (max(walls) - min(walls)) / median if median > 0 else 0.0,
        "cpu_min": min(cpus),
        "cpu_med": statistics.median(cpus),
    }


def _ratio(a: float, b: float) -> float:
    return a / b if b > 0 else float("inf")


LABEL = 38  # width of the row label column


def _header(with_raw: bool) -> str:
    top = f"  {'':<{LABEL}}{'wall s':>17}{'':>8}{'CPU-s/GiB':>16}"
    bottom = f"  {'':<{LABEL}}{'min':>8}{'median':>9}{'spread':>8}{'min':>8}{'median':>8}"
    if with_raw:
        top, bottom = top + f"{'x raw (medians)':>18}", bottom + f"{'wall':>9}{'CPU':>9}"
    return top + "\n" + bottom


def _row(label: str, st: dict, base: dict | None) -> str:
    line = (
        f"  {label:<{LABEL}}{st['wall_min']:>8.3f}{st['wall_med']:>9.3f}{100 * st['spread']:>7.0f}%"
        f"{st['cpu_min']:>8.2f}{st['cpu_med']:>8.2f}"
    )
    if base is not None:
        line += f"{_ratio(st['wall_med'], base['wall_med']):>9.2f}{_ratio(st['cpu_med'], base['cpu_med']):>9.2f}"
    return line


def _print_targets(dmuon_stats: dict, torch_stats: dict, ops: tuple[str, ...]) -> None:
    """dmuon / torch DCP, ratio of medians, against the issue's targets: one line per operation."""
    for op in ops:
        parts = []
        for target_op, measure, limit in TARGETS:
            if target_op != op:
                continue
            key = "cpu_med" if measure == "cpu" else "wall_med"
            ratio = _ratio(dmuon_stats[op][key], torch_stats[op][key])
            name = "CPU-s/GiB" if measure == "cpu" else "wall"
            parts.append(f"{name} {ratio:.2f}x (target <= {limit}x: {'met' if ratio <= limit else 'NOT met'})")
        print(f"  dmuon / torch DCP {op}: " + ", ".join(parts))


def print_world(label: str, world: int, result: dict, gib: float, repeats: int) -> None:
    samples = result["samples"]
    stats = {m: {op: _stats(s, gib) for op, s in ops.items()} for m, ops in samples.items()}
    share = [round(b / 2**20, 1) for b in result["share_bytes"]]
    print(f"\n[{label}] world {world}: dmuon data file per rank {share} MiB; {repeats} repeats, order rotated")
    print(_header(with_raw=True))
    for method, op, name in ROWS:
        base = stats["raw"][op] if method not in ("raw", "async") else None
        print(_row(f"{op:<5} {name}", stats[method][op], base))
    block, sync = stats["async"]["block"], stats["dmuon"]["save"]
    total = statistics.median(s["total_s"] for s in samples["async"]["block"])
    print(f"  async_save blocking: median {100 * _ratio(block['wall_med'], sync['wall_med']):.1f}% "
          f"(min {100 * _ratio(block['wall_min'], sync['wall_min']):.1f}%) of the sync dmuon save; "
          f"until written (blocking + wait): median {total:.3f}s")
    _print_targets(stats["dmuon"], stats["torch"], ("save", "load"))


def print_reshard(label: str, a: int, b: int, samples: dict, gib: float) -> None:
    stats = {m: {op: _stats(s, gib) for op, s in ops.items()} for m, ops in samples.items()}
    print(f"\n[{label}] resharded load {a} -> {b} ranks")
    print(_header(with_raw=False))
    print(_row(f"load  dmuon.dcp.load {a}->{b}", stats["dmuon"]["load"], None))
    print(_row(f"load  torch dcp.load {a}->{b}", stats["torch"]["load"], None))
    _print_targets(stats["dmuon"], stats["torch"], ("load",))


# ---------------------------------------------------------------------------------------------
# storage roots and cleanup (parent process)
# ---------------------------------------------------------------------------------------------
def _fs_type(path: str) -> str:
    from dmuon.dcp.local_store import filesystem_type

    return filesystem_type(path) or "?"


def _existing_ancestor(path: str) -> str:
    path = os.path.abspath(path)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return path


def _room(root: str) -> int:
    """Bytes this run may put under ``root``: free space, and for tmpfs also available RAM."""
    where = _existing_ancestor(root)
    free = shutil.disk_usage(where).free
    if _fs_type(where) in TMPFS:
        try:
            with open("/proc/meminfo") as meminfo:
                available = next(int(line.split()[1]) * 1024 for line in meminfo if line.startswith("MemAvailable:"))
            free = min(free, available)
        except (OSError, StopIteration):
            pass
    return free


def default_roots() -> list[str]:
    """A local-disk temp dir (the repo's parent if the temp dir is tmpfs) and /dev/shm."""
    local = tempfile.gettempdir()
    if _fs_type(local) in TMPFS:
        local = os.path.dirname(REPO)
    roots = [local]
    if os.path.isdir("/dev/shm") and os.path.realpath("/dev/shm") != os.path.realpath(local):
        roots.append("/dev/shm")
    return roots


def make_run_dir(root: str, created: list[str]) -> str:
    """One unique directory for this run under ``root``, creating ``root`` if needed (and
    remembering the topmost directory created, to remove it at the end too)."""
    top = os.path.abspath(root)
    if not os.path.exists(top):
        while not os.path.exists(os.path.dirname(top)):
            top = os.path.dirname(top)
        os.makedirs(root)
        created.append(top)
    return tempfile.mkdtemp(prefix="dmuon-bench-", dir=root)


def cleanup(run_dirs: list[str], created: list[str]) -> None:
    """Stop any rank still running (only this script's own children), then delete what it wrote."""
    for proc in multiprocessing.active_children():
        proc.kill()
        proc.join(5)
    for path in run_dirs + created[::-1]:
        shutil.rmtree(path, ignore_errors=True)
        if os.path.exists(path):
            print(f"WARNING: could not remove {path}; delete it by hand", file=sys.stderr)


def _interrupted(signum, _frame):
    raise SystemExit(128 + signum)  # unwinds through the finally blocks that clean up


# ---------------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------------
def _pair(text: str) -> tuple[int, int]:
    a, b = (int(x) for x in text.split(":"))
    if a == b or min(a, b) < 1:
        raise argparse.ArgumentTypeError(f"{text}: want A:B with A != B")
    return a, b


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--mib", type=int, default=512, help="model size in MiB (4 MiB per matrix; default 512)")
    parser.add_argument("--repeats", type=int, default=5, help="measured repeats per method (default 5)")
    parser.add_argument("--warmup", type=int, default=1, help="unrecorded rounds before them (default 1)")
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4], help="world sizes (default 2 4)")
    parser.add_argument("--reshard", type=_pair, nargs="*", default=[(2, 4), (4, 2), (4, 3)], metavar="A:B",
                        help="resharded loads, saved at A ranks, loaded at B (default 2:4 4:2 4:3; none: skip)")
    parser.add_argument("--roots", nargs="+", default=None, metavar="DIR",
                        help="storage roots (default: a local-disk temp dir and /dev/shm)")
    parser.add_argument("--cache", choices=("warm", "cold"), default="warm",
                        help="page cache before each load: every file read once (warm, the default) or "
                             "its pages dropped (cold)")
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
    roots = args.roots or default_roots()

    print("command: " + " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv]))
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f} (1 min)")
    print(f"model: {n_matrices} x ({DIM}x{DIM}) fp32 = {model_bytes / 2**20:.0f} MiB, every other matrix dedicated; "
          f"torch DCP on the same model all-FSDP2")
    print(f"{args.repeats} measured repeats (+{args.warmup} warm-up) per method, interleaved, "
          "order rotated each repeat;")
    print("wall = barrier to barrier (slowest rank); CPU-s/GiB = user+sys CPU of every rank around the call, "
          f"summed, / model GiB; page cache before each load: {args.cache}")
    print("reproducibility: run twice, medians should agree within +-15%; compare ratios within one run")
    report = {
        "command": [sys.executable, *sys.argv], "torch": torch.__version__, "cpus": os.cpu_count(),
        "loadavg_start": os.getloadavg(), "args": {k: v for k, v in vars(args).items()},
        "n_matrices": n_matrices, "model_bytes": model_bytes, "roots": [], "worlds": [], "reshard": [],
        "complete": False,
    }
    run_dirs: list[str] = []
    created: list[str] = []
    try:
        for root in roots:
            label = f"{root} ({_fs_type(_existing_ancestor(root))})"
            need, room = ROOM_FACTOR * model_bytes, _room(root)
            if room < need:
                print(f"\nSKIPPING {label}: {room / 2**30:.2f} GiB free, need {need / 2**30:.2f} GiB "
                      f"({ROOM_FACTOR}x the model)")
                report["roots"].append({"root": root, "label": label, "skipped": f"free {room} < need {need}"})
                continue
            run_dir = make_run_dir(root, created)
            run_dirs.append(run_dir)
            report["roots"].append({"root": root, "label": label, "run_dir": run_dir, "skipped": None})
            print(f"\n== storage root {label}: writing under {run_dir}", flush=True)

            for world in args.worlds:
                per_rank = run_ranks(worker, world, n_matrices, run_dir, args.repeats, args.warmup, args.cache,
                                     timeout=args.timeout)
                result = {"share_bytes": [r["share_bytes"] for r in per_rank], "orders": per_rank[0]["orders"],
                          "samples": _merge(per_rank)}
                report["worlds"].append({"root": root, "world": world, **result})
                print_world(label, world, result, gib, args.repeats)
                sys.stdout.flush()

            for source in sorted({a for a, _ in args.reshard}):
                path = f"{run_dir}/reshard-from-{source}"
                run_ranks(reshard_save_worker, source, n_matrices, path, timeout=args.timeout)
                for a, b in args.reshard:
                    if a != source:
                        continue
                    per_rank = run_ranks(reshard_load_worker, b, n_matrices, path, args.repeats, args.warmup,
                                         args.cache, timeout=args.timeout)
                    samples = _merge(per_rank)
                    report["reshard"].append({"root": root, "from": a, "to": b, "samples": samples})
                    print_reshard(label, a, b, samples, gib)
                    sys.stdout.flush()
                shutil.rmtree(path)
        report["complete"] = True
    finally:
        cleanup(run_dirs, created)
        report["loadavg_end"] = os.getloadavg()
        print(f"\nload average {report['loadavg_end'][0]:.2f} (1 min) at the end; removed {run_dirs + created}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(report, f, indent=1)
            print(f"every repeat's numbers: {args.json}" + ("" if report["complete"] else " (incomplete run)"))


if __name__ == "__main__":
    main()
