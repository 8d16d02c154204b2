"""Restore under HSDP: dmuon's cooperative load against every rank reading for itself and
against torch's DCP, on local disk (pages dropped: a restart) and on S3.

    python benchmarks/cooperative_restore.py [--mib 128] [--repeats 3] [--meshes 2x2 2x4]
                                             [--stores local s3] [--json PATH]

The model is ``save_load.py``'s (square fp32 matrices, every other one dedicated), sharded
HSDP replicate x shard; torch's DCP saves and loads the same model built all-FSDP2 on the same
mesh. Each mesh and store: one save per method, then loads interleaved, order rotated:

  dmuon   dmuon.dcp.load(cooperative=True): each region read once per job, exchanged between
          every pair of ranks (the default does so on object storage; on a local path only
          between machines)
  apart   dmuon.dcp.load(cooperative=False): every rank reads what it holds
  torch   dcp.load with FileSystemReader / FsspecReader

Bytes fetched from storage, summed over ranks, against the bytes of the checkpoint's data
files: dmuon's reader counts what it fetched; for torch on local disk, the bytes its read calls
returned (``/proc/self/io`` rchar: on one machine the replicas share a page cache, so the
device's own count would hide the second replica's reads, which separate nodes would make);
torch on S3 is not counted. Wall time barrier to barrier, CPU-s/GiB as in ``save_load.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import uuid

import harness
import save_load
import torch

METHODS = ("dmuon", "apart", "torch")


def bytes_read_by_calls() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))


def worker(rank, world, n_matrices, replicate, root, options, repeats, warmup):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

    import dmuon.dcp as ddcp
    from dmuon.dcp.format import rank_of_data_file
    from dmuon.dcp.storage.registry import open_store

    local = options is None
    model = save_load.build(n_matrices, dedicated=True, replicate=replicate)
    plain = save_load.build(n_matrices, dedicated=False, replicate=replicate)
    paths = {"dmuon": f"{root}/dmuon", "torch": f"{root}/torch"}
    ddcp.save(model, None, paths["dmuon"], storage_options=options)
    if local:
        dcp.save(plain.state_dict(), storage_writer=dcp.FileSystemWriter(paths["torch"]))
    else:
        dcp.save(plain.state_dict(), storage_writer=FsspecWriter(paths["torch"], sync_files=False, **options))
    files = open_store(paths["dmuon"], options).list()
    data_bytes = sum(size for name, size in files.items() if rank_of_data_file(name) is not None)

    def load(method):
        if method == "torch":
            reader = dcp.FileSystemReader(paths["torch"]) if local else FsspecReader(paths["torch"], **options)
            before = bytes_read_by_calls()
            dcp.load(plain.state_dict(), storage_reader=reader)
            return bytes_read_by_calls() - before if local else None
        reader = ddcp.DMuonStorageReader(paths["dmuon"], storage_options=options, cooperative=method == "dmuon")
        state = ddcp.AppState(model).state_dict()
        dcp.load(state, storage_reader=reader, planner=ddcp.DMuonLoadPlanner())
        return reader.bytes_fetched

    samples: dict = {m: {"load": []} for m in METHODS}
    for repeat in range(-warmup, repeats):
        for method in harness.rotated(METHODS, repeat):
            if local:
                save_load.on_rank_zero(harness.drop_pages, paths["torch" if method == "torch" else "dmuon"])
            fetched: list = []
            sample = harness.measure(lambda method=method, fetched=fetched: fetched.append(load(method)))
            sample["fetched"] = fetched[0]
            if repeat >= 0:
                samples[method]["load"].append(sample)
    return {"samples": samples, "data_bytes": data_bytes}


def report(label: str, per_rank: list[dict], model_bytes: int) -> dict:
    gib = model_bytes / 2**30
    merged = save_load.merge([{"samples": {m: {"load": [{k: v for k, v in s.items() if k != "fetched"}
                                                         for s in r["samples"][m]["load"]]} for m in METHODS}}
                              for r in per_rank])
    data = per_rank[0]["data_bytes"]
    print(f"\n{label}: dmuon data files {data / 2**20:.0f} MiB")
    print(f"  {'':<34}{'wall s min':>11}{'median':>9}{'CPU-s/GiB':>11}{'fetched (x data)':>18}")
    out = {}
    for method, text in (("dmuon", "dmuon.dcp.load (cooperative)"), ("apart", "dmuon.dcp.load, each rank alone"),
                         ("torch", "torch dcp.load (all FSDP2)")):
        rows = merged[method]["load"]
        walls, cpus = save_load.series(rows, "wall", gib), save_load.series(rows, "cpu", gib)
        fetched = [sum(r["samples"][method]["load"][i]["fetched"] or 0 for r in per_rank)
                   for i in range(len(rows))]
        counted = all(r["samples"][method]["load"][0]["fetched"] is not None for r in per_rank)
        ratio = f"{statistics.median(fetched) / data:.2f}" if counted else "n/a"
        print(f"  {text:<34}{min(walls):>11.3f}{statistics.median(walls):>9.3f}{statistics.median(cpus):>11.2f}"
              f"{ratio:>18}")
        out[method] = {"walls": walls, "cpus": cpus, "fetched": fetched if counted else None}
    for peer in ("apart", "torch"):
        ratio = harness.paired_ratio(out["dmuon"]["walls"], out[peer]["walls"])
        print(f"  wall dmuon / {peer}: {ratio:.2f} (paired median)")
    return {"label": label, "data_bytes": data, "methods": out}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=128, help="model size in MiB (default 128)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--meshes", nargs="+", default=["2x2", "2x4"], help="replicate x shard (default 2x2 2x4)")
    parser.add_argument("--stores", nargs="+", default=["local", "s3"], choices=["local", "s3"])
    parser.add_argument("--root", default=None, help="local-disk directory (default: the system temp dir)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    n_matrices = max(2, args.mib * 2**20 // (save_load.DIM * save_load.DIM * 4))
    model_bytes = n_matrices * save_load.DIM * save_load.DIM * 4
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}; "
          f"model {model_bytes >> 20} MiB, every other matrix dedicated; {args.repeats} repeats, interleaved")
    results = []
    with tempfile.TemporaryDirectory(prefix="dmuon-bench-coop-", dir=args.root) as workdir:
        server = harness.SeaweedFS(workdir).__enter__() if "s3" in args.stores else None
        try:
            for store in args.stores:
                for mesh in args.meshes:
                    replicate, shard = (int(x) for x in mesh.split("x"))
                    if store == "local":
                        root, options = os.path.join(workdir, f"ckpt-{mesh}"), None
                    else:
                        root = f"s3://{harness.S3_BUCKET}/coop-{uuid.uuid4().hex[:8]}"
                        options = server.storage_options
                    per_rank = harness.run_ranks(worker, replicate * shard, n_matrices, replicate, root, options,
                                                 args.repeats, args.warmup)
                    results.append(report(f"[{store}] HSDP {replicate}x{shard}", per_rank, model_bytes))
                    sys.stdout.flush()
        finally:
            if server is not None:
                server.__exit__()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
