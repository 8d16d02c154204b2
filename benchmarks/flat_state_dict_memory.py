"""Peak RSS growth per rank while gathering a flat state dict (rank0_only) of a large model.

    python benchmarks/flat_state_dict_memory.py [--mib 256] [--world-size 4]

Half the matrices are dedicated, half FSDP2; the model is built whole on every rank (then
sharded), so the numbers reported are the growth during ``get_model_state_dict`` /
``get_optimizer_state_dict`` only, after freed memory is returned to the OS.
"""
from __future__ import annotations

import argparse
import time

from harness import PeakRSS, run_ranks


def worker(rank, world, mib):
    from save_load import build

    import dmuon

    dim = 1024
    n = max(2, mib * 2**20 // (dim * dim * 4))
    model = build(n, dedicated=True)
    t0 = time.perf_counter()
    with PeakRSS() as rss:
        sd = dmuon.get_model_state_dict(model)
    secs = time.perf_counter() - t0
    return {"growth": rss.growth, "secs": secs, "bytes": sum(v.numel() * v.element_size() for v in sd.values()),
            "model": n * dim * dim * 4}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--world-size", type=int, default=4)
    args = parser.parse_args()
    results = run_ranks(worker, args.world_size, args.mib, timeout=600)
    model = results[0]["model"]
    print(f"model {model / 2**20:.0f} MiB on {args.world_size} ranks, get_model_state_dict(rank0_only=True)")
    print(f"{'rank':>4} {'peak RSS growth':>16} {'x model':>8} {'returned':>10} {'seconds':>8}")
    for rank, res in enumerate(results):
        print(f"{rank:>4} {res['growth'] / 2**20:>12.1f} MiB {res['growth'] / model:>8.2f} "
              f"{res['bytes'] / 2**20:>6.0f} MiB {res['secs']:>8.2f}")


if __name__ == "__main__":
    main()
