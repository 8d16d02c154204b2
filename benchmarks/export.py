"""Peak RSS and throughput of dmuon's streaming export vs torch's dcp_to_torch_save.

    python benchmarks/export.py [--mib 512] [--world-size 4] [--repeats 3]

Saves one checkpoint with dmuon (matrices 1024x1024 fp32, half dedicated, on --world-size
ranks), then converts it in fresh processes, each measured by its own ru_maxrss minus the
same process's RSS after imports: dmuon.dcp.export to safetensors and to .pt, and
torch.distributed.checkpoint.format_utils.dcp_to_torch_save to .pt.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

CONVERT = r"""
import os, resource, sys, time
import psutil, torch
import dmuon.dcp as ddcp
from dmuon.dcp.export import release_freed_memory_promptly
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
base = psutil.Process().memory_info().rss
t0 = time.perf_counter()
how, src, dst = sys.argv[1:4]
if how.startswith("dmuon"):
    release_freed_memory_promptly()  # as the dmuon-ckpt CLI does in its own process
if how == "dmuon-safetensors":
    ddcp.export(src, dst)
elif how == "dmuon-torch":
    ddcp.export(src, dst, format="torch")
else:
    dcp_to_torch_save(src, dst)
secs = time.perf_counter() - t0
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base, secs)
"""


def save_worker(rank, world, path, n):

    from save_load import build

    import dmuon.dcp as ddcp

    ddcp.save(build(n, dedicated=True), None, path)


def main():
    from harness import run_ranks

    parser = argparse.ArgumentParser()
    parser.add_argument("--mib", type=int, default=512)
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    n = args.mib // 4
    root = tempfile.mkdtemp(prefix="dmuon-export-bench-")
    try:
        ckpt = os.path.join(root, "ckpt")
        run_ranks(save_worker, args.world_size, ckpt, n, timeout=1800)
        size = sum(os.path.getsize(os.path.join(ckpt, f)) for f in os.listdir(ckpt))
        print(f"checkpoint: {n} tensors of 4 MiB = {size / 2**20:.0f} MiB on disk, written by "
              f"{args.world_size} ranks; medians of {args.repeats}\n")
        print(f"{'converter':<28}{'peak RSS growth':>16}{'x ckpt':>8}{'seconds':>9}{'MiB/s':>8}")
        for how in ("dmuon-safetensors", "dmuon-torch", "torch-dcp_to_torch_save"):
            rss, secs = [], []
            for rep in range(args.repeats):
                dst = os.path.join(root, f"{how}-{rep}" + ("" if how == "dmuon-safetensors" else ".pt"))
                out = subprocess.run([sys.executable, "-c", CONVERT, how, ckpt, dst], check=True,
                                     capture_output=True, text=True).stdout.split()
                rss.append(int(out[-2]))
                secs.append(float(out[-1]))
                shutil.rmtree(dst, ignore_errors=True) if os.path.isdir(dst) else os.remove(dst)
            r, s = statistics.median(rss), statistics.median(secs)
            print(f"{how:<28}{r / 2**20:>12.0f} MiB{r / size:>8.2f}{s:>9.2f}{size / 2**20 / s:>8.0f}")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
