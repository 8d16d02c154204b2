"""Round trips through real local S3 (SeaweedFS, Ceph RGW) and GCS (fake-gcs-server) servers over HTTP."""
import fsspec
import pytest

from tests.dcp.test_topology import assert_same_state, load_worker, save_worker
from tests.helpers.launch import run_ranks


@pytest.mark.parametrize("backend", ["s3", "rgw", "gcs"])
@pytest.mark.parametrize("world", [2, 4])
def test_round_trip_on_object_storage(request, backend, world):
    server = request.getfixturevalue(f"{backend}_server")
    url = server.url()
    saved = run_ranks(save_worker, world, 1, url, server.storage_options)[0]
    fs, root = fsspec.core.url_to_fs(url, **server.storage_options)
    names = sorted(p.rsplit("/", 1)[-1] for p in fs.ls(root, detail=False))
    assert ".metadata" in names and sum(n.endswith(".distcp") for n in names) == world
    assert any(n.startswith(".dmuon-manifest-") for n in names)
    loaded = run_ranks(load_worker, world, 1, url, server.storage_options)[0]
    assert loaded["extra"] == {"step": 3}
    assert_same_state(loaded, saved)
