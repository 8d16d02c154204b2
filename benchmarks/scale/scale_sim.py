"""Scale simulator: what checkpoint coordination costs at 64 to 16,384 ranks, in one process.

    python benchmarks/scale sim [--models 8b 70b] [--meshes fsdp hsdp] [--worlds 64 256]
                                [--extrapolate 1024 4096 16384] [--load-max 1024] [--json PATH]
    python benchmarks/scale sim --check-real [--real-worlds 8 32]

For each model (Llama-like 8B and 70B: ``scale_sim_state.SPECS``, Muon on the hidden 2-D
weights, which dmuon dedicates), mesh (FSDP2 1-D, or HSDP with shard groups of 8) and world
size, N synthetic ranks run the code as it is in the tree (``scale_sim_world.py``: one greenlet
per rank, every collective a collective of the simulated world): dmuon's own rounds
(``run_save``, ``open_once``, ``run_load`` over a simulated ``Transport``, with dmuon's
planners, plan caches, writer and reader), and torch's ``dcp.save``/``dcp.load`` with its
default planners (with and without ``enable_plan_caching``) and ``FileSystemWriter``/``Reader``
on the same state as torch sees it (every tensor an FSDP2 shard). Only the bytes are left out:
a write returns what it would (``scale_sim_stand_ins.py``); ``.metadata`` and the manifest are
committed for real, into memory (``scale_sim_store.py``) or a temporary directory (torch's).

Per first save, steady save (the same layout saved again to a new directory by the same job)
and load: the bytes each collective moves (pickled objects, all-reduced tensors) tallied per
rank; rank 0's CPU seconds and the largest of any rank's (all of their work in the operation,
building the synthetic state excluded); ``.metadata`` and manifest bytes; peak memory; for
loads, the most data files any rank's plan reads (on object storage, a few requests each).

World sizes above ``--worlds`` are extrapolated (``--extrapolate``) from the two largest
simulated ones with the growth they show (y ~ N^k). Loads run up to ``--load-max`` ranks (an
FSDP2 1-D load plans O(N) chunks per key on every rank: O(N^2) in all).

``--check-real`` runs the same tiny model on real gloo ranks (``scale_sim_real.py``), counts
what the collectives move there, and compares it with the simulator's counts.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import resource
import shutil
import sys
import tempfile
import time
from typing import Any

_HERE = os.path.dirname(os.path.abspath(__file__))
for _path in (os.path.dirname(os.path.dirname(_HERE)), os.path.dirname(_HERE), _HERE):  # repo, benchmarks, here
    if _path not in sys.path:
        sys.path.insert(0, _path)

import torch.distributed.checkpoint as dcp
from scale_sim_stand_ins import DmuonReader, DmuonWriter, TorchReader, TorchWriter
from scale_sim_state import SPECS, Mesh, Model, tally
from scale_sim_store import SCHEME, SimStore
from scale_sim_world import Phase, SimulatedWorld
from torch.distributed.checkpoint.planner import SavePlanner

import dmuon.dcp as ddcp
from dmuon.dcp.format.layout import METADATA
from dmuon.dcp.load_protocol import run_load
from dmuon.dcp.operation import open_once
from dmuon.dcp.plan_cache import SavePlanCache
from dmuon.dcp.save_protocol import run_save
from dmuon.dcp.storage.registry import register_store, unregister_store

METHODS = ("dmuon", "torch", "torch+cache")
OPS = ("first save", "steady save", "load", "load alone")  # "load alone": dmuon, cooperative=False


def _clear_torch_caches() -> None:
    """torch keeps plan caches in class attributes for the life of the process."""
    for name in ("_cached_save_plan", "_cached_all_plans", "_cached_global_plan", "_cached_metadata",
                 "_cached_final_save_plan"):
        getattr(SavePlanner, name, {}).clear()


def _torch_planner(caching: bool, rank: int) -> dcp.DefaultSavePlanner:
    planner = dcp.DefaultSavePlanner(enable_plan_caching=caching)
    planner._cached_plans_key = f"scale-sim-rank-{rank}"  # one process, N ranks: one cache each
    return planner


def run_method(method: str, model: Model, n: int, loads: bool, tmp: str) -> dict[str, Phase]:
    """First save, steady save and (``loads``) load of ``model`` on ``n`` synthetic ranks."""
    if method == "dmuon":
        return run_dmuon(model, n, loads)
    caching = method == "torch+cache"
    _clear_torch_caches()
    out: dict[str, Phase] = {}
    world = SimulatedWorld(n)
    dirs = [os.path.join(tmp, f"torch{i}") for i in range(2)]
    for op, path in zip(OPS[:2], dirs):

        def save(rank: int, transport: Any, path: str = path) -> None:
            with world.untimed():
                state = model.state(rank)
            dcp.save(state, storage_writer=TorchWriter(path), planner=_torch_planner(caching, rank))

        out[op] = _phase(world, world.run(save))
        out[op].small_files = {METADATA: os.path.getsize(os.path.join(path, METADATA))}
    _clear_torch_caches()
    if loads:
        shared: dict = {}
        files_read: list[int] = []

        def load(rank: int, transport: Any) -> None:
            with world.untimed():
                state = model.state(rank)
            reader = TorchReader(dirs[0], shared, world.charge, files_read)
            dcp.load(state, storage_reader=reader, planner=dcp.DefaultLoadPlanner())

        out["load"] = _phase(world, world.run(load))
        out["load"].extra["files_read_max"] = max(files_read)
        out["load"].small_files = {METADATA: n * os.path.getsize(os.path.join(dirs[0], METADATA))}  # every rank's
    return out


def run_dmuon(model: Model, n: int, loads: bool) -> dict[str, Phase]:
    """dmuon's rounds as a ``Checkpointer`` runs them (``run_save``, ``open_once``, ``run_load``),
    each rank with its own plan cache: first save, steady save, and the load twice: cooperative
    (the default from object storage: plans gathered) and alone (``cooperative=False``)."""
    out: dict[str, Phase] = {}
    layout = model.layout()
    caches = [SavePlanCache() for _ in range(n)]
    world = SimulatedWorld(n)
    urls = [f"{SCHEME}://dmuon-scale-sim/save{i}" for i in range(2)]
    for op, url in zip(OPS[:2], urls):

        def save(rank: int, transport: Any, url: str = url) -> None:
            with world.untimed():
                state = model.state(rank, layout)
            run_save(state, DmuonWriter(url), ddcp.DMuonSavePlanner(plan_cache=caches[rank]), transport)

        out[op] = _phase(world, world.run(save))
        out[op].extra["path"] = "full" if any(call.kind == "gather" for call in out[op].calls) else "steady"
        out[op].small_files = {name: len(data) for name, data in SimStore.at(url).files.items()}
    if not loads:
        return out
    store = SimStore.at(urls[0])
    for op, cooperative in (("load", None), ("load alone", False)):
        store.bytes_read.clear()
        files_read: list[int] = []

        def load(rank: int, transport: Any, cooperative: bool | None = cooperative, files_read=files_read) -> None:
            listing = open_once(urls[0], None, transport)
            with world.untimed():
                state = model.state(rank, layout)
            reader = DmuonReader(urls[0], listing=listing, cooperative=cooperative, files_read=files_read)
            run_load(state, reader, ddcp.DMuonLoadPlanner(), transport)

        out[op] = _phase(world, world.run(load))
        out[op].extra["files_read_max"] = max(files_read)
        out[op].small_files = dict(store.bytes_read)
    return out


def _phase(world: SimulatedWorld, outcomes: list) -> Phase:
    """One operation's record; the first failure of a rank, if any, raised."""
    for rank, outcome in enumerate(outcomes):
        if outcome.error is not None:
            raise RuntimeError(f"rank {rank} of the simulated job failed") from outcome.error
    return Phase(calls=list(world.calls), cpu=[outcome.cpu for outcome in outcomes])


def summarize(phase: Phase, n: int) -> dict[str, Any]:
    row: dict[str, Any] = dict(tally(phase.calls, n))
    row.update(rank0_cpu=phase.cpu[0], rank_cpu_max=max(phase.cpu), other_cpu_max=max(phase.cpu[1:], default=0.0),
               small_files=phase.small_files, **phase.extra)
    row["calls"] = [c.kind for c in phase.calls]
    return row


def simulate(models: list[str], meshes: list[str], worlds: list[int], load_max: int,
             log=print, methods: tuple[str, ...] = METHODS) -> list[dict[str, Any]]:
    """Every (model, mesh, N, method): its rows, one per operation."""
    rows = []
    register_store(SCHEME, SimStore.factory)
    try:
        for key in models:
            for mesh_name in meshes:
                for n in worlds:
                    mesh = Mesh(n, 1 if mesh_name == "fsdp" else max(1, n // 8))
                    for method in methods:
                        model = Model(SPECS[key], mesh, dedicated=method == "dmuon")
                        tmp = tempfile.mkdtemp(prefix="dmuon-scale-sim-")
                        t0 = time.perf_counter()
                        gc.collect()
                        gc.disable()  # (collector pauses are noise here; dmuon's save pauses it too)
                        try:
                            phases = run_method(method, model, n, n <= load_max, tmp)
                        finally:
                            gc.enable()
                            shutil.rmtree(tmp, ignore_errors=True)
                            SimStore.drop_all()
                        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
                        for op, phase in phases.items():
                            rows.append(dict(model=SPECS[key].name, mesh=mesh.label, mesh_kind=mesh_name, world=n,
                                             method=method, op=op, measured=True, peak_rss=peak,
                                             **summarize(phase, n)))
                        log(f"  {SPECS[key].name} {mesh.label} N={n} {method}: {time.perf_counter() - t0:.1f} s, "
                            f"peak RSS so far {peak / 2**30:.1f} GiB")
    finally:
        unregister_store(SCHEME)
    return rows


NUMERIC = ("rank0_in", "rank0_out", "other_in_max", "other_out_max", "total", "wire_rank0_in", "wire_max_in",
           "wire_max_out", "rank0_cpu", "rank_cpu_max", "other_cpu_max", "small_bytes", "files_read_max")


def extrapolate(rows: list[dict[str, Any]], targets: list[int]) -> list[dict[str, Any]]:
    """Rows for world sizes not simulated: y = y2 * (N / N2)^k, k from the two largest simulated."""
    for row in rows:
        row["small_bytes"] = sum(row["small_files"].values())
    out = []
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault((row["model"], row["mesh_kind"], row["method"], row["op"]), []).append(row)
    for (model, mesh_kind, method, op), group in groups.items():
        group.sort(key=lambda r: r["world"])
        if len(group) < 2:
            continue
        a, b = group[-2], group[-1]
        for n in targets:
            if n <= b["world"]:
                continue
            new = dict(model=model, mesh_kind=mesh_kind, method=method, op=op, world=n, measured=False,
                       mesh=Mesh(n, 1 if mesh_kind == "fsdp" else n // 8).label, small_files={})
            for name in NUMERIC:
                y1, y2 = a.get(name, math.nan), b.get(name, math.nan)
                if not (y1 and y2) or any(map(math.isnan, (y1, y2))) or y1 <= 0 or y2 <= 0:
                    new[name] = y2 if y1 == y2 else math.nan
                    continue
                k = math.log(y2 / y1) / math.log(b["world"] / a["world"])
                new[name] = y2 * (n / b["world"]) ** k
                new[f"{name}_k"] = k
            out.append(new)
    return out


def _size(value: float) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if value >= scale:
            return f"{value / scale:.3g} {unit}"
    return f"{value:.0f} B"


def _secs(value: float) -> str:
    return "n/a" if value is None or math.isnan(value) else f"{value:.3g} s"


def tables(rows: list[dict[str, Any]]) -> str:
    """One markdown table per operation; extrapolated rows marked with ≈."""
    lines = []
    for op in OPS:
        lines.append(f"\n#### {op}\n")
        head = ["model", "mesh", "N", "method", "into rank 0", "out of rank 0 (star)", "any other rank in / out",
                "any rank, wire in / out (ring/tree)", "rank-0 CPU"]
        load = op.startswith("load")
        head += ["small files read (N ranks)", "data files any rank reads"] if load else [".metadata + manifest"]
        head += ["any rank's CPU", "any other rank's CPU"]
        lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for row in sorted((r for r in rows if r["op"] == op), key=lambda r: (r["model"], r["mesh_kind"], r["world"],
                                                                           METHODS.index(r["method"]))):
            mark = "" if row["measured"] else "≈ "
            small = row.get("small_bytes", sum(row["small_files"].values()))
            cells = [row["model"], row["mesh"], f"{mark}{row['world']:,}", row["method"], mark + _size(row["rank0_in"]),
                     mark + _size(row["rank0_out"]),
                     f"{mark}{_size(row['other_in_max'])} / {_size(row['other_out_max'])}",
                     f"{mark}{_size(row.get('wire_max_in'))} / {_size(row.get('wire_max_out'))}",
                     mark + _secs(row["rank0_cpu"]), mark + _size(small)]
            if load:
                files = row.get("files_read_max", math.nan)
                cells.append("n/a" if math.isnan(files) else f"{mark}{files:,.0f}")
            cells.append(mark + _secs(row.get("rank_cpu_max", math.nan)))
            cells.append(mark + _secs(row.get("other_cpu_max", math.nan)))
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["8b", "70b"], choices=sorted(SPECS))
    parser.add_argument("--meshes", nargs="+", default=["fsdp", "hsdp"], choices=["fsdp", "hsdp"])
    parser.add_argument("--worlds", nargs="+", type=int, default=[64, 256])
    parser.add_argument("--extrapolate", nargs="*", type=int, default=[1024, 4096, 16384])
    parser.add_argument("--load-max", type=int, default=1024, help="simulate loads up to this many ranks")
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--json", help="write every row here")
    parser.add_argument("--from-json", help="table the measured rows of an earlier --json (several: merge them)")
    parser.add_argument("--check-real", action="store_true", help="compare with real gloo ranks (tiny model)")
    parser.add_argument("--real-worlds", nargs="+", type=int, default=[8, 32])
    args = parser.parse_args(argv)
    if args.check_real:
        from scale_sim_real import check_real

        report = check_real(args.real_worlds, simulate)
        print(report["table"])
        if args.json:
            with open(args.json, "w") as f:
                json.dump(report, f, indent=1, default=str)
        return
    if args.from_json:  # the measured rows of an earlier run, extrapolated and tabled again
        with open(args.from_json) as f:
            rows = [row for row in json.load(f) if row["measured"]]
    else:
        rows = simulate(args.models, args.meshes, args.worlds, args.load_max, methods=tuple(args.methods))
    rows += extrapolate(rows, args.extrapolate)
    print(tables(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1, default=str)


if __name__ == "__main__":
    main()
