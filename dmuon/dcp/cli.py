"""``dmuon-ckpt``: inspect, verify and export checkpoints (local paths or fsspec URLs)."""

from __future__ import annotations

import argparse
import json
import sys
import warnings

from .checkpoint import inspect, open_checkpoint
from .errors import CheckpointError
from .export import export, release_freed_memory_promptly
from .format.layout import HF_CONFIG_FILE, HF_GENERATION_CONFIG_FILE
from .hf_config import MissingConfigWarning, missing_config_note
from .progress import byte_progress
from .storage.retry import exception_chain

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


def storage_options_from_pairs(pairs: list[str], flag: str = "--storage-option") -> dict | None:
    """``["key=value", ...]`` (command-line ``flag``s) as fsspec storage options; values are
    JSON where they parse as JSON (numbers, booleans, objects), else strings."""
    options = {}
    for pair in pairs or []:
        key, sep, value = pair.partition("=")
        if not sep:
            raise SystemExit(f"{flag} expects key=value, got {pair!r}")
        try:
            options[key] = json.loads(value)
        except ValueError:
            options[key] = value
    return options or None


_CREDENTIALS_NOTE = (
    "Without options, s3:// and gs:// take credentials and endpoint from the environment, as "
    "s3fs and gcsfs do: AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL, AWS_PROFILE, "
    "~/.aws/config and credentials (AWS_CONFIG_FILE, AWS_SHARED_CREDENTIALS_FILE); "
    "GOOGLE_APPLICATION_CREDENTIALS, STORAGE_EMULATOR_HOST."
)


def _output_options(pairs: list[str] | None) -> dict | None:
    """``--output-storage-option`` pairs; ``None`` when the flag was never given (the output
    then reuses the checkpoint's options if it is on the same kind of store)."""
    if pairs is None:
        return None
    return storage_options_from_pairs(pairs, flag="--output-storage-option")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dmuon-ckpt", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, help_text in (
        ("inspect", "show what a checkpoint holds"),
        ("verify", "re-read every file and check sizes and checksums"),
        ("export", "write safetensors or one flat .pt"),
    ):
        cmd = sub.add_parser(name, help=help_text, epilog=_CREDENTIALS_NOTE)
        cmd.add_argument("checkpoint", metavar="CKPT", help="checkpoint directory: a local path, s3://... or gs://...")
        cmd.add_argument(
            "--storage-option",
            action="append",
            default=[],
            metavar="KEY=VALUE",
            help="fsspec option for the checkpoint on s3:// or gs:// (repeatable)"
            + (
                "; OUT reuses them only when it is on the same kind of store (both s3://, both "
                "gs://, both local) and no --output-storage-option is given"
                if name == "export"
                else ""
            ),
        )
        if name == "inspect":
            cmd.add_argument("--json", action="store_true", help="machine-readable output")
        if name == "export":
            cmd.add_argument(
                "output", metavar="OUT", help="directory (safetensors) or file (torch): a local path or URL"
            )
            cmd.add_argument(
                "--output-storage-option",
                action="append",
                default=None,
                metavar="KEY=VALUE",
                help="fsspec option for OUT when it is itself on s3:// or gs:// (repeatable); "
                "given at all, they replace the checkpoint's options for OUT",
            )
            cmd.add_argument("--format", choices=("safetensors", "torch"), default="safetensors")
            cmd.add_argument("--dtype", default=None, help="cast floating tensors, e.g. bfloat16")
            cmd.add_argument("--max-shard-size", default="5GB")
            cmd.add_argument(
                "--config",
                default=None,
                metavar="PATH",
                help=f"the model's HuggingFace {HF_CONFIG_FILE}, or a folder holding one: copied into OUT "
                f"(with {HF_GENERATION_CONFIG_FILE} if it is beside it), its dtype set to the exported "
                "one, so that from_pretrained(OUT) needs nothing else",
            )
    args = parser.parse_args(argv)
    options = storage_options_from_pairs(args.storage_option)
    try:
        if args.command == "export":
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
                    output_storage_options=_output_options(args.output_storage_option),
                    config=args.config,
                )
            for path in files:
                print(path)
            _report_warnings(caught, args.output)
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
        with byte_progress(total, "verify") as bar:
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
    except Exception as exc:
        if not _credentials_missing(exc):
            raise
        print(f"error: {type(exc).__name__}: {exc}. {_CREDENTIALS_HINT}", file=sys.stderr)
        return 1


def _report_warnings(caught: list[warnings.WarningMessage], output: str) -> None:
    """The export's warnings on stderr as plain notes (the missing config's in the CLI's own
    words), after the list of files."""
    for item in caught:
        if issubclass(item.category, MissingConfigWarning):
            print(f"note: {missing_config_note(output, option='--config ')}", file=sys.stderr)
        else:
            print(f"warning: {item.message}", file=sys.stderr)


# botocore's and google-auth's "no usable credentials" errors, matched by class name so that
# neither library is imported here
_CREDENTIAL_ERRORS = {
    "NoCredentialsError",
    "PartialCredentialsError",
    "CredentialRetrievalError",
    "DefaultCredentialsError",
    "RefreshError",
}
_CREDENTIALS_HINT = (
    "Give them with --storage-option (s3://: key=... secret=...; gs://: token=/path/key.json), or "
    "where s3fs and gcsfs look for them (see --help)"
)


def _credentials_missing(exc: BaseException) -> bool:
    return any({cls.__name__ for cls in type(link).__mro__} & _CREDENTIAL_ERRORS for link in exception_chain(exc))


if __name__ == "__main__":
    sys.exit(main())
