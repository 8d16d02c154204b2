"""Do two runs of benchmarks/save_load.py agree? Medians side by side, and their difference.

    python benchmarks/compare_runs.py run1.json run2.json [--tolerance 0.15]

Prints, for every storage root, world size (or resharding pair), method and operation, the
median wall time and CPU-s/GiB of each run and the relative difference; rows outside the
tolerance are marked. Then the same for the *paired* ratio dmuon / torch DCP: within each
repeat the two ran back to back, so a drift in machine load moves both; the median of the
per-repeat ratios is what a comparison between the methods rests on.
"""

from __future__ import annotations

import argparse
import json
import statistics


def medians(run: dict) -> dict[tuple, tuple[float, float]]:
    gib = run["model_bytes"] / 2**30
    out = {}
    for where, entry in _entries(run):
        for method, ops in entry["samples"].items():
            for op, samples in ops.items():
                wall = statistics.median(s["wall_s"] for s in samples)
                cpu = statistics.median(sum(s["cpu_s"]) / gib for s in samples)
                out[(entry["root"], where, method, op)] = (wall, cpu)
    return out


def _entries(run: dict):
    for group, label in ((run["worlds"], "world"), (run.get("reshard") or [], "reshard")):
        for entry in group:
            where = f"{entry['world']}" if label == "world" else f"{entry['from']}->{entry['to']}"
            yield where, entry


def paired_ratios(run: dict, method: str = "dmuon", peer: str = "torch") -> dict[tuple, tuple[float, float]]:
    """Median over repeats of (method / peer) for wall time and CPU, per root, world and operation."""
    out = {}
    for where, entry in _entries(run):
        samples = entry["samples"]
        if method not in samples or peer not in samples:
            continue
        for op in samples[method].keys() & samples[peer].keys():
            pairs = list(zip(samples[method][op], samples[peer][op]))
            wall = statistics.median(a["wall_s"] / b["wall_s"] for a, b in pairs)
            cpu = statistics.median(sum(a["cpu_s"]) / sum(b["cpu_s"]) for a, b in pairs)
            out[(entry["root"], where, f"{method}/{peer}", op)] = (wall, cpu)
    return out


def _compare(a: dict, b: dict, tolerance: float, digits: int) -> tuple[int, int]:
    outside = 0
    for key in sorted(a.keys() & b.keys()):
        (w1, c1), (w2, c2) = a[key], b[key]
        dw, dc = w2 / w1 - 1, c2 / c1 - 1
        flag = " *" if max(abs(dw), abs(dc)) > tolerance else ""
        outside += bool(flag)
        print(f"{key[0]:<10}{key[1]:<7}{key[2]:<12}{key[3]:<6}{w1:>8.{digits}f}{w2:>8.{digits}f}{dw:>+7.0%}"
              f"{c1:>8.2f}{c2:>8.2f}{dc:>+7.0%}{flag}")
    return outside, len(a.keys() & b.keys())


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("first")
    parser.add_argument("second")
    parser.add_argument("--tolerance", type=float, default=0.15)
    args = parser.parse_args()
    with open(args.first) as f1, open(args.second) as f2:
        run1, run2 = json.load(f1), json.load(f2)
    header = f"{'root':<10}{'where':<7}{'method':<12}{'op':<6}{'wall 1':>8}{'wall 2':>8}{'diff':>7}"
    header += f"{'cpu 1':>8}{'cpu 2':>8}{'diff':>7}"
    print("medians of each method (wall s, CPU-s/GiB)")
    print(header)
    outside, rows = _compare(medians(run1), medians(run2), args.tolerance, 3)
    print(f"{outside} of {rows} rows differ by more than {args.tolerance:.0%} (marked *)\n")
    print("paired ratios dmuon / torch DCP (median over repeats of the per-repeat ratio)")
    print(header.replace("wall 1", "wall r1").replace("wall 2", "wall r2"))
    outside, rows = _compare(paired_ratios(run1), paired_ratios(run2), args.tolerance, 2)
    print(f"{outside} of {rows} ratio rows differ by more than {args.tolerance:.0%} (marked *)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
