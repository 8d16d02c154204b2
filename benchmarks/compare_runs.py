"""Do two runs of benchmarks/save_load.py agree, and what do they say against the targets?

    python benchmarks/compare_runs.py run1.json run2.json [--tolerance 0.15] [--markdown]

Prints, for every storage root, world size (or resharding pair), method and operation, the
median wall time and CPU-s/GiB of each run and their relative difference; rows outside the
tolerance are marked. Then the paired ratios the issue's targets are stated in (dmuon / torch
DCP for saves and for each page-cache state of a load, dmuon / raw, flat / dmuon), both runs.
``--markdown`` prints instead the lead table of ``docs/performance.md``: each target, its bound
and the two runs' paired ratios, per storage root and world size.
"""

from __future__ import annotations

import argparse
import json
import statistics

import save_load


def _entries(run: dict):
    """(root, where, samples) for every world size and resharding pair of a run."""
    for entry in run["worlds"]:
        yield entry["root"], str(entry["world"]), entry["samples"]
    for entry in run.get("reshard") or []:
        yield entry["root"], f"{entry['from']}->{entry['to']}", entry["samples"]


def medians(run: dict) -> dict[tuple, tuple[float, float]]:
    gib = run["model_bytes"] / 2**30
    out = {}
    for root, where, samples in _entries(run):
        for method, by_op in samples.items():
            for op, rows in by_op.items():
                out[(root, where, method, op)] = (statistics.median(save_load.series(rows, "wall", gib)),
                                                  statistics.median(save_load.series(rows, "cpu", gib)))
    return out


def target_ratios(run: dict) -> dict[tuple, tuple[float, bool, str]]:
    """(root, where, target) -> (paired ratio, met, bound) for each target the run can check."""
    gib = run["model_bytes"] / 2**30
    out = {}
    for root, where, samples in _entries(run):
        world = int(where.split("->")[-1])
        for text, ratio, met, bound in save_load.target_lines(samples, gib, world):
            out[(root, where, text)] = (ratio, met, bound)
    return out


def _root_label(root: str) -> str:
    return "tmpfs" if root.startswith("/dev/shm") else "disk"


def markdown(run1: dict, run2: dict) -> str:
    """One row per target; a column per (root, world): run 1 | run 2, a bold ratio misses."""
    r1, r2 = target_ratios(run1), target_ratios(run2)
    places = sorted({(root, where) for root, where, _ in r1}, key=lambda p: (_root_label(p[0]), "->" in p[1], p[1]))
    targets = list(dict.fromkeys(text for _, _, text in r1))
    header = " | ".join(f"{_root_label(root)}, {where.replace('->', '→')} ranks" for root, where in places)
    lines = [f"| target | bound | {header} |", "|---|---" + "|---" * len(places) + "|"]
    for text in targets:
        bound = next(b for (_, _, t), (_, _, b) in r1.items() if t == text)
        cells = []
        for root, where in places:
            got = [r.get((root, where, text)) for r in (r1, r2)]
            cells.append(" \\| ".join("" if g is None else (f"{g[0]:.2f}" if g[1] else f"**{g[0]:.2f}**") for g in got))
        lines.append(f"| {' '.join(text.split())} | {bound} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _compare(a: dict, b: dict, tolerance: float) -> tuple[int, int]:
    outside = 0
    for key in sorted(a.keys() & b.keys()):
        (w1, c1), (w2, c2) = a[key], b[key]
        dw, dc = w2 / w1 - 1, c2 / c1 - 1
        flag = " *" if max(abs(dw), abs(dc)) > tolerance else ""
        outside += bool(flag)
        print(f"{_root_label(key[0]):<7}{key[1]:<7}{key[2]:<16}{key[3]:<14}{w1:>8.3f}{w2:>8.3f}{dw:>+7.0%}"
              f"{c1:>8.2f}{c2:>8.2f}{dc:>+7.0%}{flag}")
    return outside, len(a.keys() & b.keys())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("first")
    parser.add_argument("second")
    parser.add_argument("--tolerance", type=float, default=0.15)
    parser.add_argument("--markdown", action="store_true", help="print the lead table of docs/performance.md")
    args = parser.parse_args()
    with open(args.first) as f1, open(args.second) as f2:
        run1, run2 = json.load(f1), json.load(f2)
    if args.markdown:
        print(markdown(run1, run2))
        return 0
    print("medians of each method (wall s, CPU-s/GiB)")
    print(f"{'root':<7}{'where':<7}{'method':<16}{'op':<14}{'wall 1':>8}{'wall 2':>8}{'diff':>7}"
          f"{'cpu 1':>8}{'cpu 2':>8}{'diff':>7}")
    outside, rows = _compare(medians(run1), medians(run2), args.tolerance)
    print(f"{outside} of {rows} rows differ by more than {args.tolerance:.0%} (marked *)\n")
    print("targets (paired ratios): run 1, run 2")
    r1, r2 = target_ratios(run1), target_ratios(run2)
    for key in sorted(r1.keys() & r2.keys()):
        (a, met_a, bound), (b, met_b, _) = r1[key], r2[key]
        verdict = "met both" if met_a and met_b else "NOT met in " + " and ".join(
            name for name, met in (("run 1", met_a), ("run 2", met_b)) if not met)
        print(f"{_root_label(key[0]):<7}{key[1]:<7}{key[2]:<40}{a:>7.2f}{b:>7.2f}  ({bound}: {verdict})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
