"""Storage failures reach the caller as dmuon's ``StorageError``, naming the URL, the client's
exception as its cause, whichever door the call went through; and opening a store changes
nothing in the process (no environment variable written)."""
import os
import time

import pytest

import dmuon.dcp as ddcp
from dmuon.dcp.errors import StorageError
from dmuon.dcp.storage.fsspec_store import GCSFS_GRPC_VARIABLE, FsspecStore
from dmuon.dcp.storage.retry import RetryPolicy, retrying
from tests.helpers.launch import run_ranks
from tests.helpers.training import build

UNREACHABLE = {"endpoint_url": "http://127.0.0.1:9", "key": "AKIAEXAMPLE", "secret": "not-a-real-secret"}


class ClientOwnError(Exception):
    """What a storage client raises of its own (botocore's errors are not OSErrors)."""


def failing_store(exc: BaseException, monkeypatch) -> FsspecStore:
    """A store whose client fails with ``exc``. fsspec shares one memory filesystem per
    process: the failing methods are undone after the test (``monkeypatch``), or every later
    test of the memory store would fail too."""
    store = FsspecStore("memory://dmuon-storage-errors/ckpt")

    def fail(*args, **kwargs):
        raise exc

    monkeypatch.setattr(store.fs, "ls", fail)
    monkeypatch.setattr(store.fs, "cat_file", fail)
    return store


def test_a_client_error_becomes_a_storage_error_naming_the_url(monkeypatch):
    store = failing_store(ClientOwnError("the server said no"), monkeypatch)
    with pytest.raises(StorageError, match=r"memory://dmuon-storage-errors/ckpt: listing failed: "
                                           r"ClientOwnError: the server said no") as info:
        store.list()
    assert isinstance(info.value.__cause__, ClientOwnError)
    with pytest.raises(StorageError, match=r"ckpt/.metadata: reading failed") as info:
        store.read(".metadata")


@pytest.mark.parametrize("exc", [FileNotFoundError("gone"), PermissionError("denied"), OSError(28, "full")])
def test_the_os_errors_the_store_protocol_gives_meaning_to_pass_as_they_are(exc, monkeypatch):
    with pytest.raises(type(exc)) as info:
        failing_store(exc, monkeypatch).read("x")
    assert type(info.value) is type(exc)


def test_a_retried_client_error_says_how_often_it_was_tried(monkeypatch):
    store = failing_store(ClientOwnError("flaky"), monkeypatch)
    store.retry = RetryPolicy(attempts=2, backoff_s=0.0)
    expected = r"reading x failed after 2 attempt\(s\) in 0 s: ClientOwnError: flaky"
    with pytest.raises(StorageError, match=expected) as info:
        retrying(store, "reading x", lambda: store.read("x"))
    assert isinstance(info.value.__cause__, ClientOwnError)


def test_opening_a_gcs_store_writes_no_environment_variable(monkeypatch):
    gcsfs_core = pytest.importorskip("gcsfs.core")
    monkeypatch.delenv(GCSFS_GRPC_VARIABLE, raising=False)
    before = dict(os.environ)
    store = FsspecStore("gs://bucket/ckpt", {"token": "anon", "endpoint_url": "http://127.0.0.1:9", "project": "p"})
    assert dict(os.environ) == before
    assert type(store.fs) is gcsfs_core.GCSFileSystem  # the plain client: no gRPC probe
    assert store.root == "bucket/ckpt"


def load_unreachable_worker(rank, world):
    model, opt = build()
    started = time.monotonic()
    with pytest.raises(StorageError) as info:
        ddcp.load(model, opt, "s3://bucket/ckpt", storage_options=UNREACHABLE)
    return str(info.value), type(info.value.__cause__).__name__, time.monotonic() - started


def test_load_from_an_unreachable_endpoint_raises_a_storage_error_naming_the_url():
    pytest.importorskip("s3fs")
    message, cause, seconds = run_ranks(load_unreachable_worker, 1)[0]
    assert message.startswith("s3://bucket/ckpt: ") and "127.0.0.1:9" in message, message
    assert cause == "EndpointConnectionError"
    assert UNREACHABLE["secret"] not in message
    print(f"load from an unreachable endpoint failed after {seconds:.1f} s")
