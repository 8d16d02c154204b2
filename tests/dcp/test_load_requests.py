"""What a load asks of object storage does not grow with the world.

Every rank reads what all ranks hold alike (the optimizer's hyper-parameters and step counts,
``extra``). Spread over the ranks' files, as torch's de-duplication spreads them, they made
every rank read one file per such key, each behind a request for that file's checksums: at
8 ranks the tiny model's load sent 228 requests, and a throttled server (5 a second) took
70 s to answer them. Here, counted by a proxy in front of real S3 and GCS servers, each rank
reads two data files (its own and the lowest rank's, which holds those keys at its head), each
in two ranged GETs (its checksum trailer, its items), and asks no file's size: under FSDP2, and
under HSDP, whose cooperative load has each rank read the file it wrote.
"""
from __future__ import annotations

import pytest

import dmuon
import dmuon.dcp as ddcp
from dmuon.dcp.format.layout import rank_of_data_file
from tests.dcp.storage.test_throttling import KIND, assert_same_state, through
from tests.helpers.launch import run_ranks
from tests.helpers.throttle_proxy import ThrottleProxy
from tests.helpers.training import build, train


def save_worker(rank, world, url, options, replicate=1):
    model, opt = build(replicate)
    train(model, opt, rank, world, range(1))
    ddcp.save(model, opt, url, extra={"step": 1}, storage_options=options)
    return (dmuon.get_model_state_dict(model, rank0_only=False),
            dmuon.get_optimizer_state_dict(model, opt, rank0_only=False))


def load_worker(rank, world, url, options, replicate=1):
    model, opt = build(replicate)
    extra = ddcp.load(model, opt, url, storage_options=options)
    assert extra == {"step": 1}, extra
    return (dmuon.get_model_state_dict(model, rank0_only=False),
            dmuon.get_optimizer_state_dict(model, opt, rank0_only=False))


@pytest.mark.parametrize("world, replicate", [(8, 1), (4, 2)], ids=["fsdp-8", "hsdp-2x2"])
@pytest.mark.parametrize("backend", ["s3", "gcs"])
def test_each_rank_reads_two_data_files_in_two_requests_each(request, backend, world, replicate):
    """FSDP2 on 8 ranks, and HSDP 2 x 2, whose load from object storage is cooperative: each
    member of a replica pair reads the chunks its own replica wrote (one file) and receives
    the others' from its partner, instead of reading both replicas' files."""
    server = request.getfixturevalue(f"{backend}_server")
    proxy = ThrottleProxy(server.port, KIND[backend], rate=1e6)  # (counts; never refuses)
    url = server.url()
    options = through(server, proxy)
    try:
        saved = run_ranks(save_worker, world, url, options, replicate, timeout=90)
        proxy.reads.clear()
        loaded = run_ranks(load_worker, world, url, options, replicate, timeout=90)
    finally:
        proxy.stop()
    for before, after in zip(saved, loaded):
        assert_same_state(before, after)

    per_file: dict[int, dict[str, int]] = {}
    for (method, key), count in proxy.reads.items():
        rank = rank_of_data_file(key.rsplit("/", 1)[-1])
        if rank is not None:
            per_file.setdefault(rank, {}).setdefault(method, 0)
            per_file[rank][method] += count
    assert sorted(per_file) == list(range(world)), per_file  # every rank read its own file
    assert all(set(methods) == {"GET"} for methods in per_file.values()), per_file  # no size asked
    # the lowest rank's file: two GETs from every rank; any other: two from its own rank (three
    # under HSDP, where the rank skips, within its own file, what its partner reads for it)
    own = 2 if replicate == 1 else 3
    assert per_file[0]["GET"] <= 2 * (world - 1) + own, per_file
    assert all(per_file[rank]["GET"] <= own for rank in range(1, world)), per_file
