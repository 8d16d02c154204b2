"""Local directories: direct I/O for streamed files, where it is used and what it writes."""
import errno
import os
import subprocess
import sys
import textwrap

import pytest

from dmuon.dcp.local_store import (
    DIRECT_IO_ALIGN,
    DIRECT_IO_FILESYSTEMS,
    STAGING_BYTES,
    DirectFile,
    LocalStore,
    filesystem_type,
)
from dmuon.dcp.store import LOCAL_DIRECT_IO_OPTION, open_store

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def _direct_file_or_skip(path) -> DirectFile:
    try:
        return DirectFile(str(path))
    except OSError as error:
        if error.errno == errno.EINVAL:
            pytest.skip(f"{filesystem_type(str(path))} at {path} refuses O_DIRECT")
        raise


# Writes that cross every edge: inside one alignment unit, exactly on it, across a staging
# buffer, many buffers at once; flushes in between (the tail is written, then rewritten).
PIECES = [1, DIRECT_IO_ALIGN - 1, DIRECT_IO_ALIGN, 7, STAGING_BYTES - 3, 5, 2 * STAGING_BYTES + 11, 0, 100]


@pytest.mark.parametrize("flush_after", [(), (0, 3, 5), tuple(range(len(PIECES)))], ids=["end", "some", "each"])
def test_direct_file_writes_every_byte_in_order(tmp_path, flush_after):
    data = os.urandom(sum(PIECES))
    f = _direct_file_or_skip(tmp_path / "f")
    offset = 0
    try:
        for i, n in enumerate(PIECES):
            assert f.write(memoryview(data)[offset : offset + n]) == n
            offset += n
            if i in flush_after:
                f.flush()
                assert os.path.getsize(tmp_path / "f") == offset
                assert (tmp_path / "f").read_bytes() == data[:offset]
        f.flush()
        os.fsync(f.fileno())
    finally:
        f.close()
    assert (tmp_path / "f").read_bytes() == data


@pytest.mark.parametrize("size", [0, 1, DIRECT_IO_ALIGN, STAGING_BYTES, STAGING_BYTES + 1])
def test_direct_file_sizes_at_the_edges(tmp_path, size):
    data = os.urandom(size)
    f = _direct_file_or_skip(tmp_path / "f")
    try:
        f.write(data)
        f.flush()
    finally:
        f.close()
    assert (tmp_path / "f").read_bytes() == data


def test_store_writes_streamed_files_direct_where_the_filesystem_allows(tmp_path):
    kind = filesystem_type(str(tmp_path))
    store = LocalStore(str(tmp_path / "ckpt"))
    store.makedirs()
    data = os.urandom(STAGING_BYTES + 999)
    with store.open_write("data") as f:
        assert isinstance(f, DirectFile) == (kind in DIRECT_IO_FILESYSTEMS), kind
        f.write(data)
    store.put("small", b"manifest")  # small files: always through the page cache
    assert store.read("data") == data and store.read("small") == b"manifest"
    assert sorted(store.list()) == ["data", "small"]


def test_tmpfs_is_written_through_the_page_cache():
    if not os.path.isdir("/dev/shm") or filesystem_type("/dev/shm") != "tmpfs":
        pytest.skip("no tmpfs at /dev/shm")
    store = LocalStore(f"/dev/shm/dmuon-test-{os.getpid()}")
    store.makedirs()
    try:
        with store.open_write("data") as f:
            assert not isinstance(f, DirectFile)
            f.write(b"x" * 10)
        assert store.read("data") == b"x" * 10
    finally:
        store.remove_tree()


def test_direct_io_is_a_storage_option_of_local_paths(tmp_path):
    store = open_store(str(tmp_path), {LOCAL_DIRECT_IO_OPTION: False})
    store.makedirs()
    with store.open_write("data") as f:
        assert not isinstance(f, DirectFile)
    assert store.child("sub").direct_io is False
    with pytest.raises(ValueError, match="'anon'.*local path"):
        open_store(str(tmp_path), {"anon": True})
    with pytest.raises(ValueError, match="direct_io='yes'"):
        open_store(str(tmp_path), {LOCAL_DIRECT_IO_OPTION: "yes"})


def test_filesystem_type_names_the_deepest_mount():
    assert filesystem_type("/proc/self/status") == "proc"
    assert filesystem_type("/") != ""
    if os.path.isdir("/dev/shm"):
        assert filesystem_type("/dev/shm/not-there-yet/x") == filesystem_type("/dev/shm")


# A failure in the background thread (here the kernel's file-size limit, EFBIG) comes out of
# the with block, naming the file, and leaves no partial file behind.
_FILE_TOO_BIG = textwrap.dedent("""
    import errno, os, resource, signal, sys
    sys.path.insert(0, {repo!r})
    from dmuon.dcp.local_store import LocalStore, STAGING_BYTES
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (3 * STAGING_BYTES, 3 * STAGING_BYTES))
    store = LocalStore({root!r}, direct_io=True)
    store.makedirs()
    try:
        with store.open_write("big") as f:
            for _ in range(8):
                f.write(bytes(STAGING_BYTES))
    except OSError as error:
        assert error.errno == errno.EFBIG, error
        assert "big" in str(error), error
        assert store.list() == {{}}, store.list()
        print("raised")
""")


def test_a_failed_background_write_is_raised_and_the_file_removed(tmp_path):
    if filesystem_type(str(tmp_path)) not in DIRECT_IO_FILESYSTEMS:
        pytest.skip("no direct I/O here")
    code = _FILE_TOO_BIG.format(repo=REPO, root=str(tmp_path / "ckpt"))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "raised", done.stdout + done.stderr
