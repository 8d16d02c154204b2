"""Do two runs of benchmarks/save_load.py agree? Medians side by side, and their difference.

    python benchmarks/compare_runs.py run1.json run2.json [--tolerance 0.15] [--markdown]

Prints, for every storage root, world size (or resharding pair), method and operation, the
median wall time and CPU-s/GiB of each run and the relative difference; rows outside the
tolerance are marked. Then the same for the *paired* ratio dmuon / torch DCP: within each
repeat the two ran back to back, so a drift in machine load moves both; the median of the
per-repeat ratios is what a comparison between the methods rests on. ``--markdown`` prints
instead the two tables of ``docs/performance.md``, both runs side by side.
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


TABLE_ROWS = (("raw", "save", "raw write + fsync"), ("dmuon", "save", "**`dmuon.dcp.save`**"),
              ("torch", "save", "torch `dcp.save`"), ("raw", "load", "raw read"),
              ("dmuon", "load", "**`dmuon.dcp.load`**"), ("torch", "load", "torch `dcp.load`"))


def _root_label(root: str) -> str:
    return "tmpfs" if root.startswith("/dev/shm") else "disk"


def markdown(run1: dict, run2: dict) -> str:
    """Medians (wall s / CPU-s/GiB) per root and world, then paired ratios, run 1 | run 2."""
    m1, m2 = medians(run1), medians(run2)
    places = sorted({(k[0], k[1]) for k in m1 if "->" not in k[1]}, key=lambda p: (_root_label(p[0]), int(p[1])))
    lines = ["| | " + " | ".join(f"{_root_label(r)}, {w} ranks: wall s / CPU-s/GiB" for r, w in places) + " |",
             "|---" * (len(places) + 1) + "|"]
    for method, op, label in TABLE_ROWS:
        cells = []
        for root, where in places:
            key = (root, where, method, op)
            if key not in m1 or key not in m2:
                cells.append("")
                continue
            (w1, c1), (w2, c2) = m1[key], m2[key]
            cell = f"{w1:.3f} / {c1:.2f} \\| {w2:.3f} / {c2:.2f}"
            cells.append(f"**{cell}**" if method == "dmuon" else cell)
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    r1, r2 = paired_ratios(run1), paired_ratios(run2)
    wheres = sorted({k[1] for k in r1}, key=lambda w: ("->" in w, w))
    lines += ["", "| | " + " | ".join(w.replace("->", "→") + ("" if "->" in w else " ranks") for w in wheres) + " |",
              "|---" * (len(wheres) + 1) + "|"]
    for label in ("disk", "tmpfs"):
        for op in ("save", "load"):
            cells = []
            for where in wheres:
                key = next((k for k in r1 if _root_label(k[0]) == label and k[1] == where and k[3] == op), None)
                if key is None or key not in r2:
                    cells.append("")
                    continue
                (w1, c1), (w2, c2) = r1[key], r2[key]
                cells.append(f"{w1:.2f} / {c1:.2f} \\| {w2:.2f} / {c2:.2f}")
            if any(cells):
                lines.append(f"| {op}, {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("first")
    parser.add_argument("second")
    parser.add_argument("--tolerance", type=float, default=0.15)
    parser.add_argument("--markdown", action="store_true", help="print the tables of docs/performance.md")
    args = parser.parse_args()
    with open(args.first) as f1, open(args.second) as f2:
        run1, run2 = json.load(f1), json.load(f2)
    if args.markdown:
        print(markdown(run1, run2))
        return 0
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
