"""Do two runs of benchmarks/save_load.py agree? Medians side by side, and their difference.

    python benchmarks/compare_runs.py run1.json run2.json [--tolerance 0.15]

Prints, for every storage root, world size (or resharding pair), method and operation, the
median wall time and CPU-s/GiB of each run and the relative difference; rows outside the
tolerance are marked. Ratios between methods of one run are steadier than absolute times.
"""

from __future__ import annotations

import argparse
import json
import statistics


def medians(run: dict) -> dict[tuple, tuple[float, float]]:
    gib = run["model_bytes"] / 2**30
    out = {}
    for group, label in ((run["worlds"], "world"), (run.get("reshard") or [], "reshard")):
        for entry in group:
            where = f"{entry['world']}" if label == "world" else f"{entry['from']}->{entry['to']}"
            for method, ops in entry["samples"].items():
                for op, samples in ops.items():
                    wall = statistics.median(s["wall_s"] for s in samples)
                    cpu = statistics.median(sum(s["cpu_s"]) / gib for s in samples)
                    out[(entry["root"], where, method, op)] = (wall, cpu)
    return out


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("first")
    parser.add_argument("second")
    parser.add_argument("--tolerance", type=float, default=0.15)
    args = parser.parse_args()
    with open(args.first) as f1, open(args.second) as f2:
        a, b = medians(json.load(f1)), medians(json.load(f2))
    print(f"{'root':<10}{'where':<7}{'method':<7}{'op':<6}{'wall 1':>8}{'wall 2':>8}{'diff':>7}"
          f"{'cpu 1':>8}{'cpu 2':>8}{'diff':>7}")
    outside = 0
    for key in sorted(a.keys() & b.keys()):
        (w1, c1), (w2, c2) = a[key], b[key]
        dw, dc = w2 / w1 - 1, c2 / c1 - 1
        flag = " *" if max(abs(dw), abs(dc)) > args.tolerance else ""
        outside += bool(flag)
        print(f"{key[0]:<10}{key[1]:<7}{key[2]:<7}{key[3]:<6}{w1:>8.3f}{w2:>8.3f}{dw:>+7.0%}"
              f"{c1:>8.2f}{c2:>8.2f}{dc:>+7.0%}{flag}")
    print(f"{outside} of {len(a.keys() & b.keys())} rows differ by more than {args.tolerance:.0%} (marked *)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
