"""Every rank writes its own share: no gather to rank 0, no rank holding the model."""
import os

import torch

import dmuon.dcp as ddcp
from tests.helpers.launch import run_ranks
from tests.helpers.memory import PeakRSS, return_freed_memory_to_os
from tests.helpers.models import Wide
from tests.helpers.setup import make_mesh, shard_model


def save_worker(rank, world, path):
    return_freed_memory_to_os()
    torch.manual_seed(0)
    model = Wide()
    _, opt = shard_model(model, make_mesh(), lambda n, p: int(n.split(".")[1]) % 2 == 0, wrap=("blocks",))
    with PeakRSS() as rss:
        ddcp.save(model, None, path)
    return {"growth": rss.growth}


def test_each_rank_writes_its_share_and_nobody_holds_the_model(tmp_path):
    path = tmp_path / "wide"
    results = run_ranks(save_worker, 4, str(path))
    model_bytes = 16 * 512 * 512 * 4
    sizes = {int(name.split("_")[2]): os.path.getsize(path / name)
             for name in os.listdir(path) if name.endswith(".distcp")}
    assert sorted(sizes) == [0, 1, 2, 3]
    total = sum(sizes.values())
    assert total >= model_bytes
    metadata_bytes = os.path.getsize(path / ".metadata")
    for rank, size in sizes.items():
        assert size <= 1.25 * total / 4 + metadata_bytes, (rank, sizes)
    for rank, res in enumerate(results):
        assert res["growth"] < 0.5 * model_bytes, (rank, res["growth"])
