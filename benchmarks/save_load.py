"""Save / load throughput of dmuon.dcp against the storage limit and the alternatives.

    python benchmarks/save_load.py [--mib 512] [--repeats 3] [--worlds 2 4] [--root DIR]

For each world size, on the same model (square fp32 matrices; every other one dedicated),
model weights only (optimizer state is more tensors of the same kinds):
  raw        each rank writes (reads) exactly its share with plain write + fsync: the limit
  dmuon      dmuon.dcp.save / dmuon.dcp.load
  torch-dcp  torch's dcp.save / dcp.load (FileSystemWriter/Reader) on an all-FSDP2 model
  flat       dmuon.get_model_state_dict + rank-0 torch.save + fsync / torch.load + set on all
plus a load resharded from the other world size, the blocking time of async_save, and the
peak RSS growth per rank during dmuon's save. Medians over --repeats; times barrier to barrier.
Reads come from the page cache where the kernel kept the files (dropping it needs privileges).
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402

from tests.helpers.launch import run_ranks  # noqa: E402

DIM = 1024


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


def _timed(fn):
    import torch.distributed as dist

    dist.barrier()
    t0 = time.perf_counter()
    out = fn()
    dist.barrier()
    return time.perf_counter() - t0, out


def _raw_write(path: str, nbytes: int) -> None:
    buf = memoryview(bytearray(os.urandom(1 << 20)) * 1)
    with open(path, "wb") as f:
        left = nbytes
        while left > 0:
            n = min(left, len(buf))
            f.write(buf[:n])
            left -= n
        f.flush()
        os.fsync(f.fileno())


def _raw_read(path: str) -> None:
    with open(path, "rb") as f:
        while f.read(16 << 20):
            pass


def worker(rank, world, n_matrices, root, repeats):
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import dmuon
    import dmuon.dcp as ddcp
    from tests.helpers.memory import PeakRSS, return_freed_memory_to_os

    res = {k: [] for k in ("raw_save", "dmuon_save", "torch_save", "flat_save", "raw_load", "dmuon_load",
                           "torch_load", "flat_load", "async_block", "async_total")}
    model, opt = _build(n_matrices, dedicated=True)
    plain_model, _ = _build(n_matrices, dedicated=False)
    return_freed_memory_to_os()
    rss = None
    for rep in range(repeats):
        d = os.path.join(root, f"w{world}-r{rep}")
        # dmuon save (and its share sizes, which define the raw baseline)
        with PeakRSS() as peak:
            secs, _ = _timed(lambda: ddcp.save(model, None, f"{d}/dmuon"))
        rss = peak.growth if rss is None else max(rss, peak.growth)
        res["dmuon_save"].append(secs)
        share = sum(os.path.getsize(f"{d}/dmuon/{f}") for f in os.listdir(f"{d}/dmuon")
                    if f.startswith(f"__{rank}_"))
        secs, _ = _timed(lambda: _raw_write(f"{d}/raw-{rank}.bin", share))
        res["raw_save"].append(secs)
        secs, _ = _timed(lambda: _raw_read(f"{d}/raw-{rank}.bin"))
        res["raw_load"].append(secs)
        secs, _ = _timed(lambda: dcp.save(plain_model.state_dict(), storage_writer=dcp.FileSystemWriter(f"{d}/torch")))
        res["torch_save"].append(secs)

        def flat_save():
            sd = dmuon.get_model_state_dict(model)
            if rank == 0:
                with open(f"{d}/flat.pt", "wb") as f:
                    torch.save(sd, f)
                    f.flush()
                    os.fsync(f.fileno())
        secs, _ = _timed(flat_save)
        res["flat_save"].append(secs)
        secs, _ = _timed(lambda: ddcp.load(model, None, f"{d}/dmuon"))
        res["dmuon_load"].append(secs)
        state = plain_model.state_dict()
        secs, _ = _timed(lambda: dcp.load(state, storage_reader=dcp.FileSystemReader(f"{d}/torch")))
        res["torch_load"].append(secs)
        secs, _ = _timed(lambda: dmuon.set_model_state_dict(model, torch.load(f"{d}/flat.pt", mmap=True)))
        res["flat_load"].append(secs)
        t0 = time.perf_counter()
        handle = ddcp.async_save(model, None, f"{d}/async")
        res["async_block"].append(time.perf_counter() - t0)
        handle.wait()
        dist.barrier()
        res["async_total"].append(time.perf_counter() - t0)
    res["rss_growth"] = rss
    res["share"] = share
    return res


def reshard_worker(rank, world, n_matrices, path):
    import dmuon.dcp as ddcp

    model, opt = _build(n_matrices, dedicated=True)
    secs, _ = _timed(lambda: ddcp.load(model, None, path))
    return secs


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--mib", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--root", default=None)
    args = parser.parse_args()
    n_matrices = max(2, args.mib * 2**20 // (DIM * DIM * 4))
    root = args.root or tempfile.mkdtemp(prefix="dmuon-bench-")
    med = statistics.median
    print(f"model: {n_matrices} x ({DIM}x{DIM}) fp32 = {n_matrices * DIM * DIM * 4 / 2**20:.0f} MiB, "
          f"half dedicated; medians of {args.repeats}; root {root}\n")
    rows = []
    try:
        for world in args.worlds:
            results = run_ranks(worker, world, n_matrices, root, args.repeats, timeout=3600)
            r = results[0]
            other = [w for w in args.worlds if w != world]
            reshard = None
            if other:
                reshard = med(run_ranks(reshard_worker, other[0], n_matrices,
                                        f"{root}/w{world}-r0/dmuon", timeout=1800))
            rows.append((world, r, reshard, other[0] if other else None,
                         [x["rss_growth"] for x in results]))
    finally:
        if args.root is None:
            shutil.rmtree(root, ignore_errors=True)
    for world, r, reshard, other, rss in rows:
        raw_s, raw_l = med(r["raw_save"]), med(r["raw_load"])
        print(f"world {world}: each rank's share ~{r['share'] / 2**20:.0f} MiB")
        print(f"  {'':<24}{'seconds':>9}{'x raw':>8}")
        for name, key, base in (("raw write + fsync", "raw_save", raw_s), ("dmuon.dcp.save", "dmuon_save", raw_s),
                                ("torch dcp.save (FSDP2)", "torch_save", raw_s), ("flat gather+torch.save", "flat_save", raw_s),
                                ("raw read", "raw_load", raw_l), ("dmuon.dcp.load", "dmuon_load", raw_l),
                                ("torch dcp.load (FSDP2)", "torch_load", raw_l), ("flat torch.load+set", "flat_load", raw_l)):
            print(f"  {name:<24}{med(r[key]):>9.2f}{med(r[key]) / base:>8.2f}")
        if reshard is not None:
            print(f"  {f'dmuon.dcp.load {world}->{other}':<24}{reshard:>9.2f}{reshard / raw_l:>8.2f}")
        print(f"  async_save blocking {med(r['async_block']):.3f}s = "
              f"{100 * med(r['async_block']) / med(r['dmuon_save']):.1f}% of sync save; "
              f"total {med(r['async_total']):.2f}s")
        print(f"  peak RSS growth during save per rank (MiB): {[round(x / 2**20) for x in rss]}\n")


if __name__ == "__main__":
    main()
