"""Objects of any size (issue 37, item 4): a streamed S3 object's parts grow as it does, so
that any object up to S3's 5 TiB fits in its 10,000 parts, with memory bounded by the part
size at the stream's current length."""
import pytest

from dmuon.dcp.storage.fsspec_store import FsspecStore
from dmuon.dcp.storage.s3_transfer import (
    S3_MAX_OBJECT_BYTES,
    S3_PART_BYTES,
    S3_UPLOAD_CONCURRENCY,
    S3ParallelWriter,
    part_bytes_for,
)

GiB, TiB = 1 << 30, 1 << 40


def parts_for(size: int, first: int = S3_PART_BYTES, per_size: int = 1_000) -> list[int]:
    """The part sizes a stream of ``size`` bytes is cut into."""
    parts, total = [], 0
    while total < size:
        part = min(part_bytes_for(len(parts) + 1, first, per_size), size - total)
        parts.append(part)
        total += part
    return parts


@pytest.mark.parametrize("size,largest_part", [
    (5 * GiB, 16 << 20),  # a 5 GiB data file: 16 MiB parts throughout, as before
    (200 * GiB, 128 << 20),  # a 70B model's fp32 masters and moments on 4 ranks, per rank
    (S3_MAX_OBJECT_BYTES, 4 * GiB),  # the largest S3 object
])
def test_any_object_up_to_5_tib_fits_in_10000_parts(size, largest_part):
    parts = parts_for(size)
    assert sum(parts) == size and len(parts) <= 10_000
    assert max(parts) == largest_part and max(parts) <= 5 * GiB
    assert all(part >= 5 << 20 for part in parts[:-1])  # S3's smallest part, but for the last
    # a stream holds at most concurrency + 1 parts: the memory bound the docs state
    assert (S3_UPLOAD_CONCURRENCY + 1) * max(parts) <= 5 * 4 * GiB


def test_small_objects_keep_small_parts():
    assert parts_for(100 << 20) == [16 << 20] * 6 + [4 << 20]


@pytest.mark.parametrize("backend", ["s3", "rgw"])
def test_growing_parts_make_one_object_through_a_real_server(request, backend):
    """The growth itself, end to end: parts of 5, 10 and 20 MiB (doubling every 3 parts here,
    every 1,000 in use) make one intact object. An object past 10,000 of S3's smallest parts
    would be 48.8 GiB, more than a test here can write; the schedule above shows it fits."""
    server = request.getfixturevalue(f"{backend}_server")
    store = FsspecStore(server.url(), server.storage_options)
    first = 5 << 20
    size = 6 * first + 3 * (2 * first) + (1 << 20)  # 3 parts of 5 MiB, 3 of 10, then 16 of a 20 MiB part
    block = bytes(range(256)) * 4096  # 1 MiB of a known pattern
    path = f"{store.root}/growing"
    try:
        with S3ParallelWriter(store.fs, path, part_bytes=first, concurrency=3, parts_per_size=3) as f:
            for _ in range(size // len(block)):
                f.write(block)
            parts = f._parts_sent + (1 if f._filled else 0)
        assert parts == len(parts_for(size, first, 3)) == 7
        assert store.fs.size(path) == size
        assert store.fs.cat_file(path) == block * (size // len(block))
    finally:
        store.remove_tree()


@pytest.mark.slow
def test_an_object_past_10000_of_its_smallest_parts_through_a_real_server(rgw_server):
    """Issue 37's case, scaled down: with 1 KiB first parts (doubling every 1,000, as 16 MiB ones
    do in use), an object of 12,000 KiB, past 10,000 x its smallest part, goes up as one intact
    object of fewer than 10,000 parts. (Ceph's gateway, told to take parts under S3's 5 MiB
    minimum; with the real sizes the same object would be 187 GiB.)"""
    store = FsspecStore(rgw_server.url(), rgw_server.storage_options)
    first, size = 1 << 10, 12_000 << 10
    block = bytes(range(256)) * 64  # 16 KiB of a known pattern
    path = f"{store.root}/past-10000"
    try:
        with S3ParallelWriter(store.fs, path, part_bytes=first, concurrency=8) as f:
            for _ in range(size // len(block)):
                f.write(block)
            parts = f._parts_sent + (1 if f._filled else 0)
        assert size > 10_000 * first and parts == len(parts_for(size, first)) < 10_000
        assert store.fs.size(path) == size
        assert store.fs.cat_file(path) == block * (size // len(block))
    finally:
        store.remove_tree()
