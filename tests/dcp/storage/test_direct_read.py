"""Cold local files read past the page cache: every byte as written, whatever the reads' order."""
import os
import random
import time

import pytest
import torch

from dmuon.dcp.storage import write_path
from dmuon.dcp.storage.direct_io import DIRECT_IO_ALIGN
from dmuon.dcp.storage.direct_read import CHUNK_BYTES, CHUNKS_AHEAD, DirectReadFile, is_cold
from dmuon.dcp.storage.local import DIRECT_IO_FILESYSTEMS, LocalReadFile, LocalStore, filesystem_type
from tests.helpers.launch import run_ranks

SIZE = 3 * CHUNK_BYTES + 12345  # (ends inside a page)


def _dropped(path) -> None:
    """The file's pages out of the page cache (written back first), as after a restart."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


@pytest.fixture
def cold_file(tmp_path):
    if filesystem_type(str(tmp_path)) not in DIRECT_IO_FILESYSTEMS:
        pytest.skip(f"{filesystem_type(str(tmp_path))}: no plain O_DIRECT here")
    data = os.urandom(SIZE)
    path = tmp_path / "data"
    path.write_bytes(data)
    _dropped(path)
    if not is_cold(str(path), SIZE):
        pytest.skip("this system cannot tell whether a file is cached (mincore)")
    return str(path), data


def test_is_cold_tells_a_cached_file_from_a_dropped_one(cold_file):
    path, data = cold_file
    with open(path, "rb") as f:
        f.read()
    assert not is_cold(path, len(data))
    _dropped(path)
    assert is_cold(path, len(data))


def test_hinted_reads_in_file_order_give_every_byte(cold_file):
    path, data = cold_file
    with DirectReadFile(path) as f:
        f.seek(SIZE - 100)
        assert f.read(1000) == data[-100:]  # (a trailer: read on the spot, cut at the end)
        f.seek(0)
        f.will_need(0, SIZE)
        got = bytearray()
        rng = random.Random(0)
        while len(got) < SIZE:
            piece = f.read(rng.choice([30, 4096, 1 << 20, 5 << 20, CHUNK_BYTES + 1]))
            assert piece
            got += piece
        assert bytes(got) == data and f.read(10) == b""
        assert len(f._chunks) <= CHUNKS_AHEAD
    assert is_cold(path, SIZE)  # read past the page cache: nothing of it was cached


def test_reads_anywhere_without_hints_and_into_memory_views(cold_file):
    path, data = cold_file
    rng = random.Random(1)
    with DirectReadFile(path) as f:
        f.will_need(CHUNK_BYTES, 100)  # a hint never read: harmless
        for _ in range(50):
            offset, length = rng.randrange(SIZE), rng.choice([1, 777, DIRECT_IO_ALIGN, 3 << 20])
            out = torch.empty(length, dtype=torch.uint8)
            f.seek(offset)
            n = f.readinto(memoryview(out.numpy()))
            assert n == min(length, SIZE - offset)
            assert bytes(out[:n].numpy()) == data[offset : offset + n]
        assert f.seek(-5, os.SEEK_END) == SIZE - 5 and f.read() == data[-5:]


def test_only_the_hinted_ranges_are_fetched_even_after_a_trailer_read_first(cold_file):
    """A rank of a cooperative load reads its share of a file: every other MiB here. Only
    those bytes are fetched (whole pages), not the chunks around them; and the hints, given
    while the position is still at the end of the trailer just read, are read ahead, not
    dropped as already passed."""
    import time

    path, data = cold_file
    with DirectReadFile(path) as f:
        f.will_need(SIZE - 100, 100)
        f.seek(SIZE - 100)
        assert f.read(100) == data[-100:]
        shares = [(k * (1 << 20) + 1000, (1 << 20) - 3000) for k in range(0, 3 * CHUNK_BYTES >> 20, 2)]
        for offset, length in shares:
            f.will_need(offset, length)
        deadline = time.monotonic() + 10
        while not f._chunks and time.monotonic() < deadline:  # (the position is SIZE here)
            time.sleep(0.01)
        assert f._chunks, "the hinted ranges were dropped, not read ahead"
        for offset, length in shares:
            f.seek(offset)
            assert f.read(length) == data[offset : offset + length]
        wanted = 100 + sum(length for _, length in shares)
        assert wanted <= f.bytes_fetched <= wanted + 2 * DIRECT_IO_ALIGN * (len(shares) + 1)


def test_the_store_reads_cold_large_files_past_the_cache_where_it_writes_past_it(cold_file, tmp_path):
    path, data = cold_file
    (tmp_path / "small").write_bytes(b"x" * 100)
    store = LocalStore(str(tmp_path), direct_io=True)
    with store.open_read("data") as f:
        assert isinstance(f, DirectReadFile)
        assert f.read() == data
    with store.open_read("small") as f:
        assert isinstance(f, LocalReadFile)
    with open(path, "rb") as f:
        f.read(CHUNK_BYTES)  # part of it cached now
    with store.open_read("data") as f:
        assert isinstance(f, LocalReadFile)
    _dropped(path)
    with LocalStore(str(tmp_path), direct_io=False).open_read("data") as f:
        assert isinstance(f, LocalReadFile)  # direct I/O turned off: reads too
    # The default follows the rule, in a process that never wrote here too: through the cache.
    write_path.forget_choices()
    with LocalStore(str(tmp_path)).open_read("data") as f:
        assert isinstance(f, LocalReadFile)
    assert write_path.known_choices() == {}  # (a read logs nothing: only writes choose a way)


def test_a_file_read_through_the_cache_passes_every_hint_on(cold_file):
    """Every hinted range goes to the kernel (``WILLNEED``), not only the file's first bytes."""
    path, data = cold_file
    with LocalReadFile(path) as f:
        f.will_need(0, 4096)  # the first item
        far = (16 << 20) + 4096  # past the 16 MiB that an earlier version passed on
        f.will_need(far, SIZE - far)
        deadline = time.monotonic() + 10  # (the kernel reads the hinted pages in the background)
        while is_cold(path, SIZE) and time.monotonic() < deadline:  # (it looks at pages past ``far`` too)
            time.sleep(0.05)
        hinted = not is_cold(path, SIZE)
        f.seek(far)
        assert f.read() == data[far:]
    assert hinted, "a hint far into the file was not passed on"


def test_a_file_in_memory_is_not_hinted(cold_file, tmp_path):
    """Hints for pages the kernel has are dropped; a cold file's are passed on."""
    path, data = cold_file
    store = LocalStore(str(tmp_path), direct_io=False)
    with store.open_read("data") as f:
        assert f._advice is not None  # cold: hinted
        assert f.read() == data
    with store.open_read("data") as f:
        assert f._advice is None  # every page read a moment ago


def _save_then_cold_load(rank, world, root, save_options):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import dmuon
    import dmuon.dcp as ddcp
    from dmuon.dcp.storage import direct_read, local

    local.DIRECT_READ_MIN_BYTES = 0  # (this rank's process only) the tiny model's files too

    def build(seed):
        torch.manual_seed(seed)
        model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)])
        mesh = init_device_mesh("cpu", (world,))
        dmuon.dedicate_params(model, mesh, lambda name, p: p.ndim == 2 and name.startswith(("0.", "2.")))
        for layer in model:
            fully_shard(layer, mesh=mesh)
        return fully_shard(model, mesh=mesh)

    model = build(0)
    optimizer = dmuon.Muon(model, lr=0.02)
    model(torch.randn(8, 64)).sum().backward()
    optimizer.step()
    ddcp.save(model, optimizer, root, storage_options=save_options)
    dist.barrier()
    files = sorted(name for name in os.listdir(root) if name.endswith(".distcp"))
    if rank == 0:
        for name in files:
            _dropped(os.path.join(root, name))
    dist.barrier()
    cold = [direct_read.is_cold(os.path.join(root, n), os.path.getsize(os.path.join(root, n))) for n in files]
    fresh = build(1)
    fresh_optimizer = dmuon.Muon(fresh, lr=0.02)
    ddcp.load(fresh, fresh_optimizer, root, storage_options={"direct_io": True})
    for (name, want), got in zip(dmuon.get_model_state_dict(model).items(), dmuon.get_model_state_dict(fresh).values()):
        assert torch.equal(want, got), name
    dist.barrier()
    still_cold = [direct_read.is_cold(os.path.join(root, n), os.path.getsize(os.path.join(root, n))) for n in files]
    return cold, still_cold


@pytest.mark.parametrize("save_options", [{"direct_io": True}, None], ids=["saved-direct", "saved-buffered"])
def test_a_cold_load_reads_past_the_page_cache_bit_exact(tmp_path, save_options):
    """The load's own ``direct_io=True`` reads cold files past the cache, whichever way they were written."""
    if filesystem_type(str(tmp_path)) not in DIRECT_IO_FILESYSTEMS:
        pytest.skip("no plain O_DIRECT here")
    results = run_ranks(_save_then_cold_load, 2, str(tmp_path / "ckpt"), save_options)
    for cold, still_cold in results:
        if not all(cold):
            pytest.skip("this system cannot tell whether a file is cached (mincore)")
        assert all(still_cold)  # read past the cache: the load left none of them cached
