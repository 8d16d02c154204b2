"""Save / load throughput of dmuon.dcp on S3 against raw s3fs transfers of the same bytes.

    python benchmarks/object_storage.py [--mib 256] [--repeats 5] [--warmup 1] [--worlds 2]
                                        [--part-mib 16] [--concurrency 4] [--json PATH]

Starts a local SeaweedFS S3 server (the one the tests use) on loopback, runs the ranks against
it, and stops the server by its process group at the end (also on errors and Ctrl-C). The
model is ``benchmarks/save_load.py``'s: square fp32 matrices, every other one dedicated. Every
method uses one client configuration: the same s3fs storage options, the same retry policy
dmuon's store sets. Methods, interleaved with their order rotated each repeat:

  raw     each rank uploads exactly the bytes of its own dmuon data file with s3fs's
          ``pipe_file`` (multipart, parts of ``--part-mib`` sent ``--concurrency`` at a time)
          and downloads them with ``cat_file`` (ranged GETs of ``--part-mib``, as many at a
          time): the best s3fs itself does for a whole object
  stream  the same bytes through ``fs.open(path, "wb").write`` in 8 MiB writes and
          ``fs.open(path, "rb").readinto``, s3fs's file defaults: what a writer that streams
          into an s3fs file gets (parts go one at a time, the writer waits for each)
  dmuon   dmuon.dcp.save / dmuon.dcp.load with ``storage_options`` (the same ones)
  torch   torch DCP's ``FsspecWriter(sync_files=False)`` / ``FsspecReader`` on the same model
          built all-FSDP2

Throughput is the model's bytes over the slowest rank's wall time, barrier to barrier; CPU
seconds per GiB as in ``save_load.py`` (each rank's own process; the server's CPU is not
counted, and it shares this machine's cores). The target: dmuon >= 0.8x raw s3fs both ways,
where raw s3fs is the faster (by median) of ``raw`` and ``stream`` for that direction.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import statistics
import sys
import tempfile
import uuid
from pathlib import Path

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

import save_load  # noqa: E402  (the model, measuring, statistics)
import torch  # noqa: E402

from tests.helpers.launch import run_ranks  # noqa: E402
from tests.helpers.object_storage import BUCKET, SeaweedS3  # noqa: E402

METHODS = ("raw", "stream", "dmuon", "torch")
ROWS = (
    ("raw", "save", "raw s3fs pipe_file"),
    ("stream", "save", "s3fs file write (defaults)"),
    ("dmuon", "save", "dmuon.dcp.save"),
    ("torch", "save", "torch FsspecWriter (all FSDP2)"),
    ("raw", "load", "raw s3fs cat_file"),
    ("stream", "load", "s3fs file readinto (defaults)"),
    ("dmuon", "load", "dmuon.dcp.load"),
    ("torch", "load", "torch FsspecReader (all FSDP2)"),
)
TARGET = 0.8  # dmuon throughput / raw s3fs throughput, both ways
STREAM_WRITE = 8 << 20


def worker(rank, world, n_matrices, options, prefix, part_bytes, concurrency, repeats, warmup):
    """Every method, interleaved: per-rank samples of each operation."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

    import dmuon.dcp as ddcp
    from dmuon.dcp.format import rank_of_data_file
    from dmuon.dcp.fsspec_store import FsspecStore

    model, _ = save_load._build(n_matrices, dedicated=True)
    plain_model, _ = save_load._build(n_matrices, dedicated=False)
    store = FsspecStore(prefix, options)  # the client configuration dmuon uses, for every method
    fs = store.fs

    sizing = f"{prefix}/w{world}-sizing"
    ddcp.save(model, None, sizing, storage_options=options)
    listing = FsspecStore(sizing, options).list()
    share = sum(size for name, size in listing.items() if rank_of_data_file(name) == rank)
    _remove(FsspecStore(sizing, options))
    payload = os.urandom(share)
    buffer = bytearray(share)

    def raw_save(url):
        fs.pipe_file(f"{_path(url)}/{rank}.bin", payload, chunksize=part_bytes, max_concurrency=concurrency)

    def raw_load(url):
        data = fs.cat_file(f"{_path(url)}/{rank}.bin", chunksize=part_bytes, max_concurrency=concurrency)
        assert len(data) == share

    def stream_save(url):
        view = memoryview(payload)
        with fs.open(f"{_path(url)}/{rank}.bin", "wb") as f:
            for start in range(0, share, STREAM_WRITE):
                f.write(view[start : start + STREAM_WRITE])

    def stream_load(url):
        with fs.open(f"{_path(url)}/{rank}.bin", "rb") as f:
            got = f.readinto(buffer)
        assert got == share

    operations = {
        "raw": (raw_save, raw_load),
        "stream": (stream_save, stream_load),
        "dmuon": (
            lambda url: ddcp.save(model, None, url, storage_options=options),
            lambda url: ddcp.load(model, None, url, storage_options=options),
        ),
        "torch": (
            lambda url: dcp.save(
                plain_model.state_dict(), storage_writer=FsspecWriter(url, sync_files=False, **options)
            ),
            lambda url: dcp.load(plain_model.state_dict(), storage_reader=FsspecReader(url, **options)),
        ),
    }
    samples = {method: {"save": [], "load": []} for method in operations}
    for repeat in range(-warmup, repeats):
        for method in save_load._rotated(METHODS, repeat):
            url = f"{prefix}/w{world}-r{repeat}-{method}"
            save, load = operations[method]
            result = {
                "save": save_load._measure(lambda save=save, url=url: save(url)),
                "load": save_load._measure(lambda load=load, url=url: load(url)),
            }
            _remove(FsspecStore(url, options))
            if repeat >= 0:
                for op, sample in result.items():
                    samples[method][op].append(sample)
    return {"share_bytes": share, "samples": samples}


def _path(url: str) -> str:
    return url.split("://", 1)[1]


def _remove(store) -> None:
    """Collective: rank 0 deletes a measured checkpoint once every rank is done with it."""
    import torch.distributed as dist

    dist.barrier()
    if dist.get_rank() == 0:
        store.remove_tree()
    dist.barrier()


def _throughput(model_bytes: int, samples: list[dict]) -> tuple[float, float]:
    """MiB/s from the median and from the best wall time."""
    walls = [s["wall_s"] for s in samples]
    mib = model_bytes / 2**20
    return mib / statistics.median(walls), mib / min(walls)


def print_world(world: int, result: dict, model_bytes: int, repeats: int) -> dict:
    gib = model_bytes / 2**30
    samples = result["samples"]
    stats = {m: {op: save_load._stats(s, gib) for op, s in ops.items()} for m, ops in samples.items()}
    share = [round(b / 2**20, 1) for b in result["share_bytes"]]
    print(f"\nworld {world}: bytes per rank {share} MiB; {repeats} repeats, order rotated")
    print(save_load._header(with_raw=True) + f"{'MiB/s med':>11}{'best':>7}")
    for method, op, name in ROWS:
        base = stats["raw"][op] if method != "raw" else None
        median, best = _throughput(model_bytes, samples[method][op])
        print(save_load._row(f"{op:<5} {name}", stats[method][op], base) if base else
              save_load._row(f"{op:<5} {name}", stats[method][op], None) + " " * 18, end="")
        print(f"{median:>11.0f}{best:>7.0f}")
    verdicts = {}
    for op in ("save", "load"):
        best = min(("raw", "stream"), key=lambda m: stats[m][op]["wall_med"])
        ratio = save_load._ratio(stats[best][op]["wall_med"], stats["dmuon"][op]["wall_med"])
        verdicts[op] = ratio
        print(f"  dmuon / raw s3fs ({best}) {op} throughput (medians): {ratio:.2f}x "
              f"(target >= {TARGET}x: {'met' if ratio >= TARGET else 'NOT met'})")
    return verdicts


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--mib", type=int, default=256, help="model size in MiB (default 256)")
    parser.add_argument("--repeats", type=int, default=5, help="measured repeats per method (default 5)")
    parser.add_argument("--warmup", type=int, default=1, help="unrecorded rounds before them (default 1)")
    parser.add_argument("--worlds", type=int, nargs="+", default=[2], help="world sizes (default 2)")
    parser.add_argument("--part-mib", type=int, default=None,
                        help="raw s3fs part / range size in MiB (default: dmuon's upload part size)")
    parser.add_argument("--concurrency", type=int, default=None,
                        help="raw s3fs parts in flight (default: dmuon's upload concurrency)")
    parser.add_argument("--json", default=None, metavar="PATH", help="write every repeat's numbers here")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds per launch of ranks (default 3600)")
    return parser.parse_args(argv)


def main(argv=None) -> None:
    from dmuon.dcp import fsspec_store

    args = parse_args(argv)
    signal.signal(signal.SIGTERM, save_load._interrupted)
    signal.signal(signal.SIGHUP, save_load._interrupted)
    part_bytes = (args.part_mib << 20) if args.part_mib else fsspec_store.S3_PART_BYTES
    concurrency = args.concurrency or fsspec_store.S3_UPLOAD_CONCURRENCY
    n_matrices = max(2, args.mib * 2**20 // (save_load.DIM * save_load.DIM * 4))
    model_bytes = n_matrices * save_load.DIM * save_load.DIM * 4
    print("command: " + " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv]))
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f} (1 min); "
          "SeaweedFS S3 on loopback shares these CPUs")
    print(f"model: {n_matrices} x ({save_load.DIM}x{save_load.DIM}) fp32 = {model_bytes / 2**20:.0f} MiB; raw s3fs: "
          f"parts of {part_bytes >> 20} MiB, {concurrency} at a time")
    report = {"command": [sys.executable, *sys.argv], "torch": torch.__version__, "model_bytes": model_bytes,
              "part_bytes": part_bytes, "concurrency": concurrency, "worlds": [], "complete": False}
    workdir = tempfile.mkdtemp(prefix="dmuon-bench-s3-")
    server = None
    try:
        server = SeaweedS3(Path(workdir))
        prefix = f"s3://{BUCKET}/bench-{uuid.uuid4().hex[:8]}"
        for world in args.worlds:
            per_rank = run_ranks(worker, world, n_matrices, server.storage_options, prefix, part_bytes,
                                 concurrency, args.repeats, args.warmup, timeout=args.timeout)
            result = {"share_bytes": [r["share_bytes"] for r in per_rank], "samples": save_load._merge(per_rank)}
            result["dmuon_over_raw"] = print_world(world, result, model_bytes, args.repeats)
            report["worlds"].append({"world": world, **result})
            sys.stdout.flush()
        report["complete"] = True
    finally:
        if server is not None:
            server.stop()
        save_load.cleanup([workdir], [])
        print(f"\nload average {os.getloadavg()[0]:.2f} (1 min) at the end; server stopped, {workdir} removed")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
