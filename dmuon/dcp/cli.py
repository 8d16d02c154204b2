"""``dmuon-ckpt``: inspect, verify and export checkpoints (local paths or fsspec URLs).

This module builds the command line and reports failures; it imports nothing heavy, so that
``--help`` answers at once. What a command runs (torch, the checkpoint reader, the exporter)
is imported when it runs (``cli_commands.py``).

A failure is one or two lines on stderr, ``error: ...``, naming what failed (the URL or path,
the server's answer), with exit status 1; a usage error exits 2 (argparse's). ``--debug`` shows
the traceback instead. Secrets given as storage options never appear in what is printed.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from .errors import CheckpointError
from .format.layout import HF_CONFIG_FILE, HF_GENERATION_CONFIG_FILE
from .storage.retry import exception_chain
from .storage.secrets import redacted

__all__ = ["main", "storage_options_from_pairs"]

EXIT_FAILED = 1
EXIT_INTERRUPTED = 130


def storage_options_from_pairs(pairs: list[str] | None, flag: str = "--storage-option") -> dict | None:
    """``["key=value", ...]`` (command-line ``flag``s) as fsspec storage options; values are
    JSON where they parse as JSON (numbers, booleans, objects), else strings. A pair without
    ``=`` raises ``ValueError`` (a usage error)."""
    options: dict[str, Any] = {}
    for pair in pairs or []:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"{flag} expects KEY=VALUE, got {pair!r}")
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


def build_parser() -> argparse.ArgumentParser:
    """The whole command line, built without importing what the commands run."""
    parser = argparse.ArgumentParser(prog="dmuon-ckpt", description=__doc__.split("\n\n")[0])
    parser.add_argument("--debug", action="store_true", help="on failure, show the traceback")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, help_text in (
        ("inspect", "show what a checkpoint holds"),
        ("verify", "re-read every file and check sizes and checksums"),
        ("export", "write safetensors or one flat .pt"),
    ):
        cmd = sub.add_parser(name, help=help_text, epilog=_CREDENTIALS_NOTE)
        cmd.add_argument("checkpoint", metavar="CKPT", help="checkpoint directory: a local path, s3://... or gs://...")
        cmd.add_argument(
            "--debug", action="store_true", default=argparse.SUPPRESS, help="on failure, show the traceback"
        )
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
            _export_arguments(cmd)
    return parser


def _export_arguments(cmd: argparse.ArgumentParser) -> None:
    cmd.add_argument("output", metavar="OUT", help="directory (safetensors) or file (torch): a local path or URL")
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


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        options = storage_options_from_pairs(args.storage_option)
        output_options = None
        if getattr(args, "output_storage_option", None) is not None:
            output_options = storage_options_from_pairs(args.output_storage_option, "--output-storage-option") or {}
    except ValueError as exc:
        parser.error(str(exc))  # exits 2
    secrets = [options, output_options]
    try:
        from .cli_commands import run  # torch and the checkpoint reader: only for a command that runs

        return run(args, options, output_options)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as exc:
        if args.debug:
            raise
        for line in failure_lines(exc):
            print(redacted(line, *secrets), file=sys.stderr)
        return EXIT_FAILED


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
_DEBUG_HINT = "(run with --debug for the whole message and the traceback)"


def failure_lines(exc: BaseException) -> list[str]:
    """What is said on stderr about a failed command: one line naming what failed (dmuon's
    errors name the URL or path and carry the server's answer), and a second one only for a
    hint: missing credentials, or a message cut short."""
    text = str(exc).strip() or type(exc).__name__
    if not isinstance(exc, (CheckpointError, OSError)):
        text = f"{type(exc).__name__}: {text}"
    first, _, rest = text.partition("\n")
    lines = [f"error: {first}"]
    if _credentials_missing(exc):
        lines.append(_CREDENTIALS_HINT)
    elif rest.strip():
        more = len(rest.strip().splitlines())
        lines.append(
            f"  {rest.strip().splitlines()[0].strip()} (and {more - 1} more line(s)) {_DEBUG_HINT}"
            if more > 1
            else f"  {rest.strip()}"
        )
    return lines


def _credentials_missing(exc: BaseException) -> bool:
    return any({cls.__name__ for cls in type(link).__mro__} & _CREDENTIAL_ERRORS for link in exception_chain(exc))


if __name__ == "__main__":
    sys.exit(main())
