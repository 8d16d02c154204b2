"""HuggingFace interop with a real client: transformers' LlamaForCausalLM (no download)."""
import pytest
import torch

import dmuon
import dmuon.dcp as ddcp
from tests.helpers.launch import run_ranks
from tests.helpers.setup import max_abs_diff

transformers = pytest.importorskip("transformers")


def tiny_config():
    return transformers.LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)


def llama_on_ranks(seed=0):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(tiny_config())
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    dmuon.dedicate_params(model, mesh, lambda n, p: p.ndim == 2 and n.endswith("proj.weight"))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, dmuon.Muon(model, lr=0.02, adamw_lr=1e-3)


def train_and_export_worker(rank, world, ckpt, out_dir):
    model, opt = llama_on_ranks()
    for step in range(3):
        ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(step * 10 + rank))
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    ddcp.save(model, opt, ckpt)
    full = dmuon.get_model_state_dict(model)
    if rank == 0:
        ddcp.export(ckpt, out_dir)
        tiny_config().save_pretrained(out_dir)
    return full


def test_export_loads_in_transformers_from_pretrained(tmp_path):
    out_dir = tmp_path / "hf"
    full = run_ranks(train_and_export_worker, 2, str(tmp_path / "ckpt"), str(out_dir), timeout=180)[0]
    loaded = transformers.LlamaForCausalLM.from_pretrained(out_dir)
    reference = transformers.LlamaForCausalLM(tiny_config())
    reference.load_state_dict(full)
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(99))
    with torch.no_grad():
        got, want = loaded(input_ids=ids).logits, reference(input_ids=ids).logits
    assert torch.equal(got, want)
    assert max_abs_diff(loaded.state_dict(), full) == 0.0


def hf_load_worker(rank, world, hf_dir):
    model, opt = llama_on_ranks(seed=1)  # other initial values: the load must replace them all
    ddcp.load(model, None, hf_dir)
    return dmuon.get_model_state_dict(model)


@pytest.mark.parametrize("world", [2, 4])
def test_pretrained_safetensors_load_into_dmuon(tmp_path, world):
    torch.manual_seed(7)
    pretrained = transformers.LlamaForCausalLM(tiny_config())
    pretrained.save_pretrained(tmp_path / "pretrained")
    got = run_ranks(hf_load_worker, world, str(tmp_path / "pretrained"), timeout=180)[0]
    assert max_abs_diff(got, pretrained.state_dict()) == 0.0


def bytes_read_worker(rank, world, path):
    import psutil

    from tests.helpers.models import Wide
    from tests.helpers.setup import make_mesh, shard_model

    torch.manual_seed(1)
    model = Wide()
    shard_model(model, make_mesh(), lambda n, p: int(n.split(".")[1]) % 2 == 0, wrap=("blocks",))
    before = psutil.Process().io_counters().read_chars
    ddcp.load(model, None, path)
    read = psutil.Process().io_counters().read_chars - before
    return {"read": read, "state": dmuon.get_model_state_dict(model)}


def test_each_rank_reads_only_its_bytes(tmp_path):
    from safetensors.torch import save_file

    from tests.helpers.models import Wide

    torch.manual_seed(3)
    weights = Wide().state_dict()
    path = tmp_path / "model.safetensors"
    save_file(weights, path)
    size = path.stat().st_size
    results = run_ranks(bytes_read_worker, 4, str(path))
    assert max_abs_diff(results[0]["state"], weights) == 0.0
    for rank, res in enumerate(results):
        # its two dedicated matrices plus a quarter of the eight FSDP2 ones = 4/16 of the file
        assert res["read"] < 0.35 * size, (rank, res["read"], size)
