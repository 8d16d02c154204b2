import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Forkserver children import test modules by name: make the repository importable everywhere.
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import pytest  # noqa: E402


def pytest_configure(config):
    # Most tests export toy models, not HuggingFace ones: the note that from_pretrained needs a
    # config.json is for users (tests/dcp/test_export_hf.py checks it with pytest.warns).
    config.addinivalue_line("filterwarnings", "ignore::dmuon.dcp.hf_config.MissingConfigWarning")


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """A real S3 server (SeaweedFS) on 127.0.0.1, for the whole session."""
    from tests.helpers.object_storage import SeaweedS3

    server = SeaweedS3(tmp_path_factory.mktemp("seaweedfs"))
    yield server
    server.stop()


@pytest.fixture(scope="session")
def rgw_server(tmp_path_factory):
    """Ceph RADOS Gateway (one monitor, one memstore OSD) on 127.0.0.1, for the whole session."""
    import shutil

    from tests.helpers.object_storage import CephRGW

    if not all(shutil.which(daemon) for daemon in ("radosgw", "ceph-mon", "ceph-osd")):
        reason = "Ceph RGW not installed (scripts/install-ceph.sh needs root or passwordless sudo)"
        if os.environ.get("DMUON_REQUIRE_ALL_STORES") == "1":
            pytest.fail(reason + "; DMUON_REQUIRE_ALL_STORES=1 requires every store")
        pytest.skip(reason)

    server = CephRGW(tmp_path_factory.mktemp("ceph-rgw"))
    yield server
    server.stop()


@pytest.fixture(scope="session")
def gcs_server(tmp_path_factory):
    """A GCS emulator (fake-gcs-server) on 127.0.0.1, for the whole session."""
    from tests.helpers.object_storage import FakeGCS

    server = FakeGCS(tmp_path_factory.mktemp("fake-gcs"))
    yield server
    server.stop()


@pytest.fixture
def checkpoint_location(request, tmp_path):
    """``locate(backend)`` -> (checkpoint root, storage_options) on that backend.

    Backends: "local" (a temporary directory), "s3" (SeaweedFS), "rgw" (Ceph RADOS Gateway,
    also S3), "gcs" (fake-gcs-server).
    """
    def locate(backend: str, name: str = "run"):
        if backend == "local":
            return str(tmp_path / name), None
        server = request.getfixturevalue(f"{backend}_server")
        return server.url(), server.storage_options

    return locate


@pytest.fixture(params=["local", "s3", "gcs"])
def any_storage(request, tmp_path):
    """(checkpoint url factory, storage_options) on each backend."""
    if request.param == "local":
        return (lambda name="ckpt": str(tmp_path / name)), None
    server = request.getfixturevalue(f"{request.param}_server")
    return server.url, server.storage_options


@pytest.fixture(scope="session")
def reliability_report():
    """Scenario counts from the fault-injection tests; written to reliability-report.json."""
    import json

    report: dict = {}
    yield report
    if report:
        path = ROOT / ".pytest_cache" / "reliability-report.json"
        path.parent.mkdir(exist_ok=True)
        existing = json.loads(path.read_text()) if path.exists() else {}
        existing.update(report)
        path.write_text(json.dumps(existing, indent=1, sort_keys=True))
        for name, counts in sorted(report.items()):
            print(f"\nreliability {name}: {counts}")
