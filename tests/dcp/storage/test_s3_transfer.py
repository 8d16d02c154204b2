"""The parallel S3 streams (dmuon/dcp/storage/s3_transfer.py and ranged_reader.py) against real S3 servers over HTTP:
multipart uploads with several parts in flight, read-ahead with seeks, aborts that leave
nothing behind. SeaweedFS and Ceph RGW (which enforces S3's 5 MiB minimum part size)."""
import asyncio
import os
import random

import pytest

from dmuon.dcp.storage.fsspec_store import FsspecStore
from dmuon.dcp.storage.ranged_reader import RangedReader
from dmuon.dcp.storage.s3_transfer import S3_PART_BYTES, PartBody, S3ParallelWriter

PART = 5 << 20  # S3's smallest part


@pytest.fixture(params=["s3", "rgw"])
def s3_store(request):
    server = request.getfixturevalue(f"{request.param}_server")
    store = FsspecStore(server.url(), server.storage_options)
    yield store
    store.remove_tree()


def _path(store, name):
    return f"{store.root}/{name}"


def test_store_streams_are_the_parallel_ones(s3_store):
    assert s3_store.parallel_s3
    with s3_store.open_write("a") as f:
        assert isinstance(f, S3ParallelWriter)
        f.write(b"x")
    with s3_store.open_read("a") as f:
        assert isinstance(f, RangedReader)
        assert f.read() == b"x"


def test_multipart_upload_and_read_ahead_round_trip(s3_store):
    rng = random.Random(0)
    data = rng.randbytes(3 * PART + 12345)  # four parts, the last one short
    path = _path(s3_store, "big")
    with S3ParallelWriter(s3_store.fs, path, part_bytes=PART, concurrency=3) as f:
        start = 0
        while start < len(data):  # odd write sizes, straddling part boundaries
            n = rng.randint(1, 3 << 20)
            f.write(memoryview(data)[start : start + n])
            start += n
        assert f.tell() == len(data)
    assert s3_store.fs.size(path) == len(data)
    assert s3_store.fs.cat_file(path) == data

    with RangedReader(s3_store.fs, path, len(data), block_bytes=PART, concurrency=2) as f:
        buffer = bytearray(len(data))
        assert f.readinto(buffer) == len(data)
        assert buffer == data
        assert f.bytes_fetched == len(data)  # in file order, every byte is fetched once
        for _ in range(20):  # seeks anywhere, reads across block ends
            offset = rng.randrange(len(data))
            f.seek(offset)
            n = rng.randint(0, 2 * PART)
            assert f.read(n) == data[offset : offset + n]
        f.seek(-10, os.SEEK_END)
        assert f.read() == data[-10:]
        assert f.read(5) == b""


def test_small_object_is_one_put(s3_store):
    path = _path(s3_store, "small")
    with S3ParallelWriter(s3_store.fs, path, part_bytes=PART) as f:
        f.write(b"hello ")
        f.write(b"world")
        assert f._upload_id is None  # never started a multipart upload
    assert s3_store.fs.cat_file(path) == b"hello world"


def test_failure_mid_upload_leaves_no_object_and_no_upload(s3_store):
    path = _path(s3_store, "failed")
    bucket = path.split("/", 1)[0]
    with pytest.raises(RuntimeError, match="writer died"):
        with s3_store.open_write("failed") as f:
            f.write(os.urandom(S3_PART_BYTES + 1))  # one part sent
            assert f._upload_id is not None
            upload_id = f._upload_id
            raise RuntimeError("writer died")
    assert "failed" not in s3_store.list()
    open_uploads = s3_store.fs.list_multipart_uploads(bucket)
    assert all(u.get("UploadId") != upload_id for u in open_uploads)


def test_a_refused_part_surfaces_in_the_writer(s3_store):
    """A part the server refuses (here: the upload was aborted behind the writer's back) is an
    error at the next write or at close, never a silently short object."""
    path = _path(s3_store, "aborted")
    f = S3ParallelWriter(s3_store.fs, path, part_bytes=PART, concurrency=1)
    f.write(os.urandom(PART))
    s3_store.fs.abort_mpu(*path.split("/", 1), f._upload_id)
    with pytest.raises(OSError):
        f.write(os.urandom(PART))
        f.close()
    assert "aborted" not in s3_store.list()


def test_part_body_hands_over_views_of_the_part_not_copies():
    part = bytearray(random.Random(1).randbytes(5 * 1024 + 7))
    body = PartBody(memoryview(part)[:5000], piece=1024)

    async def pieces():
        return [piece async for piece in body]

    got = asyncio.run(pieces())
    assert len(body) == 5000 and [len(p) for p in got] == [1024] * 4 + [904]
    assert all(isinstance(p, memoryview) and p.obj is part for p in got)  # the part's own buffer
    assert b"".join(got) == part[:5000]
    assert asyncio.run(pieces()) == got  # sent again from the start (a retried request)
    assert body.read(10) == part[:10] and body.tell() == 10
    body.seek(0)
    assert body.read() == part[:5000] and body.read() == b""


def test_part_buffers_are_reused_and_the_parts_intact(s3_store):
    rng = random.Random(2)
    data = rng.randbytes(6 * PART + 99)
    path = _path(s3_store, "reused")
    filled: list[bytearray] = []  # every buffer a part was filled in (kept, so none is freed and its id reused)
    with S3ParallelWriter(s3_store.fs, path, part_bytes=PART, concurrency=2) as f:
        for start in range(0, len(data), 1 << 20):
            f.write(data[start : start + (1 << 20)])
            if f._filled and not any(b is f._part for b in filled):
                filled.append(f._part)
    assert s3_store.fs.cat_file(path) == data
    assert len(filled) <= 2 + 1  # at most concurrency + 1 buffers for 7 parts


@pytest.mark.parametrize("merge_gap, fetched", [(0, 300), (4096, 1200)])
def test_told_ranges_close_together_are_one_get(s3_store, merge_gap, fetched):
    """A request costs more than the bytes between two ranges a few KiB apart: ranges told
    together (the reader's hints) that close are fetched as one (the bytes between dropped);
    ranges further apart are not. (One GET in flight: the first range is asked for at once,
    the next two wait, and are merged, or not.)"""
    data = random.Random(1).randbytes(1 << 20)
    path = _path(s3_store, "gaps")
    s3_store.fs.pipe_file(path, data)
    with RangedReader(s3_store.fs, path, len(data), block_bytes=PART, concurrency=1, merge_gap=merge_gap) as f:
        for start in (0, 1000, 2000):
            f.will_need(start, 100)
        for start in (0, 1000, 2000):
            f.seek(start)
            assert f.read(100) == data[start : start + 100]
        assert f.bytes_fetched == fetched
