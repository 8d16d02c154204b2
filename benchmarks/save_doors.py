"""A save through the door a script uses, against a kept ``Checkpointer`` and the raw disk.

Issue 44, item 3: ``dmuon.dcp.save`` called as a script calls it (a new call each time) within
1.1x a kept ``Checkpointer``'s save, the first save of a process within 1.5x the next ones, and
within 1.2x the best raw write of the same bytes in the same run.

    python benchmarks/save_doors.py [--mib 512] [--worlds 2 4] [--repeats 5] [--root DIR] [--json PATH]

One job per world size, on the model of ``save_load.py`` (``DIM`` x ``DIM`` fp32 matrices,
every other one dedicated, the rest FSDP2; weights only). In each job:

* ``first``: the process's first ``dmuon.dcp.save``, timed alone (imports are done before it,
  nothing of the save path is warmed): what a script's first checkpoint costs;
* then ``--repeats`` rounds, the methods in turn (``harness.rotated``), each into a new
  directory, removed outside the timing:
  - ``script``: ``dmuon.dcp.save(model, None, path)``, a new call each time;
  - ``kept``: ``Checkpointer.save`` of one ``Checkpointer`` kept for the job (what
    ``CheckpointManager`` does);
  - ``raw-<how>``: each rank writes its share of the checkpoint's bytes to a file of its own in
    each of ``raw_io.WRITES``' ways, fsynced; ``raw-best`` is the fastest of them in the round.

Wall: barrier to barrier (the slowest rank). CPU: this rank's, summed over the ranks. Ratios
are paired (the median over rounds of ours / the peer's in the same round). The write path
(``storage/write_path.py``) each job used is printed: buffered by rule for these synchronous saves.
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

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import harness
import raw_io
from save_load import DIM, build, on_rank_zero, write_path_chosen

TARGETS = {"script / kept": 1.1, "first / script": 1.5, "script / raw-best": 1.2}


def worker(rank: int, world: int, n_matrices: int, run_dir: str, repeats: int) -> dict:
    import torch.distributed as dist

    import dmuon.dcp as ddcp

    model = build(n_matrices, dedicated=True)
    kept = ddcp.Checkpointer()
    source = raw_io.Source()
    counter = iter(range(10**9))

    def fresh() -> str:
        return f"{run_dir}/w{world}-{next(counter)}"

    path = fresh()
    first = harness.measure(lambda: ddcp.save(model, None, path))
    share = sum(os.path.getsize(f) for f in harness.files_under(path)) // world if rank == 0 else 0
    holder = [share]
    dist.broadcast_object_list(holder, src=0)
    share = holder[0]
    on_rank_zero(shutil.rmtree, path)

    def raw(how: str):
        def write(target: str) -> None:
            os.makedirs(target, exist_ok=True)
            raw_io.write(how, f"{target}/{rank}.bin", share, source)

        return write

    methods = {
        "script": lambda target: ddcp.save(model, None, target),
        "kept": lambda target: kept.save(model, None, target),
        **{f"raw-{how}": raw(how) for how in raw_io.WRITES},
    }
    rounds = []
    for repeat in range(repeats):
        row = {}
        for name in harness.rotated(list(methods), repeat):
            target = fresh()
            row[name] = harness.measure(functools.partial(methods[name], target))
            on_rank_zero(shutil.rmtree, target)
        rounds.append(row)
    return {"first": first, "rounds": rounds, "share_bytes": share, "write_path": write_path_chosen()}


def job_series(per_rank: list[dict]) -> dict[str, list[dict[str, float]]]:
    """method -> per round {wall: the slowest rank's, cpu: summed over ranks}; raw-best added."""
    series: dict[str, list[dict[str, float]]] = {"first": [{
        "wall": max(r["first"]["wall_s"] for r in per_rank), "cpu": sum(r["first"]["cpu_s"] for r in per_rank)}]}
    for index in range(len(per_rank[0]["rounds"])):
        rows = [r["rounds"][index] for r in per_rank]
        for name in rows[0]:
            series.setdefault(name, []).append(
                {"wall": max(row[name]["wall_s"] for row in rows), "cpu": sum(row[name]["cpu_s"] for row in rows)})
        raws = [name for name in rows[0] if name.startswith("raw-")]
        best = min(raws, key=lambda name: series[name][-1]["wall"])
        series.setdefault("raw-best", []).append({**series[best][-1], "method": best})
    return series


def ratios(series: dict) -> dict[str, float]:
    wall = {name: [s["wall"] for s in rows] for name, rows in series.items()}
    return {
        "script / kept": harness.paired_ratio(wall["script"], wall["kept"]),
        "first / script": wall["first"][0] / statistics.median(wall["script"]),
        "script / raw-best": harness.paired_ratio(wall["script"], wall["raw-best"]),
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=512, help="checkpoint size (model weights)")
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--root", default=None, help="directory to save into (default: a new one under /tmp)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    n_matrices = max(2, (args.mib << 20) // (DIM * DIM * 4))
    root = tempfile.mkdtemp(prefix="dmuon-doors-", dir=args.root)
    report = {"mib": args.mib, "fs": harness.fs_type(root), "worlds": {}}
    try:
        for world in args.worlds:
            per_rank = harness.run_ranks(worker, world, n_matrices, root, args.repeats)
            series = job_series(per_rank)
            found = ratios(series)
            report["worlds"][world] = {"series": series, "ratios": found, "write_path": per_rank[0]["write_path"]}
            print(f"\n{args.mib} MiB, {world} ranks, {report['fs']} ({per_rank[0]['write_path']}); "
                  f"{args.repeats} rounds, wall s min / median, CPU-s median (summed over ranks):")
            for name, rows in series.items():
                walls = [r["wall"] for r in rows]
                print(f"  {name:<14} {min(walls):7.3f} / {statistics.median(walls):7.3f}   "
                      f"{statistics.median(r['cpu'] for r in rows):7.3f}")
            won = [r["method"] for r in series["raw-best"]]
            print("  raw-best was " + ", ".join(f"{m} {won.count(m)}x" for m in dict.fromkeys(won)))
            for name, value in found.items():
                verdict = "met" if value <= TARGETS[name] else "NOT met"
                print(f"  {name:<18} {value:5.2f}  (target <= {TARGETS[name]}: {verdict})")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
