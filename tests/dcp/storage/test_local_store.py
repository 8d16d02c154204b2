"""Local directories: direct I/O for streamed files, where it is used and what it writes."""
import errno
import logging
import os
import subprocess
import sys
import textwrap

import numpy
import pytest

from dmuon.dcp.storage import write_path
from dmuon.dcp.storage.direct_io import BORROW_MIN_BYTES, DIRECT_IO_ALIGN, MAX_BORROWED_BYTES, STAGING_BYTES, DirectFile
from dmuon.dcp.storage.local import DIRECT_IO_FILESYSTEMS, LOCAL_DIRECT_IO_OPTION, LocalStore, filesystem_type
from dmuon.dcp.storage.registry import open_store

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))


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


def _buffer_at(position: int, size: int, lined_up: bool) -> memoryview:
    """``size`` random bytes whose address is congruent to ``position`` modulo the direct-I/O
    alignment (or deliberately not)."""
    backing = numpy.frombuffer(os.urandom(size + 2 * DIRECT_IO_ALIGN), dtype=numpy.uint8).copy()
    start = (position - backing.ctypes.data) % DIRECT_IO_ALIGN
    if not lined_up:
        start += 64  # still 64-byte aligned, as tensors are, but off by 64 from the file
    return memoryview(backing[start : start + size])


# (bytes written with write() first, then a borrowed write of this size, lined up or not)
BORROWED = [
    (0, 2 * BORROW_MIN_BYTES, True),
    (1, BORROW_MIN_BYTES + 3 * DIRECT_IO_ALIGN + 5, True),
    (DIRECT_IO_ALIGN - 1, STAGING_BYTES + 7, True),
    (STAGING_BYTES - 100, 2 * STAGING_BYTES, True),
    (5, 2 * BORROW_MIN_BYTES, False),
    (5, BORROW_MIN_BYTES // 2, True),
    (100, BORROW_MIN_BYTES, True),  # padded by the writer: in place, though its aligned middle is smaller
]


@pytest.mark.parametrize("flush_between", [False, True], ids=["no-flush", "flush"])
def test_borrowed_writes_go_out_in_place_where_lined_up_and_land_byte_exact(tmp_path, flush_between):
    f = _direct_file_or_skip(tmp_path / "f")
    expected, in_place, lent = bytearray(), 0, []
    try:
        for before, size, lined_up in BORROWED:
            copied = os.urandom(before)
            f.write(copied)
            expected += copied
            borrowed = _buffer_at(len(expected), size, lined_up)
            lent.append(borrowed)  # must stay unchanged until the flush
            assert f.write_borrowed(borrowed) == size
            if lined_up and size >= BORROW_MIN_BYTES:
                to_boundary = -len(expected) % DIRECT_IO_ALIGN
                in_place += (size - to_boundary) // DIRECT_IO_ALIGN * DIRECT_IO_ALIGN
            expected += borrowed
            if flush_between:
                f.flush()
                assert (tmp_path / "f").read_bytes() == expected
        f.flush()
        os.fsync(f.fileno())
        assert f.in_place_bytes == in_place > 0
    finally:
        f.close()
    assert (tmp_path / "f").read_bytes() == expected


def test_many_lined_up_tensors_between_headers_land_byte_exact(tmp_path):
    """A data file's shape: small staged pieces between large borrowed ones, gathered into
    requests of several tensors each, the staging buffer filling up among them."""
    import random

    rng = random.Random(0)
    f = _direct_file_or_skip(tmp_path / "f")
    expected, lent = bytearray(), []
    try:
        for k in range(40):
            header = os.urandom(rng.choice([30, 700, 5000, STAGING_BYTES // 3]))
            f.write(header)
            expected += header
            borrowed = _buffer_at(len(expected), rng.choice([BORROW_MIN_BYTES, 3 * BORROW_MIN_BYTES + 77]), True)
            lent.append(borrowed)
            f.write_borrowed(borrowed)
            expected += borrowed
            if k == 25:
                f.flush()
        f.flush()
        assert f.in_place_bytes > len(expected) // 2
    finally:
        f.close()
    assert (tmp_path / "f").read_bytes() == expected


def test_borrowed_memory_in_flight_is_bounded(tmp_path):
    """A caller's buffers are released as the device catches up, not all kept to the end."""
    f = _direct_file_or_skip(tmp_path / "f")
    piece = 4 * BORROW_MIN_BYTES
    expected = bytearray()
    try:
        for _ in range(2 * MAX_BORROWED_BYTES // piece):
            borrowed = _buffer_at(len(expected), piece, True)
            f.write_borrowed(borrowed)
            expected += borrowed
            assert f._borrowed_bytes <= MAX_BORROWED_BYTES
        f.flush()
        assert f.in_place_bytes == len(expected) and f._borrowed_bytes == 0
    finally:
        f.close()
    assert (tmp_path / "f").read_bytes() == expected


def test_store_writes_streamed_files_by_the_rule_and_says_so_once(tmp_path, caplog):
    """Buffered unless asked, on every filesystem (write_path.py: direct lost wall time in
    every measured cell)."""
    expected = write_path.BUFFERED_BY_RULE
    write_path.forget_choices()
    data = os.urandom(STAGING_BYTES + 999)
    with caplog.at_level(logging.INFO, logger="dmuon.dcp.storage.write_path"):
        for name in ("a", "b"):  # two stores of one filesystem, as two saves are
            store = LocalStore(str(tmp_path / name))
            store.makedirs()
            with store.open_write("data") as f:
                assert not isinstance(f, DirectFile)
                f.write(data)
    assert list(write_path.known_choices().values()) == [expected]
    assert caplog.text.count(expected.describe()) == 1  # logged once per filesystem
    assert sorted(os.listdir(tmp_path / "a")) == ["data"]  # nothing else written beside it
    store.put("small", b"manifest")  # small files: always through the page cache
    assert store.read("data") == data and store.read("small") == b"manifest"
    assert sorted(store.list()) == ["data", "small"]
    write_path.forget_choices()


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
    import mmap
    from dmuon.dcp.storage.direct_io import STAGING_BYTES
    from dmuon.dcp.storage.local import LocalStore
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (3 * STAGING_BYTES + 512, 3 * STAGING_BYTES + 512))
    store = LocalStore({root!r}, direct_io=True)
    store.makedirs()
    page_aligned = mmap.mmap(-1, STAGING_BYTES)  # lined up with the file: written in place
    try:
        with store.open_write("big") as f:
            for _ in range(8):
                f.{method}(page_aligned)
    except OSError as error:
        assert (f.in_place_bytes > 0) == {borrowed}, f.in_place_bytes
        assert error.errno == errno.EFBIG, error
        assert "big" in str(error), error
        assert store.list() == {{}}, store.list()
        print("raised")
""")


@pytest.mark.parametrize("method", ["write", "write_borrowed"])
def test_a_failed_background_write_is_raised_and_the_file_removed(tmp_path, method):
    if filesystem_type(str(tmp_path)) not in DIRECT_IO_FILESYSTEMS:
        pytest.skip("no direct I/O here")
    borrowed = int(method == "write_borrowed")
    code = _FILE_TOO_BIG.format(repo=REPO, root=str(tmp_path / "ckpt"), method=method, borrowed=borrowed)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "raised", done.stdout + done.stderr


@pytest.mark.parametrize("direct", [True, False])
def test_an_explicit_direct_io_option_wins_over_the_rule(tmp_path, direct):
    if direct and filesystem_type(str(tmp_path)) not in DIRECT_IO_FILESYSTEMS:
        pytest.skip("no direct I/O here")
    write_path.forget_choices()
    store = open_store(str(tmp_path / "ckpt"), {LOCAL_DIRECT_IO_OPTION: direct})
    store.makedirs()
    with store.open_write("data") as f:
        assert isinstance(f, DirectFile) == direct
        f.write(b"x" * 5000)
    assert list(write_path.known_choices().values()) == [write_path.DIRECT_ASKED if direct else write_path.BUFFERED_ASKED]
    assert store.read("data") == b"x" * 5000
    write_path.forget_choices()




def test_a_background_save_writes_direct_on_ext4_and_xfs_and_buffered_elsewhere(tmp_path, caplog):
    """An async save's writes cost training CPU, not wall (write_path.py); direct_io wins."""
    write_path.forget_choices()
    kind = filesystem_type(str(tmp_path))
    with caplog.at_level(logging.INFO, logger="dmuon.dcp.storage.write_path"):
        for name, option in (("rule", None), ("asked-buffered", False)):
            store = LocalStore(str(tmp_path / name), direct_io=option)
            store.in_background = True
            store.makedirs()
            assert store.child("sub").in_background  # (a store's subdirectories write alike)
            with store.open_write("data") as f:
                assert isinstance(f, DirectFile) == (option is None and kind in DIRECT_IO_FILESYSTEMS)
                f.write(b"y" * 5000)
            assert store.read("data") == b"y" * 5000
    choices = list(write_path.known_choices().values())
    if kind in DIRECT_IO_FILESYSTEMS:
        assert choices == [write_path.DIRECT_IN_BACKGROUND, write_path.BUFFERED_ASKED]
        assert caplog.text.count(write_path.DIRECT_IN_BACKGROUND.describe()) == 1
    else:
        assert not choices[0].direct and kind in choices[0].reason
    write_path.forget_choices()


def test_a_background_save_on_tmpfs_is_written_through_the_page_cache():
    if not os.path.isdir("/dev/shm") or filesystem_type("/dev/shm") != "tmpfs":
        pytest.skip("no tmpfs at /dev/shm")
    write_path.forget_choices()
    store = LocalStore(f"/dev/shm/dmuon-test-bg-{os.getpid()}")
    store.in_background = True
    store.makedirs()
    try:
        with store.open_write("data") as f:
            assert not isinstance(f, DirectFile)
            f.write(b"x" * 10)
        assert [c.reason for c in write_path.known_choices().values()] == [
            "a background save on tmpfs: direct I/O only on ext4/xfs"
        ]
    finally:
        store.remove_tree()
        write_path.forget_choices()


def test_a_background_save_falls_back_to_the_page_cache_where_o_direct_is_refused(tmp_path, monkeypatch, caplog):
    """Chosen by the rule, a refusal (EINVAL at open: ext4 with data=journal, say) is not an
    error; asked for with direct_io=True, it is. (No filesystem here refuses O_DIRECT, so the
    refusal is injected at DirectFile's open.)"""
    if filesystem_type(str(tmp_path)) not in DIRECT_IO_FILESYSTEMS:
        pytest.skip("the rule picks direct I/O on ext4/XFS only")
    import dmuon.dcp.storage.local as local

    def refuse(path):
        raise OSError(errno.EINVAL, "Invalid argument", path)

    monkeypatch.setattr(local, "DirectFile", refuse)
    store = LocalStore(str(tmp_path / "rule"))
    store.in_background = True
    store.makedirs()
    with caplog.at_level(logging.WARNING, logger="dmuon.dcp.storage.local"):
        for name in ("a", "b"):
            with store.open_write(name) as f:
                f.write(b"z" * 5000)
    assert store.read("b") == b"z" * 5000
    assert caplog.text.count("O_DIRECT refused") == 1  # (then remembered for the store)
    asked = LocalStore(str(tmp_path / "asked"), direct_io=True)
    asked.makedirs()
    with pytest.raises(OSError, match="Invalid argument"):
        with asked.open_write("a"):
            pass
    write_path.forget_choices()
