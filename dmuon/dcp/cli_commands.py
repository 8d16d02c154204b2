"""What ``dmuon-ckpt``'s commands run: imported by ``cli.py`` only when a command runs (this
module's imports pull in torch and the checkpoint reader, which ``--help`` does not need)."""

from __future__ import annotations

import argparse
import json
import sys
import warnings

from .checkpoint import inspect, open_checkpoint
from .export import export, release_freed_memory_promptly
from .hf_config import MissingConfigWarning, missing_config_note
from .progress import byte_progress

__all__ = ["run"]


def run(args: argparse.Namespace, options: dict | None, output_options: dict | None) -> int:
    """Run the parsed command; its exit status (1: the checkpoint failed verification). A
    failure to do the work at all raises, for ``cli.main`` to report."""
    if args.command == "export":
        return _export(args, options, output_options)
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
    with byte_progress(total, "verify") as bar:
        problems = listing.verify_files(bar.update)
    if problems:
        for problem in problems:
            print(f"FAILED {listing.store.url}/{problem}", file=sys.stderr)
        return 1
    print(f"OK {listing.store.url}: {len(data_files)} data files, {total:,} bytes, checksums match")
    return 0


def _export(args: argparse.Namespace, options: dict | None, output_options: dict | None) -> int:
    release_freed_memory_promptly()  # process-wide: fine in the CLI's own process
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", MissingConfigWarning)
        files = export(
            args.checkpoint,
            args.output,
            format=args.format,
            dtype=args.dtype,
            max_shard_size=args.max_shard_size,
            storage_options=options,
            output_storage_options=output_options,
            config=args.config,
        )
    for path in files:
        print(path)
    _report_warnings(caught, args.output)
    return 0


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


def _report_warnings(caught: list[warnings.WarningMessage], output: str) -> None:
    """The export's warnings on stderr as plain notes (the missing config's in the CLI's own
    words), after the list of files."""
    for item in caught:
        if issubclass(item.category, MissingConfigWarning):
            print(f"note: {missing_config_note(output, option='--config ')}", file=sys.stderr)
        else:
            print(f"warning: {item.message}", file=sys.stderr)
