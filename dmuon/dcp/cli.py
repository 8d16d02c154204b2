"""``dmuon-ckpt``: inspect, verify and export checkpoints (local paths or fsspec URLs)."""

from __future__ import annotations

import argparse
import json
import sys

from .checkpoint import inspect, open_checkpoint
from .errors import CheckpointError
from .export import release_freed_memory_promptly
from .store import storage_options_from_pairs

__all__ = ["main"]


def _print_inspect(doc: dict) -> None:
    print(f"checkpoint   {doc['checkpoint']}  (committed, save id {doc['save_id']})")
    print(
        f"written by   dmuon {doc['dmuon_version']}, torch {doc['torch_version']}, "
        f"world size {doc['world_size']}, topology {doc['topology']}"
    )
    total = sum(doc["files"].values())
    print(f"files        {len(doc['files'])}, {total:,} bytes")
    for name, size in doc["files"].items():
        print(f"  {size:>14,}  {name}")
    print("bytes per rank")
    for rank, size in doc["bytes_per_rank"].items():
        print(f"  rank {rank:<4} {size:>14,}")
    print(f"tensors      {len(doc['tensors'])}")
    width = max((len(t["key"]) for t in doc["tensors"]), default=10)
    for t in doc["tensors"]:
        owner = f" owner {tuple(t['owner'])} written by rank {t['written_by']}" if t["owner"] else ""
        print(
            f"  {t['key']:<{width}} {tuple(t['shape'])!s:<16} {t['dtype']:<9} {t['bytes']:>12,} B "
            f"{t['chunks']:>3} chunk(s){owner}"
        )
    if doc["objects"]:
        print(f"objects      {', '.join(doc['objects'])}")


def _progress_bar(total: int):
    from tqdm import tqdm

    return tqdm(
        total=total,
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        desc="verify",
        disable=not sys.stderr.isatty(),
        file=sys.stderr,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dmuon-ckpt", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, help_text in (
        ("inspect", "show what a checkpoint holds"),
        ("verify", "re-read every file and check sizes and checksums"),
        ("export", "write safetensors or one flat .pt"),
    ):
        cmd = sub.add_parser(name, help=help_text)
        cmd.add_argument("checkpoint")
        cmd.add_argument(
            "--storage-option",
            action="append",
            default=[],
            metavar="KEY=VALUE",
            help="fsspec option for s3:// or gs:// (repeatable)",
        )
        if name == "inspect":
            cmd.add_argument("--json", action="store_true", help="machine-readable output")
        if name == "export":
            cmd.add_argument("output")
            cmd.add_argument("--format", choices=("safetensors", "torch"), default="safetensors")
            cmd.add_argument("--dtype", default=None, help="cast floating tensors, e.g. bfloat16")
            cmd.add_argument("--max-shard-size", default="5GB")
    args = parser.parse_args(argv)
    options = storage_options_from_pairs(args.storage_option)
    try:
        if args.command == "export":
            from .export import export

            release_freed_memory_promptly()  # process-wide: fine in the CLI's own process
            files = export(
                args.checkpoint,
                args.output,
                format=args.format,
                dtype=args.dtype,
                max_shard_size=args.max_shard_size,
                storage_options=options,
            )
            for path in files:
                print(path)
            return 0
        listing = open_checkpoint(args.checkpoint, options)
        if args.command == "inspect":
            doc = inspect(listing)
            if args.json:
                print(json.dumps(doc, indent=1))
            else:
                _print_inspect(doc)
            return 0
        data_files = listing.manifest.files if listing.manifest else {}
        total = sum(stats.size for stats in data_files.values())
        with _progress_bar(total) as bar:
            problems = listing.verify_files(bar.update)
        if problems:
            for problem in problems:
                print(f"FAILED {listing.store.url}/{problem}", file=sys.stderr)
            return 1
        print(f"OK {listing.store.url}: {len(data_files)} data files, {total:,} bytes, checksums match")
        return 0
    except (CheckpointError, OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
