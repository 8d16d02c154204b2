"""``dmuon-ckpt`` on real object storage, as users run it.

A 2-rank job saves to SeaweedFS (S3) or fake-gcs-server (GCS); the installed console script,
in a subprocess, inspects, verifies and exports the checkpoint to a local safetensors
directory and a local ``.pt``, each compared bit for bit with the model's state dict.
Credentials come either from ``--storage-option`` or from the environment alone (AWS
variables, AWS config files, ``STORAGE_EMULATOR_HOST``, ``GOOGLE_APPLICATION_CREDENTIALS``),
in an environment stripped of every other cloud setting. The commands of docs/export.md run
as written.
"""
import json
import os
import re
import shlex
import subprocess
import sys
import threading
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import dmuon
import dmuon.dcp as ddcp
from dmuon.dcp.export import resolve_output_options
from dmuon.dcp.storage.fsspec_store import S3_REQUEST_RETRIES, _bounded_s3_retries
from tests.helpers.launch import run_ranks
from tests.helpers.training import build, train

BIN = Path(sys.executable).parent
DOC = Path(__file__).resolve().parents[2] / "docs" / "export.md"
# Everything through which s3fs/botocore, gcsfs/google-auth or fsspec could find a credential
# or an endpoint other than the ones a test gives.
CLOUD_PREFIXES = ("AWS_", "BOTO_", "GOOGLE_", "GCLOUD", "CLOUDSDK_", "GCE_", "STORAGE_EMULATOR_HOST", "FSSPEC_")


def clean_env(tmp_path: Path, **settings: str) -> dict:
    """This process's environment without cloud settings, AWS and gcloud config files pointed
    at nothing (not the user's ~/.aws or ~/.config/gcloud), plus ``settings``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(CLOUD_PREFIXES)}
    env.update(
        AWS_CONFIG_FILE=str(tmp_path / "no-aws-config"),
        AWS_SHARED_CREDENTIALS_FILE=str(tmp_path / "no-aws-credentials"),
        CLOUDSDK_CONFIG=str(tmp_path / "no-gcloud"),
        PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
    )
    env.update(settings)
    return env


def dmuon_ckpt(*args: str, env: dict) -> subprocess.CompletedProcess:
    """The installed console script, in a subprocess; fails the test on a non-zero exit."""
    res = subprocess.run([str(BIN / "dmuon-ckpt"), *args], capture_output=True, text=True, timeout=120, env=env)
    assert res.returncode == 0, f"{shlex.join(res.args)}\n--- stdout\n{res.stdout}\n--- stderr\n{res.stderr}"
    return res


def assert_bit_identical(got: dict, expected: dict) -> None:
    assert sorted(got) == sorted(expected)
    for key, tensor in expected.items():
        assert got[key].dtype == tensor.dtype and got[key].shape == tensor.shape, key
        assert torch.equal(got[key].contiguous().view(torch.uint8), tensor.contiguous().view(torch.uint8)), key


def save_worker(rank, world, url, storage_options):
    model, opt = build()
    train(model, opt, rank, world, range(1))
    ddcp.save(model, opt, url, storage_options=storage_options)
    return dmuon.get_model_state_dict(model)


def run_url(server, name: str = "step-1") -> str:
    return server.url(f"run-{uuid.uuid4().hex[:8]}/{name}")


@pytest.fixture(scope="module")
def s3_checkpoint(s3_server):
    url = run_url(s3_server)
    return url, run_ranks(save_worker, 2, url, s3_server.storage_options)[0]


@pytest.fixture(scope="module")
def gcs_checkpoint(gcs_server):
    url = run_url(gcs_server)
    return url, run_ranks(save_worker, 2, url, gcs_server.storage_options)[0]


def option_flags(options: dict, flag: str = "--storage-option") -> list[str]:
    return [f"{flag}={key}={value}" for key, value in options.items()]


def check_commands(url: str, expected: dict, out: Path, env: dict, args: list[str]) -> None:
    """inspect, verify, export to local safetensors and to a local .pt: all as the model."""
    doc = json.loads(dmuon_ckpt("inspect", url, "--json", *args, env=env).stdout)
    assert doc["checkpoint"] == url and doc["world_size"] == 2
    assert {t["key"] for t in doc["tensors"]} >= {f"model.{k}" for k in expected}
    res = dmuon_ckpt("verify", url, *args, env=env)
    assert res.stdout.startswith(f"OK {url}:") and "checksums match" in res.stdout
    res = dmuon_ckpt("export", url, str(out / "hf"), "--format", "safetensors", *args, env=env)
    assert res.stdout.split() == [str(out / "hf" / "model.safetensors")]
    assert_bit_identical(load_file(out / "hf" / "model.safetensors"), expected)
    res = dmuon_ckpt("export", url, str(out / "flat.pt"), "--format", "torch", *args, env=env)
    assert res.stdout.split() == [str(out / "flat.pt")]
    assert_bit_identical(torch.load(out / "flat.pt", weights_only=True), expected)


def check_reads(url: str, expected: dict, out: Path, env: dict) -> None:
    """verify, and export to a local .pt compared with the model: where credentials come from
    the environment alone. Every command opens its store the same way (options from the flags,
    the rest left to s3fs or gcsfs), so each command is run in full once per store, with
    --storage-option (check_commands); a credential source needs only a command that reads it all."""
    res = dmuon_ckpt("verify", url, env=env)
    assert res.stdout.startswith(f"OK {url}:") and "checksums match" in res.stdout
    dmuon_ckpt("export", url, str(out / "flat.pt"), "--format", "torch", env=env)
    assert_bit_identical(torch.load(out / "flat.pt", weights_only=True), expected)


# ---------------------------------------------------------------------------------------------
# S3
# ---------------------------------------------------------------------------------------------
def test_s3_commands_with_storage_options(s3_server, s3_checkpoint, tmp_path):
    url, expected = s3_checkpoint
    check_commands(url, expected, tmp_path, clean_env(tmp_path), option_flags(s3_server.storage_options))


def aws_variables(server) -> dict:
    opts = server.storage_options
    return {"AWS_ENDPOINT_URL": opts["endpoint_url"], "AWS_ACCESS_KEY_ID": opts["key"],
            "AWS_SECRET_ACCESS_KEY": opts["secret"]}


def test_s3_commands_with_aws_environment_variables(s3_server, s3_checkpoint, tmp_path):
    url, expected = s3_checkpoint
    check_reads(url, expected, tmp_path, clean_env(tmp_path, **aws_variables(s3_server)))


def test_s3_commands_with_aws_config_files(s3_server, s3_checkpoint, tmp_path):
    """A named profile: credentials in the credentials file, the endpoint in the config file."""
    url, expected = s3_checkpoint
    opts = s3_server.storage_options
    credentials, config = tmp_path / "credentials", tmp_path / "config"
    credentials.write_text(f"[dmuon-test]\naws_access_key_id = {opts['key']}\n"
                           f"aws_secret_access_key = {opts['secret']}\n")
    config.write_text(f"[profile dmuon-test]\nendpoint_url = {opts['endpoint_url']}\nregion = us-east-1\n")
    env = clean_env(tmp_path, AWS_SHARED_CREDENTIALS_FILE=str(credentials), AWS_CONFIG_FILE=str(config),
                    AWS_PROFILE="dmuon-test")
    check_reads(url, expected, tmp_path, env)


def test_s3_commands_fail_clearly_without_credentials(s3_server, s3_checkpoint, tmp_path):
    """The endpoint from the environment but no credentials anywhere: exit status 1 with an
    error line, no traceback."""
    url, _ = s3_checkpoint
    env = clean_env(tmp_path, AWS_ENDPOINT_URL=s3_server.storage_options["endpoint_url"])
    res = subprocess.run([str(BIN / "dmuon-ckpt"), "inspect", url], capture_output=True, text=True,
                         timeout=120, env=env)
    assert res.returncode == 1 and "Traceback" not in res.stderr, res.stderr
    assert res.stderr.startswith(f"error: {url}: ") and "NoCredentialsError: " in res.stderr, res.stderr
    assert "--storage-option" in res.stderr


# ---------------------------------------------------------------------------------------------
# GCS
# ---------------------------------------------------------------------------------------------
def test_gcs_commands_with_storage_options(gcs_server, gcs_checkpoint, tmp_path):
    url, expected = gcs_checkpoint
    check_commands(url, expected, tmp_path, clean_env(tmp_path), option_flags(gcs_server.storage_options))


def test_gcs_commands_with_emulator_environment_variable(gcs_server, gcs_checkpoint, tmp_path):
    url, expected = gcs_checkpoint
    env = clean_env(tmp_path, STORAGE_EMULATOR_HOST=gcs_server.storage_options["endpoint_url"])
    check_reads(url, expected, tmp_path, env)


class TokenEndpoint:
    """A local OAuth2 token endpoint: answers every POST with a bearer token and counts them.

    A service-account key names its ``token_uri``; pointing it here lets google-auth sign in
    with ``GOOGLE_APPLICATION_CREDENTIALS`` exactly as against Google, without the network.
    """

    def __init__(self) -> None:
        endpoint = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                endpoint.requests += 1
                body = json.dumps({"access_token": "dmuon-test-token", "expires_in": 3600,
                                   "token_type": "Bearer"}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.requests = 0
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/token"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(10)


@pytest.fixture
def token_endpoint():
    endpoint = TokenEndpoint()
    yield endpoint
    endpoint.stop()


def service_account_file(path: Path, token_uri: str) -> Path:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa

    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption()).decode()
    path.write_text(json.dumps({
        "type": "service_account", "project_id": "dmuon", "private_key_id": "dmuon-test-key",
        "private_key": pem, "client_email": "dmuon-test@dmuon.iam.gserviceaccount.com",
        "client_id": "1", "token_uri": token_uri,
    }))
    return path


def test_gcs_commands_with_google_application_credentials(gcs_server, gcs_checkpoint, token_endpoint, tmp_path):
    """gcsfs signs in with the key file the variable names (the emulator takes any token)."""
    url, expected = gcs_checkpoint
    key_file = service_account_file(tmp_path / "service-account.json", token_endpoint.url)
    env = clean_env(tmp_path, GOOGLE_APPLICATION_CREDENTIALS=str(key_file),
                    STORAGE_EMULATOR_HOST=gcs_server.storage_options["endpoint_url"])
    res = dmuon_ckpt("verify", url, env=env)
    assert res.stdout.startswith(f"OK {url}:")
    assert token_endpoint.requests >= 1  # the key file was used, not anonymous access
    dmuon_ckpt("export", url, str(tmp_path / "hf"), env=env)
    assert_bit_identical(load_file(tmp_path / "hf" / "model.safetensors"), expected)


# ---------------------------------------------------------------------------------------------
# whose options reach the output
# ---------------------------------------------------------------------------------------------
def test_resolve_output_options():
    src = {"key": "k", "secret": "s"}
    out = {"token": "anon"}
    assert resolve_output_options("s3://b/ckpt", "./out", src, None) is None
    assert resolve_output_options("s3://b/ckpt", "/tmp/out.pt", src, None) is None
    assert resolve_output_options("s3://b/ckpt", "file:///tmp/out", src, None) is None
    assert resolve_output_options("s3://b/ckpt", "gs://b/out", src, None) is None
    assert resolve_output_options("gs://b/ckpt", "s3://b/out", src, None) is None
    assert resolve_output_options("ckpt", "s3://b/out", {"direct_io": False}, None) is None
    assert resolve_output_options("s3://b/ckpt", "s3://b/out", src, None) is src  # same kind: reused
    assert resolve_output_options("s3a://b/ckpt", "s3://b/out", src, None) is src
    assert resolve_output_options("gcs://b/ckpt", "gs://b/out", src, None) is src
    assert resolve_output_options("ckpt", "out", {"direct_io": False}, None) == {"direct_io": False}
    assert resolve_output_options("s3://b/ckpt", "gs://b/out", src, out) is out  # given: always used
    assert resolve_output_options("s3://b/ckpt", "s3://b/out", src, {}) == {}


def test_python_export_from_s3_to_local_with_source_options_only(s3_server, s3_checkpoint, tmp_path):
    url, expected = s3_checkpoint
    opts = s3_server.storage_options
    files = ddcp.export(url, tmp_path / "hf", storage_options=opts)
    assert_bit_identical(load_file(files[0]), expected)
    files = ddcp.export(url, tmp_path / "flat.pt", format="torch", storage_options=opts)
    assert_bit_identical(torch.load(files[0], weights_only=True), expected)


def test_export_output_options_stay_with_their_store(s3_server, gcs_server, s3_checkpoint, tmp_path):
    """S3 -> GCS with the output's own options, S3 -> GCS with the output's credentials in the
    environment only (the S3 options must not reach gcsfs), S3 -> S3 reusing the source's."""
    import fsspec
    from safetensors.torch import load as load_bytes

    url, expected = s3_checkpoint
    s3_flags = option_flags(s3_server.storage_options)

    def read_back(out_url, storage_options):
        with fsspec.open(f"{out_url}/model.safetensors", "rb", **storage_options) as f:
            return load_bytes(f.read())

    gs_out = run_url(gcs_server, "hf")
    dmuon_ckpt("export", url, gs_out, *s3_flags,
               *option_flags(gcs_server.storage_options, "--output-storage-option"), env=clean_env(tmp_path))
    assert_bit_identical(read_back(gs_out, gcs_server.storage_options), expected)

    gs_out = run_url(gcs_server, "hf")
    env = clean_env(tmp_path, STORAGE_EMULATOR_HOST=gcs_server.storage_options["endpoint_url"])
    dmuon_ckpt("export", url, gs_out, *s3_flags, env=env)
    assert_bit_identical(read_back(gs_out, gcs_server.storage_options), expected)

    s3_out = url.rsplit("/", 1)[0] + "/hf"
    dmuon_ckpt("export", url, s3_out, *s3_flags, env=clean_env(tmp_path))
    assert_bit_identical(read_back(s3_out, s3_server.storage_options), expected)


def test_output_storage_option_for_a_local_path_is_refused(s3_server, s3_checkpoint, tmp_path):
    url, _ = s3_checkpoint
    res = subprocess.run(
        [str(BIN / "dmuon-ckpt"), "export", url, str(tmp_path / "hf"), *option_flags(s3_server.storage_options),
         "--output-storage-option", "key=x"],
        capture_output=True, text=True, timeout=120, env=clean_env(tmp_path),
    )
    assert res.returncode == 1 and "do not apply to the local path" in res.stderr
    assert not (tmp_path / "hf").exists()


# ---------------------------------------------------------------------------------------------
# save and load in a training job, credentials from the environment only
# ---------------------------------------------------------------------------------------------
def save_and_load_worker(rank, world, url):
    model, opt = build()
    train(model, opt, rank, world, range(1))
    ddcp.save(model, opt, url, extra={"step": 1})  # no storage_options
    saved = dmuon.get_model_state_dict(model)
    fresh, fresh_opt = build()
    extra = ddcp.load(fresh, fresh_opt, url)
    return {"saved": saved, "loaded": dmuon.get_model_state_dict(fresh), "extra": extra}


@pytest.mark.parametrize("backend", ["s3", "gcs"])
def test_save_and_load_with_credentials_from_environment(request, backend, tmp_path):
    server = request.getfixturevalue(f"{backend}_server")
    if backend == "s3":
        settings = aws_variables(server)
    else:
        settings = {"STORAGE_EMULATOR_HOST": server.storage_options["endpoint_url"]}
    url = run_url(server)
    result = run_ranks(save_and_load_worker, 2, url, env=clean_env(tmp_path, **settings))[0]
    assert result["extra"] == {"step": 1}
    assert_bit_identical(result["loaded"], result["saved"])


# ---------------------------------------------------------------------------------------------
# S3 retry settings the user made are kept
# ---------------------------------------------------------------------------------------------
def test_s3_retry_settings_from_environment_and_config_file_are_kept(monkeypatch, tmp_path):
    for var in ("AWS_RETRY_MODE", "AWS_MAX_ATTEMPTS", "AWS_PROFILE", "AWS_DEFAULT_PROFILE"):
        monkeypatch.delenv(var, raising=False)
    config = tmp_path / "config"
    config.write_text("[default]\nregion = us-east-1\n[profile slow]\nretry_mode = adaptive\nmax_attempts = 9\n")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(config))

    def retries(options):
        return _bounded_s3_retries("s3://b/ckpt", options).get("config_kwargs", {}).get("retries")

    assert retries({}) == S3_REQUEST_RETRIES  # nothing configured: dmuon's bounded policy
    assert retries({"profile": "slow"}) is None  # both set in the profile: botocore reads them
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "7")
    assert retries({}) == {"mode": "standard"}  # botocore adds the 7 itself
    # ...as the client dmuon's store builds shows (building it contacts no server)
    from dmuon.dcp.storage.fsspec_store import FsspecStore

    options = {"endpoint_url": "http://127.0.0.1:9", "key": "k", "secret": "s", "skip_instance_cache": True}
    fs = FsspecStore("s3://b/ckpt", options).fs
    fs.connect()
    assert fs.s3.meta.config.retries == {"mode": "standard", "total_max_attempts": 7}
    monkeypatch.setenv("AWS_RETRY_MODE", "legacy")
    assert retries({}) is None
    assert retries({"config_kwargs": {"retries": {"mode": "adaptive"}}}) == {"mode": "adaptive"}
    assert _bounded_s3_retries("gs://b/ckpt", {}) == {}


# ---------------------------------------------------------------------------------------------
# docs/export.md
# ---------------------------------------------------------------------------------------------
def doc_commands() -> dict[str, str]:
    """The ``<!-- command: name -->`` shell blocks of docs/export.md, by name."""
    return dict(re.findall(r"<!-- command: ([\w-]+) -->\n```sh\n(.*?)```", DOC.read_text(), re.S))


def run_doc_command(name: str, replacements: dict, env: dict, cwd: Path) -> None:
    script = doc_commands()[name]
    for placeholder, value in replacements.items():
        assert placeholder in script, (name, placeholder)
        script = script.replace(placeholder, value)
    res = subprocess.run(["bash", "-euo", "pipefail", "-c", script], capture_output=True, text=True,
                         timeout=120, env=env, cwd=cwd)
    assert res.returncode == 0, f"{name}:\n{script}\n--- stdout\n{res.stdout}\n--- stderr\n{res.stderr}"


def test_doc_commands_run_as_written(s3_server, gcs_server, s3_checkpoint, gcs_checkpoint, token_endpoint,
                                     tmp_path):
    # hf-export (the HuggingFace recipe) runs in tests/dcp/test_export_hf.py
    assert set(doc_commands()) == {"s3-export-options", "s3-export-environment", "gcs-export-environment", "hf-export"}
    s3_url, expected = s3_checkpoint
    opts = s3_server.storage_options
    s3 = {"s3://my-bucket/run-7/step-1000": s3_url, "http://127.0.0.1:8333": opts["endpoint_url"],
          "MY_ACCESS_KEY": opts["key"], "MY_SECRET_KEY": opts["secret"]}
    run_doc_command("s3-export-options", s3, clean_env(tmp_path), tmp_path)
    assert_bit_identical(load_file(tmp_path / "hf-out" / "model.safetensors"), expected)

    run_doc_command("s3-export-environment", s3, clean_env(tmp_path), tmp_path)
    assert_bit_identical(torch.load(tmp_path / "model.pt", weights_only=True), expected)

    gcs_url, gcs_expected = gcs_checkpoint
    gcs_dir = tmp_path / "gcs"
    gcs_dir.mkdir()
    key_file = service_account_file(tmp_path / "service-account.json", token_endpoint.url)
    env = clean_env(tmp_path, STORAGE_EMULATOR_HOST=gcs_server.storage_options["endpoint_url"])
    run_doc_command("gcs-export-environment", {"gs://my-bucket/run-7/step-1000": gcs_url,
                                               "/path/to/service-account.json": str(key_file)}, env, gcs_dir)
    assert token_endpoint.requests >= 1
    assert_bit_identical(load_file(gcs_dir / "hf-out" / "model.safetensors"), gcs_expected)
