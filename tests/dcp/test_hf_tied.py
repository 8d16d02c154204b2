"""HuggingFace checkpoints with tied embeddings (``save_pretrained`` leaves ``lm_head.weight``
out) load into dmuon models on every door, and a key that is really missing still fails."""
import pytest
import torch

import dmuon
import dmuon.dcp as ddcp
from dmuon.dcp.errors import CheckpointMismatchError
from dmuon.state_dict import StateDictError
from tests.helpers.launch import run_ranks
from tests.helpers.setup import max_abs_diff

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

VOCAB = 64
ALIAS = "lm_head.weight"
FIRST = "model.embed_tokens.weight"


def tiny(arch: str, tie: bool = True):
    """A tiny model of ``arch`` ("llama" or "qwen2"), embeddings tied unless ``tie`` is False."""
    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                  tie_word_embeddings=tie)
    if arch == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common))


def dmuon_model(arch: str, dedicate_embedding: bool):
    """The same architecture on every rank: projections dedicated (and the tied embedding too
    when ``dedicate_embedding``), the rest FSDP2-sharded; initial values differ from the file's."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(1000 + dist.get_rank())
    model = tiny(arch)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))

    def predicate(name, param):
        return param.ndim == 2 and (name.endswith("proj.weight") or (dedicate_embedding and "embed" in name))

    dmuon.dedicate_params(model, mesh, predicate)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def tied_load_worker(rank, world, arch, hf_dir, source, sharded_file_dir):
    """Load the same weights through each door into two dmuon models; logits and full state
    dicts of each, and the logits of transformers' own load in this process for reference."""
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(5))
    reference = type(tiny(arch)).from_pretrained(hf_dir)
    out = {}
    for dedicate_embedding in (False, True):
        for door in ("dcp.load", "dcp.load file", "dcp.load sharded", "set_model_state_dict"):
            model = dmuon_model(arch, dedicate_embedding)
            if door == "dcp.load":
                ddcp.load(model, None, source)
            elif door == "dcp.load file":
                ddcp.load(model, None, f"{hf_dir}/model.safetensors")
            elif door == "dcp.load sharded":
                ddcp.load(model, None, sharded_file_dir)
            else:
                dmuon.set_model_state_dict(model, safetensors_torch.load_file(f"{source}/model.safetensors"))
            with torch.no_grad():
                logits = model(input_ids=ids).logits
            out[(dedicate_embedding, door)] = {"logits": logits, "state": dmuon.get_model_state_dict(model)}
    with torch.no_grad():
        out["reference"] = reference(input_ids=ids).logits
    # a key no present key names is still missing, on the dmuon model as on any other
    model = dmuon_model(arch, dedicate_embedding=True)
    weights = safetensors_torch.load_file(f"{hf_dir}/model.safetensors")
    del weights["model.norm.weight"]
    with pytest.raises(StateDictError, match=r"missing keys \(1\): model\.norm\.weight$"):
        dmuon.set_model_state_dict(model, weights)
    return out


def save_variants(tmp_path, arch):
    """(pretrained model, its save_pretrained dir, a dir holding only the alias, a sharded dir)."""
    torch.manual_seed(7)
    pretrained = tiny(arch)
    hf_dir = tmp_path / "pretrained"
    pretrained.save_pretrained(hf_dir)
    weights = safetensors_torch.load_file(hf_dir / "model.safetensors")
    assert FIRST in weights and ALIAS not in weights  # what save_pretrained does with tied weights
    alias_only = tmp_path / "alias-only"
    alias_only.mkdir()
    weights[ALIAS] = weights.pop(FIRST)
    safetensors_torch.save_file(weights, alias_only / "model.safetensors")
    sharded = tmp_path / "sharded"
    pretrained.save_pretrained(sharded, max_shard_size="20KB")
    assert (sharded / "model.safetensors.index.json").exists()
    return pretrained, hf_dir, alias_only, sharded


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tied_hf_checkpoint_loads_bit_exact_on_every_door(tmp_path, arch):
    pretrained, hf_dir, alias_only, sharded = save_variants(tmp_path, arch)
    # the saved file holds the first name in one variant and only the alias in the other
    source = str(hf_dir if arch == "llama" else alias_only)
    results = run_ranks(tied_load_worker, 2, arch, str(hf_dir), source, str(sharded), timeout=180)
    want = pretrained.state_dict()
    for rank, out in enumerate(results):
        reference = out.pop("reference")
        for case, got in out.items():
            assert torch.equal(got["logits"], reference), (rank, case)
            if rank == 0:
                assert max_abs_diff(got["state"], want) == 0.0, case
                assert set(got["state"]) == set(want), case


def test_tied_hf_checkpoint_loads_into_a_plain_module(tmp_path):
    """No dmuon runtime, no process group: the HF door of ``ddcp.load`` alone."""
    pretrained, hf_dir, alias_only, _ = save_variants(tmp_path, "llama")
    for source in (hf_dir, alias_only):
        torch.manual_seed(3)
        model = tiny("llama")
        ddcp.load(model, None, source)
        assert model.lm_head.weight is model.model.embed_tokens.weight
        assert max_abs_diff(model.state_dict(), pretrained.state_dict()) == 0.0


def test_really_missing_keys_still_fail_naming_them(tmp_path):
    torch.manual_seed(7)
    tiny("qwen2").save_pretrained(tmp_path / "tied")
    # an untied model needs its own lm_head: the tied file does not have it
    untied = tiny("qwen2", tie=False)
    with pytest.raises(CheckpointMismatchError, match=r"missing keys \(1\): lm_head\.weight$"):
        ddcp.load(untied, None, tmp_path / "tied")
    with pytest.raises(StateDictError, match=r"missing keys \(1\): lm_head\.weight$"):
        dmuon.set_model_state_dict(untied, safetensors_torch.load_file(tmp_path / "tied" / "model.safetensors"))
    # a tied model whose file lacks a key no other key names
    weights = safetensors_torch.load_file(tmp_path / "tied" / "model.safetensors")
    del weights["model.layers.1.self_attn.q_proj.bias"]
    safetensors_torch.save_file(weights, tmp_path / "partial.safetensors")
    with pytest.raises(CheckpointMismatchError, match=r"missing keys \(1\): model\.layers\.1\.self_attn\.q_proj\.bias"):
        ddcp.load(tiny("qwen2"), None, tmp_path / "partial.safetensors")
    ddcp.load(tiny("qwen2"), None, tmp_path / "partial.safetensors", allow_partial_load=True)
