"""Values dmuon does not own pass through its planners, writer and reader as through torch's."""
import pickle

import torch
import torch.distributed.checkpoint as dcp

import dmuon.dcp as ddcp
from tests.helpers.launch import run_ranks


def sharded_worker(rank, world, path):
    from torch.distributed._shard.sharded_tensor import empty
    from torch.distributed._shard.sharding_spec import ChunkShardingSpec

    spec = ChunkShardingSpec(dim=0, placements=[f"rank:{r}/cpu" for r in range(world)])
    saved = empty(spec, 8, 4)
    saved.local_shards()[0].tensor.copy_(torch.arange(16.0).view(4, 4) + 100 * rank)
    state = {"st": saved, "plain": torch.ones(3) * 7, "obj": {"epoch": 3}}
    dcp.save(state, storage_writer=ddcp.DMuonStorageWriter(path), planner=ddcp.DMuonSavePlanner())
    loaded_st = empty(spec, 8, 4)
    loaded = {"st": loaded_st, "plain": torch.zeros(3), "obj": {"epoch": 0}}
    dcp.load(loaded, storage_reader=ddcp.DMuonStorageReader(path), planner=ddcp.DMuonLoadPlanner())
    return {"equal": torch.equal(loaded_st.local_shards()[0].tensor, saved.local_shards()[0].tensor),
            "plain": loaded["plain"].tolist(), "obj": loaded["obj"]}


def test_sharded_tensors_pass_through_dmuon_planners_and_metadata_has_a_version(tmp_path):
    from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION

    path = tmp_path / "st"
    for res in run_ranks(sharded_worker, 2, str(path)):
        assert res == {"equal": True, "plain": [7.0, 7.0, 7.0], "obj": {"epoch": 3}}
    metadata = pickle.loads((path / ".metadata").read_bytes())
    assert metadata.version == CURRENT_DCP_VERSION
    assert tuple(metadata.state_dict_metadata["st"].size) == (8, 4)
