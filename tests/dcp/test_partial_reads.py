"""Loads read only the bytes they need, and every byte they read is checksummed."""
import os

import pytest
import torch
import torch.distributed.checkpoint as dcp

import dmuon.dcp as ddcp
from tests.helpers.launch import RankFailed, run_ranks

ROWS, COLS = 4096, 256  # 4 MiB fp32 matrices, row-sharded by FSDP2


def build():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import dmuon

    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(COLS, ROWS, bias=False) for _ in range(3)))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    dmuon.dedicate_params(model, mesh, lambda name, p: name.startswith("2."))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def save_worker(rank, world, path):
    model = build()
    with torch.no_grad():
        for i, layer in enumerate(model):
            if i < 2:
                layer.weight.to_local().copy_(torch.randn(layer.weight.to_local().shape))
    ddcp.save(model, None, path)
    import dmuon

    return dmuon.get_model_state_dict(model)


def load_worker(rank, world, path):
    import dmuon

    model = build()
    app = ddcp.AppState(model)
    state = app.state_dict()
    needed = sum(v.to_local().nbytes if hasattr(v, "to_local") else v.nbytes
                 for v in state["model"].values() if isinstance(v, torch.Tensor))
    reader = ddcp.DMuonStorageReader(path)
    dcp.load(state, storage_reader=reader, planner=ddcp.DMuonLoadPlanner())
    app.load_state_dict(state)
    return {"read": reader.bytes_read, "needed": needed, "model": dmuon.get_model_state_dict(model)}


@pytest.mark.parametrize("source,target", [(2, 4), (4, 2), (4, 3)], ids=["2to4", "4to2", "4to3"])
def test_resharded_loads_read_at_most_a_tenth_more_than_they_need(tmp_path, source, target):
    path = str(tmp_path / "ckpt")
    saved = run_ranks(save_worker, source, path)[0]
    results = run_ranks(load_worker, target, path)
    for rank, res in enumerate(results):
        assert res["needed"] > 0
        assert res["read"] <= 1.1 * res["needed"], (rank, res["read"], res["needed"])
    assert all(torch.equal(results[0]["model"][k], v) for k, v in saved.items())


def test_a_flipped_byte_inside_a_partly_read_chunk_is_caught(tmp_path):
    import pickle

    from dmuon.dcp.checkpoint import open_checkpoint

    path = tmp_path / "ckpt"
    run_ranks(save_worker, 2, str(path))
    metadata = pickle.loads((path / ".metadata").read_bytes())
    [index] = [i for i in metadata.storage_data if i.fqn == "model.0.weight" and not any(i.offset)]
    info = metadata.storage_data[index]
    item = open_checkpoint(str(path)).file_items(info.relative_path)[info.offset]
    # rank 1 of 4 reads rows 1024..2047 of this chunk (rows 0..2047 of the 2-rank save): flip one
    row = 1500
    victim = info.offset + item.head + row * COLS * 4 + 17
    data = bytearray((path / info.relative_path).read_bytes())
    data[victim] ^= 0x01
    (path / info.relative_path).write_bytes(bytes(data))
    with pytest.raises(RankFailed, match="checksum mismatch") as failure:
        run_ranks(load_worker, 4, str(path))
    assert info.relative_path in str(failure.value)
    assert ddcp.verify(str(path))[0].startswith(f"{info.relative_path}: checksum mismatch")
