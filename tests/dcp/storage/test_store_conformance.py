"""One suite every Store backend passes: local disk, fsspec ``memory://``, S3 (SeaweedFS and
Ceph RGW) and GCS (fake-gcs-server), each through ``open_store`` as a checkpoint would use it.

What a checkpoint relies on, case by case: a streamed file appears whole with its size or not
at all; an exclusive put has one winner (the commit), also among writers racing for it;
listing shows files and child directories, and a directory never made lists empty; ranged
reads return the bytes asked for, by ``read`` and by ``readinto`` (the verified reader's way);
a missing file is ``FileNotFoundError`` (and deleting one is no error); names that leave the
store are refused; ``remove_tree`` removes a child and nothing else; a transient failure is
retried as the store's policy says (a write that lost its upload session too), and a
permanent one, or a full disk, never is.
"""
from __future__ import annotations

import contextlib
import errno
import os
import threading
import time
import uuid

import pytest

from dmuon.dcp.errors import StorageError, UnsafeCheckpointError
from dmuon.dcp.storage.registry import open_store
from dmuon.dcp.storage.retry import retrying

BACKENDS = ["local", "memory", "s3", "rgw", "gcs"]
DATA = os.urandom(3 * 1024 * 1024 + 17)  # several upload parts' worth, and an odd tail


@pytest.fixture(params=BACKENDS)
def store(request, tmp_path):
    if request.param == "local":
        url, options = str(tmp_path / "root"), None
    elif request.param == "memory":
        url, options = f"memory://dmuon-conformance/{uuid.uuid4().hex[:12]}", None
    else:
        server = request.getfixturevalue(f"{request.param}_server")
        url, options = server.url(), server.storage_options
    store = open_store(url, options)
    store.makedirs()
    yield store
    with contextlib.suppress(OSError):
        store.remove_tree()


def test_a_streamed_file_appears_whole_with_its_size(store):
    assert store.list() == {}  # (an object store has no empty directories: is_dir may be False)
    with store.open_write("data") as f:
        for start in range(0, len(DATA), 1 << 20):
            f.write(DATA[start : start + (1 << 20)])
    assert store.list() == {"data": len(DATA)}
    assert store.is_dir()
    assert store.read("data") == DATA


def test_ranged_reads_return_the_bytes_asked_for(store):
    with store.open_write("data") as f:
        f.write(DATA)
    with store.open_read("data") as f:
        for offset, length in [(0, 10), (len(DATA) - 5, 5), (1 << 20, 4097), (17, 0)]:
            f.seek(offset)
            assert f.read(length) == DATA[offset : offset + length], (offset, length)
        f.seek(len(DATA) - 3)
        assert f.read(100) == DATA[-3:]  # a read past the end is short, not an error


def test_a_read_told_the_files_size_reads_the_same(store):
    """A reader that knows the file's size (a checkpoint's manifest) says so, and an object
    store need not ask for it: every store takes ``size`` and reads as without it."""
    with store.open_write("data") as f:
        f.write(DATA)
    with store.open_read("data", size=len(DATA)) as f:
        f.seek(len(DATA) - 4097)
        assert f.read(4097) == DATA[-4097:]
        f.seek(5)
        assert f.read(10) == DATA[5:15]


def test_readinto_fills_a_buffer_from_an_offset(store):
    with store.open_write("data") as f:
        f.write(DATA)
    with store.open_read("data") as f:
        for offset, length in [(3, 4096), ((1 << 20) - 1, (1 << 20) + 2), (len(DATA) - 7, 7)]:
            buffer = bytearray(length)
            f.seek(offset)
            got = 0
            while got < length:
                n = f.readinto(memoryview(buffer)[got:])
                assert n, (offset, length, got)
                got += n
            assert bytes(buffer) == DATA[offset : offset + length], (offset, length)


def test_a_write_that_fails_leaves_no_file(store):
    with pytest.raises(RuntimeError, match="midway"):
        with store.open_write("half") as f:
            f.write(DATA[:1000])
            raise RuntimeError("failed midway")
    assert "half" not in store.list()


def test_an_exclusive_put_has_one_winner(store):
    store.put("commit", b"first", exclusive=True)
    with pytest.raises(FileExistsError):
        store.put("commit", b"second", exclusive=True)
    assert store.read("commit") == b"first"
    store.put("commit", b"replaced")  # not exclusive: replaces, atomically
    assert store.read("commit") == b"replaced"
    assert store.list() == {"commit": len(b"replaced")}


def test_racing_exclusive_puts_have_one_winner(store):
    outcomes: dict[int, str] = {}
    start = threading.Barrier(4)

    def commit(writer: int) -> None:
        start.wait()
        try:
            store.put("race", f"writer {writer}".encode(), exclusive=True)
            outcomes[writer] = "won"
        except FileExistsError:
            outcomes[writer] = "lost"

    threads = [threading.Thread(target=commit, args=(writer,)) for writer in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    [winner] = [writer for writer, outcome in outcomes.items() if outcome == "won"]
    assert sorted(outcomes.values()) == ["lost"] * 3 + ["won"]
    assert store.read("race") == f"writer {winner}".encode()


def test_a_missing_file_is_file_not_found(store):
    with pytest.raises(FileNotFoundError):
        store.read("absent")
    with pytest.raises(FileNotFoundError):
        with store.open_read("absent") as f:
            f.read(1)
    store.delete("absent")  # deleting what is not there is no error


def test_a_directory_never_made_lists_empty(store):
    never = store.child("never-made")
    assert never.list() == {} and never.list_dirs() == []
    assert not never.is_dir()
    assert "never-made" not in store.list_dirs()


def test_children_are_listed_and_removed_alone(store):
    store.put("keep", b"parent's file")
    for name in ("step-1", "step-2"):
        child = store.child(name)
        child.makedirs()
        child.put(".metadata", name.encode())
    assert sorted(store.list_dirs()) == ["step-1", "step-2"]
    assert store.child("step-2").list() == {".metadata": len(b"step-2")}
    store.child("step-1").remove_tree()
    assert store.list_dirs() == ["step-2"]
    assert store.read("keep") == b"parent's file"
    assert store.child("step-2").read(".metadata") == b"step-2"


def test_delete_removes_one_file(store):
    store.put("a", b"1")
    store.put("b", b"2")
    store.delete("a")
    assert store.list() == {"b": 1}


def test_modified_is_the_time_of_the_write(store):
    store.put("stamped", b"x")
    assert abs(store.modified("stamped") - time.time()) < 120


@pytest.mark.parametrize("name", ["../outside", "a/b", "/etc/passwd", "..", ""])
def test_names_that_leave_the_store_are_refused(store, name):
    for operation in (
        lambda: store.put(name, b"x"),
        lambda: store.read(name),
        lambda: store.open_write(name).__enter__(),
        lambda: store.child(name),
    ):
        with pytest.raises(UnsafeCheckpointError, match="leaves the checkpoint directory"):
            operation()


def test_a_transient_failure_is_retried_as_the_store_says_and_a_permanent_one_never(store):
    calls = []

    def flaky():
        calls.append(1)
        if len(calls) == 1:
            raise OSError("the connection was reset mid-body")
        return "done"

    if store.retry.attempts > 1:
        assert retrying(store, "a flaky read", flaky) == "done" and len(calls) == 2
    else:  # local disks: one attempt, the error named with what was being done
        with pytest.raises(StorageError, match="a flaky read failed"):
            retrying(store, "a flaky read", flaky)
        assert len(calls) == 1

    permanent = []

    def missing():
        permanent.append(1)
        raise FileNotFoundError("gone")

    with pytest.raises(FileNotFoundError):
        retrying(store, "a read of a missing file", missing)
    assert len(permanent) == 1


def test_a_write_is_retried_after_a_lost_upload_but_never_when_the_disk_is_full(store):
    lost = []

    def upload():
        lost.append(1)
        if len(lost) == 1:
            raise FileNotFoundError("upload session not found")  # GCS forgets a resumable upload
        return "written"

    if store.retry.attempts > 1:
        assert retrying(store, "writing a file", upload, writing=True) == "written" and len(lost) == 2
    else:  # one attempt, and then not a missing file but a failed write, said so
        with pytest.raises(StorageError, match="writing a file failed"):
            retrying(store, "writing a file", upload, writing=True)

    full = []

    def no_room():
        full.append(1)
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(StorageError, match="No space left"):
        retrying(store, "writing a file", no_room, writing=True)
    assert len(full) == 1
