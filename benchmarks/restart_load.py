"""A restart's load: a new job loads a checkpoint none of whose pages is cached, once.

    python benchmarks/restart_load.py [--mib 512] [--worlds 2 4] [--rounds 6]
                                      [--methods dmuon dmuon-direct-read torch] [--root DIR]

``save_load.py`` times loads inside one long job, after the same job saved: its page cache,
allocator and planner caches are warm in ways a restarted job's are not. Here every load is
the first thing a fresh set of rank processes does after building the model: for each round
and method, one job saves, the pages are dropped, and a new job loads. Methods run in turn,
the order rotated every round, so a slow spell of the machine hits them alike.

Methods: ``dmuon`` (``dmuon.dcp.load``, the defaults), ``dmuon-direct-read`` (the same
checkpoint loaded with ``storage_options={"direct_io": True}``: cold files past the page
cache), ``torch`` (torch's DCP on the same model all-FSDP2, its own checkpoint). Reported per
world size: wall (the slowest rank, barrier to barrier) min and median, the job's CPU
seconds (all ranks, every thread), and each method's median over torch's.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile

import harness
import save_load

METHODS = ("dmuon", "dmuon-direct-read", "torch")


def save_job(rank: int, world: int, n_matrices: int, path: str, method: str) -> None:
    if method == "torch":
        import torch.distributed.checkpoint as dcp

        model = save_load.build(n_matrices, dedicated=False, meta=True)
        dcp.save(model.state_dict(), storage_writer=dcp.FileSystemWriter(path))
        return
    import dmuon.dcp as ddcp

    ddcp.save(save_load.build(n_matrices, dedicated=True, meta=True), None, path)


def load_job(rank: int, world: int, n_matrices: int, path: str, method: str) -> dict[str, float]:
    """The first load of this job's ranks, the checkpoint's pages dropped just before."""
    if method == "torch":
        import torch.distributed.checkpoint as dcp

        model = save_load.build(n_matrices, dedicated=False, meta=True)
        save_load.prepare(path, "cold")
        return harness.measure(lambda: dcp.load(model.state_dict(), storage_reader=dcp.FileSystemReader(path)))
    import dmuon.dcp as ddcp

    load = ddcp.load  # (dmuon.dcp imports its modules on first use: outside the timing, as torch's are)
    model = save_load.build(n_matrices, dedicated=True, meta=True)
    options = {"direct_io": True} if method == "dmuon-direct-read" else None
    save_load.prepare(path, "cold")
    return harness.measure(lambda: load(model, None, path, storage_options=options))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=512, help="model size in MiB (default 512)")
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4], help="world sizes (default 2 4)")
    parser.add_argument("--rounds", type=int, default=6, help="loads per method and world size (default 6)")
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--root", default=None, help="where checkpoints go (default: a temp dir on local disk)")
    args = parser.parse_args(argv)
    n_matrices = max(2, args.mib * 2**20 // (save_load.DIM * save_load.DIM * 4))
    root = tempfile.mkdtemp(prefix="dmuon-restart-", dir=args.root or save_load.default_roots()[0])
    print(f"command: {' '.join([sys.executable, *sys.argv])}")
    print(f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}; {args.mib} MiB model, checkpoints "
          f"under {root} ({harness.fs_type(root)}); every load is a new job's first, pages dropped")
    try:
        for world in args.worlds:
            samples: dict[str, list[dict[str, float]]] = {m: [] for m in args.methods}
            for round_ in range(args.rounds):
                for method in harness.rotated(args.methods, round_):
                    path = os.path.join(root, f"w{world}-r{round_}-{method}")
                    harness.run_ranks(save_job, world, n_matrices, path, method, timeout=900)
                    per_rank = harness.run_ranks(load_job, world, n_matrices, path, method, timeout=900)
                    samples[method].append({"wall_s": max(r["wall_s"] for r in per_rank),
                                            "cpu_s": sum(r["cpu_s"] for r in per_rank)})
                    shutil.rmtree(path)
            print(f"\n{world} ranks, {args.rounds} rounds: wall s (min / median), job CPU-s (median), "
                  "÷ torch (medians)")
            torch_median = statistics.median(s["wall_s"] for s in samples["torch"]) if "torch" in samples else None
            for method, runs in samples.items():
                walls = [s["wall_s"] for s in runs]
                median = statistics.median(walls)
                ratio = f"{median / torch_median:.2f}" if torch_median else "-"
                cpu = statistics.median(s["cpu_s"] for s in runs)
                print(f"  {method:<20} {min(walls):.3f} / {median:.3f}   {cpu:.3f}   {ratio}   "
                      f"[{', '.join(f'{w:.2f}' for w in walls)}]")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
