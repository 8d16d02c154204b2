"""The main job runs end to end: train, checkpoint, crash, resume bit-identically, export."""
import subprocess
import sys

import pytest


def run_demo(*args):
    return subprocess.run([sys.executable, "-m", "dmuon.demo", "--steps", "12", "--save-every", "4",
                           "--crash-at", "9", *args], capture_output=True, text=True, timeout=300)


def test_demo_local(tmp_path):
    res = run_demo("--checkpoint-dir", str(tmp_path / "ckpts"))
    assert res.returncode == 0, res.stdout + res.stderr
    assert "resumed at step 8" in res.stdout
    assert "losses identical, parameters bit-identical" in res.stdout
    assert res.stdout.rstrip().endswith("demo OK")
    assert list((tmp_path / "ckpts").glob("run-*/export/model.safetensors"))


@pytest.mark.slow
def test_demo_on_s3(s3_server):
    opts = [f"--storage-option={k}={v}" for k, v in s3_server.storage_options.items()]
    res = run_demo("--checkpoint-dir", s3_server.url(), *opts)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "demo OK" in res.stdout and "s3://" in res.stdout
