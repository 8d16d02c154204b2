"""Cooperative restore: under HSDP each region is fetched from storage by one rank and sent to
the replicas that need it. Counted: the bytes every rank's reader fetched, against the bytes of
the checkpoint's data files; bit-exact against the saved state; on local disk and on S3."""
import os

import pytest
import torch
import torch.distributed.checkpoint as dcp

import dmuon
import dmuon.dcp as ddcp
from dmuon.dcp.cooperative import COOPERATIVE_ENV
from dmuon.dcp.format import rank_of_data_file
from dmuon.dcp.node_identity import NODE_RANK_ENV
from dmuon.dcp.storage.registry import open_store
from tests.helpers.collectives import count_collectives, names
from tests.helpers.launch import run_ranks
from tests.helpers.setup import max_abs_diff
from tests.helpers.training import build, train

# embeddings and matrices large enough that tensors, not the few small objects every rank reads
# (hyper-parameters, the step), make up the checkpoint
MODEL = {"vocab": 512, "dim": 64, "hidden": 256}


def save_worker(rank, world, replicate, url, options, sizes=MODEL):
    model, opt = build(replicate, **sizes)
    train(model, opt, rank, world, range(2))
    ddcp.save(model, opt, url, extra={"step": 2}, storage_options=options)
    return {"model": dmuon.get_model_state_dict(model), "optim": dmuon.get_optimizer_state_dict(model, opt)}


def load_worker(rank, world, replicate, url, options, cooperative, machines=None, sizes=MODEL):
    """``machines``: each rank's machine, as torchrun would say it (``GROUP_RANK``)."""
    if machines is not None:
        os.environ[NODE_RANK_ENV] = str(machines[rank])
    model, opt = build(replicate, **sizes)
    reader = ddcp.DMuonStorageReader(url, storage_options=options, cooperative=cooperative)
    app = ddcp.AppState(model, opt)
    state = app.state_dict()
    dcp.load(state, storage_reader=reader, planner=ddcp.DMuonLoadPlanner())
    app.load_state_dict(state)
    return {"model": dmuon.get_model_state_dict(model), "optim": dmuon.get_optimizer_state_dict(model, opt),
            "fetched": reader.bytes_fetched, "read": reader.bytes_read}


def data_bytes(url, options) -> int:
    files = open_store(url, options).list()
    return sum(size for name, size in files.items() if rank_of_data_file(name) is not None)


def assert_same(loaded, saved):
    assert max_abs_diff(loaded["model"], saved["model"]) == 0.0
    for section in ("fsdp2", "dedicated"):
        for fqn, entry in saved["optim"][section].items():
            assert max_abs_diff(loaded["optim"][section][fqn], entry) == 0.0, (section, fqn)


@pytest.mark.parametrize("backend", ["local", "s3"])
def test_hsdp_restore_fetches_each_byte_once(checkpoint_location, backend):
    root, options = checkpoint_location(backend)
    url = f"{root}/hsdp"
    saved = run_ranks(save_worker, 4, 2, url, options)[0]
    total = data_bytes(url, options)
    together = run_ranks(load_worker, 4, 2, url, options, True)
    apart = run_ranks(load_worker, 4, 2, url, options, False)
    assert_same(together[0], saved)
    assert_same(apart[0], saved)
    fetched_together = sum(r["fetched"] for r in together)
    fetched_apart = sum(r["fetched"] for r in apart)
    assert fetched_together <= 1.1 * total, (fetched_together, total)
    assert fetched_apart >= 1.5 * total, (fetched_apart, total)  # every replica read its own copy
    # and the reading is spread: no rank fetched much more than an even share
    assert max(r["fetched"] for r in together) <= 0.6 * total


def own_load_worker(rank, world, url, options, cooperative, machines=None):
    """``dmuon.dcp.load`` as a script calls it; the readers it made and the collectives it
    called, counted from outside. ``machines``: as in :func:`load_worker`."""
    from dmuon.dcp.reader import DMuonStorageReader

    if machines is not None:
        os.environ[NODE_RANK_ENV] = str(machines[rank])

    readers = []
    read_data = DMuonStorageReader.read_data

    def counted(self, plan, planner):
        readers.append(self)
        return read_data(self, plan, planner)

    DMuonStorageReader.read_data = counted
    model, opt = build(2, **MODEL)
    calls: list = []
    count_collectives(calls)
    extra = ddcp.load(model, opt, url, storage_options=options, cooperative=cooperative)
    return {"model": dmuon.get_model_state_dict(model), "optim": dmuon.get_optimizer_state_dict(model, opt),
            "fetched": sum(r.bytes_fetched for r in readers), "calls": calls, "extra": extra}


@pytest.mark.parametrize("backend", ["local", "s3"])
def test_dmuons_own_load_shares_among_replicas_without_gathering_plans(checkpoint_location, backend):
    """Issue 43, item 6: under HSDP each replica group finds the reads all its members make
    (all-reduces of a width set by the checkpoint) and computes the same assignment of readers
    on every member; no plan is sent anywhere, and each byte is still fetched once."""
    root, options = checkpoint_location(backend)
    url = f"{root}/hsdp"
    saved = run_ranks(save_worker, 4, 2, url, options)[0]
    total = data_bytes(url, options)
    results = run_ranks(own_load_worker, 4, url, options, True)
    assert_same(results[0], saved)
    for result in results:
        assert result["extra"] == {"step": 2}
        called = names(result["calls"])
        assert not set(called) & {"gather_object", "scatter_object_list", "all_gather_object"}, called
        assert called.count("broadcast_object_list") == 1, called  # the small files (open_once)
        # planning; within each replica pair: the keys all hold, the shared list's digest, the
        # reads done; the outcome
        assert called.count("all_reduce") == 5, called
    fetched = sum(r["fetched"] for r in results)
    assert fetched <= 1.1 * total, (fetched, total)
    assert max(r["fetched"] for r in results) <= 0.6 * total, [r["fetched"] for r in results]
    apart = run_ranks(own_load_worker, 4, url, options, False)
    assert_same(apart[0], saved)
    assert sum(r["fetched"] for r in apart) >= 1.5 * total
    if backend == "local":  # the default there: replicas share only across machines
        across = run_ranks(own_load_worker, 4, url, options, None, (0, 0, 1, 1))
        assert_same(across[0], saved)
        assert sum(r["fetched"] for r in across) <= 1.1 * total  # (replicas 0, 2 and 1, 3: two machines)
        one = run_ranks(own_load_worker, 4, url, options, None, (0, 0, 0, 0))
        assert_same(one[0], saved)
        assert sum(r["fetched"] for r in one) >= 1.5 * total  # one page cache: each reads for itself


def test_from_1d_to_hsdp_and_the_environment_switch(tmp_path):
    """The default on a local path: the replicas (ranks 0, 2 and 1, 3 of the 2x2 mesh) on two
    machines share their reads; ``DMUON_COOPERATIVE_LOAD=0`` turns that off."""
    url = str(tmp_path / "ckpt")
    saved = run_ranks(save_worker, 2, 1, url, None)[0]
    total = data_bytes(url, None)
    two_machines = (0, 0, 1, 1)
    together = run_ranks(load_worker, 4, 2, url, None, None, two_machines)
    assert_same(together[0], saved)
    assert sum(r["fetched"] for r in together) <= 1.1 * total
    apart = run_ranks(load_worker, 4, 2, url, None, None, two_machines, env={COOPERATIVE_ENV: "0"})
    assert_same(apart[0], saved)
    assert sum(r["fetched"] for r in apart) >= 1.5 * total


@pytest.mark.parametrize("backend", ["local", "s3"])
def test_the_default_on_one_machine_shares_only_object_storage_reads(checkpoint_location, backend):
    """Ranks of one machine reading a local path each read for themselves (the page cache
    serves the replica's read; an exchange over the process group measured slower); from S3
    every rank's read is a request, so they share. ``DMUON_COOPERATIVE_LOAD=1`` shares local
    reads too."""
    root, options = checkpoint_location(backend)
    url = f"{root}/hsdp"
    saved = run_ranks(save_worker, 4, 2, url, options)[0]
    total = data_bytes(url, options)
    default = run_ranks(load_worker, 4, 2, url, options, None)
    assert_same(default[0], saved)
    fetched = sum(r["fetched"] for r in default)
    if backend == "local":
        assert fetched >= 1.5 * total, (fetched, total)
        forced = run_ranks(load_worker, 4, 2, url, options, None, env={COOPERATIVE_ENV: "1"})
        assert_same(forced[0], saved)
        assert sum(r["fetched"] for r in forced) <= 1.1 * total
    else:
        assert fetched <= 1.1 * total, (fetched, total)


# items of 0.5-1 MiB: a direct read's page alignment (4 KiB at each end of a run) stays small
LARGER = {"vocab": 512, "dim": 256, "hidden": 1024}


def cold_load_worker(rank, world, url, chunk):
    """A load past the page cache (direct reads) of small files, in read-ahead chunks of
    ``chunk`` bytes, neighbours not kept with one reader (no ``STICKY_BYTES``): the shares of
    several ranks lie in one chunk, as a large model's do."""
    from dmuon.dcp import cooperative
    from dmuon.dcp.storage import direct_read, local

    cooperative.STICKY_BYTES = 0
    opened = []

    class Counted(direct_read.DirectReadFile):
        def __init__(self, path):
            super().__init__(path)
            opened.append(path)

    local.DIRECT_READ_MIN_BYTES = 0
    local.DirectReadFile = Counted
    direct_read.CHUNK_BYTES = chunk
    return {**load_worker(rank, world, 2, url, {"direct_io": True}, None, sizes=LARGER), "direct": len(opened)}


def test_a_cold_hsdp_load_with_the_exchange_fetches_each_byte_once(tmp_path):
    """HSDP 2x2, the exchange forced (``DMUON_COOPERATIVE_LOAD=1``), the files read past the
    page cache: each rank fetches only the bytes of its share, not the read-ahead chunks
    around them (which hold its neighbours' shares). Counted by each stream: every byte read
    from a file, hinted or not (trailers, headers, alignment)."""
    from dmuon.dcp.storage.direct_read import is_cold
    from dmuon.dcp.storage.local import DIRECT_IO_FILESYSTEMS, filesystem_type

    if filesystem_type(str(tmp_path)) not in DIRECT_IO_FILESYSTEMS:
        pytest.skip(f"{filesystem_type(str(tmp_path))}: no plain O_DIRECT here")
    url = str(tmp_path / "ckpt")
    saved = run_ranks(save_worker, 4, 2, url, None, LARGER)[0]
    total = data_bytes(url, None)
    for name in os.listdir(url):
        fd = os.open(os.path.join(url, name), os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    if not all(is_cold(os.path.join(url, name), size) for name, size in open_store(url, None).list().items()):
        pytest.skip("this system cannot tell whether a file is cached (mincore)")
    results = run_ranks(cold_load_worker, 4, url, 1 << 20, env={COOPERATIVE_ENV: "1"})
    assert_same(results[0], saved)
    assert all(r["direct"] for r in results), results  # every rank read past the cache
    fetched = sum(r["fetched"] for r in results)
    assert fetched <= 1.1 * total, (fetched / total, [r["fetched"] for r in results], total)
    assert fetched >= sum(r["read"] for r in results)  # (the stream's own count, not the data bytes)


def corrupt_load_worker(rank, world, url):
    model, opt = build(2, **MODEL)
    try:
        ddcp.load(model, opt, url)
    except ddcp.CheckpointError as error:
        return {"error": f"{type(error).__name__}: {error}"}
    return {"error": None}


@pytest.mark.parametrize("exchange", [None, "1"])
def test_a_corrupt_region_fails_the_load_on_every_rank(tmp_path, exchange):
    """The rank that reads a region verifies it; a mismatch there fails every rank (none waits
    for bytes that will not come), and names the file. With the exchange forced
    (``DMUON_COOPERATIVE_LOAD=1``), the replicas that wait for the region learn it first, and
    the other replica group through the load's last round; the job's rank numbers are named."""
    url = str(tmp_path / "ckpt")
    run_ranks(save_worker, 4, 2, url, None)
    victim = max((name for name in os.listdir(url) if rank_of_data_file(name) is not None),
                 key=lambda name: os.path.getsize(os.path.join(url, name)))
    path = os.path.join(url, victim)
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    env = {} if exchange is None else {COOPERATIVE_ENV: exchange}
    results = run_ranks(corrupt_load_worker, 4, url, timeout=60, env=env)
    assert all(r["error"] for r in results), results
    assert any("checksum mismatch" in r["error"] and victim in r["error"] for r in results)
    assert all(r["error"].startswith("CheckpointCorruptError") for r in results), results


def test_cooperation_needs_a_shared_region(tmp_path):
    """A 1-D load shares nothing: the plans go out unchanged and no exchange runs."""
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

    from dmuon import compat
    from dmuon.dcp.cooperative import assign_readers, share_of

    def item(fqn, offset):
        return ReadItem(LoadItemType.TENSOR, MetadataIndex(fqn, (offset,)), torch.Size([offset]),
                        MetadataIndex(fqn, (offset,)), torch.Size([0]), torch.Size([4]))

    where = {MetadataIndex(fqn, (offset,)): compat.StorageInfo("f", offset * 8 + (fqn == "b"), 16)
             for fqn in "ab" for offset in (0, 4)}
    dtypes = {"a": torch.float32, "b": torch.float32}

    alone = [LoadPlan([item("a", 0)]), LoadPlan([item("a", 4)])]
    assert all(share_of(plan) is None for plan in assign_readers(alone, dtypes, where))
    together = [LoadPlan([item("a", 0), item("b", 0)]), LoadPlan([item("a", 0)]), LoadPlan([item("a", 0)])]
    shares = [share_of(plan) for plan in assign_readers(together, dtypes, where)]
    # rank 0 must read "b" anyway: "a" goes to the least loaded of the others, rank 1
    assert not shares[0].sends and list(shares[0].receives) == [0]
    assert list(shares[1].sends) == [0] and shares[1].sends[0].targets == (0, 2)
    assert list(shares[2].receives) == [0] and shares[2].receives[0].source == 1

    # ranks 0 and 1 on one machine, rank 2 on another: rank 1 reads "a" itself, rank 2 receives it
    shares = [share_of(plan) for plan in assign_readers(together, dtypes, where, ["m0", "m0", "m1"])]
    assert not shares[0].sends and not shares[0].receives
    assert list(shares[1].sends) == [0] and shares[1].sends[0].targets == (2,)
    assert list(shares[2].receives) == [0] and shares[2].receives[0].source == 1
    # all three on one machine: nothing is exchanged, and no collective is added
    assert all(share_of(plan) is None for plan in assign_readers(together, dtypes, where, ["m0"] * 3))
