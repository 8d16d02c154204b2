"""dmuon-ckpt inspect / verify / export: exit codes and output on good and broken checkpoints."""
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import dmuon.dcp as ddcp
from tests.helpers.launch import run_ranks
from tests.helpers.training import build, train


def save_worker(rank, world, path, storage_options=None):
    model, opt = build()
    train(model, opt, rank, world, range(1))
    ddcp.save(model, opt, path, storage_options=storage_options)


def cli(*args, console_script=False):
    """The installed console script in a subprocess, or (faster) ``main()`` in this process."""
    if console_script:
        argv = [str(Path(sys.executable).parent / "dmuon-ckpt"), *args]
        return subprocess.run(argv, capture_output=True, text=True, timeout=120)
    import contextlib
    import io
    import types

    from dmuon.dcp.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(args))
    return types.SimpleNamespace(returncode=code, stdout=out.getvalue(), stderr=err.getvalue())


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    path = tmp_path_factory.mktemp("cli") / "ckpt"
    run_ranks(save_worker, 2, str(path))
    return path


def test_inspect_text_and_json(good):
    res = cli("inspect", str(good), console_script=True)
    assert res.returncode == 0, res.stderr
    assert "world size 2" in res.stdout and "model.layers.0.q_proj.weight" in res.stdout
    assert "written by rank" in res.stdout
    doc = json.loads(cli("inspect", str(good), "--json").stdout)
    assert doc["world_size"] == 2 and doc["topology"] == {"replicate": 1, "shard": 2}
    assert set(doc["bytes_per_rank"]) == {"0", "1"}
    q = next(t for t in doc["tensors"] if t["key"] == "model.layers.0.q_proj.weight")
    assert q["shape"] == [32, 32] and q["dtype"] == "float32" and q["owner"] is not None
    assert doc["dmuon_version"] and doc["torch_version"].startswith(torch.__version__.split("+")[0])


def test_verify_good_incomplete_and_corrupted(good, tmp_path):
    res = cli("verify", str(good))
    assert res.returncode == 0 and res.stdout.startswith("OK"), res.stderr
    incomplete = tmp_path / "incomplete"
    shutil.copytree(good, incomplete)
    os.remove(incomplete / ".metadata")
    res = cli("verify", str(incomplete))
    assert res.returncode == 1 and "incomplete" in res.stderr
    corrupted = tmp_path / "corrupted"
    shutil.copytree(good, corrupted)
    victim = sorted(f for f in os.listdir(corrupted) if f.endswith(".distcp"))[0]
    raw = bytearray((corrupted / victim).read_bytes())
    raw[len(raw) // 2] ^= 0xFF  # (in an item: the file's last bytes are its checksum trailer)
    (corrupted / victim).write_bytes(bytes(raw))
    res = cli("verify", str(corrupted))
    assert res.returncode == 1 and victim in res.stderr and "checksum mismatch" in res.stderr
    truncated = tmp_path / "truncated"
    shutil.copytree(good, truncated)
    (truncated / victim).write_bytes(raw[: len(raw) // 2])
    res = cli("verify", str(truncated))
    assert res.returncode == 1 and victim in res.stderr


def test_export_command(good, tmp_path):
    res = cli("export", str(good), str(tmp_path / "out"), "--dtype", "bfloat16")
    assert res.returncode == 0, res.stderr
    from safetensors.torch import load_file

    weights = load_file(tmp_path / "out" / "model.safetensors")
    assert weights["layers.0.q_proj.weight"].dtype == torch.bfloat16
    res = cli("export", str(good), str(tmp_path / "m.pt"), "--format", "torch")
    assert res.returncode == 0 and "m.pt" in res.stdout
    res = cli("export", str(tmp_path / "missing"), str(tmp_path / "o"))
    assert res.returncode == 1 and "no checkpoint" in res.stderr


def test_cli_on_s3_with_storage_options(s3_server):
    url = s3_server.url()
    run_ranks(save_worker, 2, url, s3_server.storage_options)
    opts = [f"--storage-option={k}={v}" for k, v in s3_server.storage_options.items()]
    assert cli("verify", url, *opts).returncode == 0
    doc = json.loads(cli("inspect", url, "--json", *opts).stdout)
    assert doc["checkpoint"] == url and doc["world_size"] == 2


# --- the user's first minute: --help at once, every failure in a line or two ----------------

HELP_COMMANDS = [[], ["inspect"], ["verify"], ["export"]]


def imported_modules(argv: list[str]) -> tuple[set[str], float]:
    """The modules a command line imports, as ``python -X importtime`` lists them, and its time."""
    started = time.monotonic()
    res = subprocess.run([sys.executable, "-X", "importtime", *argv], capture_output=True, text=True, timeout=120)
    seconds = time.monotonic() - started
    assert res.returncode == 0, res.stderr[-2000:]
    assert "usage:" in res.stdout
    timings = [line for line in res.stderr.splitlines() if line.startswith("import time:")]
    return {line.rsplit("|", 1)[1].strip() for line in timings}, seconds


@pytest.mark.parametrize("entry", ["console script", "python -m dmuon.dcp"])
@pytest.mark.parametrize("command", HELP_COMMANDS, ids=lambda c: " ".join(c) or "top")
def test_help_imports_neither_torch_nor_fsspec(entry, command):
    """``--help`` is answered from the parser alone: what a command runs is imported when it runs."""
    script = str(Path(sys.executable).parent / "dmuon-ckpt")
    argv = [script] if entry == "console script" else ["-m", "dmuon.dcp"]
    modules, seconds = imported_modules([*argv, *command, "--help"])
    assert "dmuon.dcp.cli" in modules
    heavy = sorted(m for m in modules if m.split(".")[0] in ("torch", "fsspec", "numpy", "botocore"))
    assert heavy == [], heavy[:5]
    print(f"{entry} {' '.join(command)} --help: {seconds:.2f} s with -X importtime")


def lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()]


def test_an_unreachable_endpoint_is_one_line_naming_the_url_and_no_secret():
    pytest.importorskip("s3fs")
    options = {"endpoint_url": "http://127.0.0.1:9", "key": "AKIAEXAMPLEKEY", "secret": "sEcReT-never-shown"}
    flags = [f"--storage-option={k}={v}" for k, v in options.items()]
    started = time.monotonic()
    res = cli("inspect", "s3://bucket/ckpt", *flags, console_script=True)
    seconds = time.monotonic() - started
    assert res.returncode == 1, res.stderr
    assert 1 <= len(lines(res.stderr)) <= 2 and "Traceback" not in res.stderr, res.stderr
    assert res.stderr.startswith("error: s3://bucket/ckpt: ") and "http://127.0.0.1:9" in res.stderr, res.stderr
    assert "EndpointConnectionError" in res.stderr
    assert options["secret"] not in res.stderr + res.stdout and options["key"] not in res.stderr + res.stdout
    print(f"dmuon-ckpt inspect on an unreachable endpoint: exit 1 after {seconds:.1f} s")


def test_debug_shows_the_traceback(tmp_path):
    res = cli("--debug", "inspect", str(tmp_path / "missing"), console_script=True)
    assert res.returncode == 1 and "Traceback" in res.stderr and "CheckpointNotFoundError" in res.stderr


@pytest.mark.parametrize("command", ["inspect", "verify"])
def test_a_missing_path_is_one_line_naming_it(tmp_path, command):
    missing = tmp_path / "no" / "such" / "ckpt"
    res = cli(command, str(missing))
    assert res.returncode == 1 and lines(res.stderr) == [f"error: no checkpoint at {missing}"], res.stderr


def test_a_corrupt_checkpoint_is_one_line_naming_the_file(good, tmp_path):
    corrupt = tmp_path / "corrupt"
    shutil.copytree(good, corrupt)
    metadata = corrupt / ".metadata"
    metadata.write_bytes(metadata.read_bytes()[:50])
    res = cli("inspect", str(corrupt), console_script=True)
    assert res.returncode == 1 and "Traceback" not in res.stderr, res.stderr
    assert 1 <= len(lines(res.stderr)) <= 2 and ".metadata" in lines(res.stderr)[0], res.stderr


@pytest.mark.parametrize("argv", [
    [],
    ["inspect"],
    ["frobnicate", "x"],
    ["inspect", "x", "--storage-option", "no-equals-sign"],
    ["export", "x", "out", "--output-storage-option", "=v"],
    ["export", "x", "out", "--format", "zip"],
], ids=lambda a: " ".join(a) or "nothing")
def test_usage_errors_exit_2_without_a_traceback(argv):
    res = cli(*argv, console_script=True)
    assert res.returncode == 2 and "Traceback" not in res.stderr and "usage:" in res.stderr, res.stderr
