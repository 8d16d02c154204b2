"""Exports that transformers' ``from_pretrained(OUT)`` opens with no other argument: the model's
config copied beside the weights with its dtype set, through the CLI as users run it."""
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

import dmuon
import dmuon.dcp as ddcp
from dmuon.dcp.format.layout import HF_CONFIG_FILE, HF_GENERATION_CONFIG_FILE
from dmuon.dcp.hf_config import MissingConfigWarning, read_hf_config, with_dtype
from tests.helpers.launch import run_ranks
from tests.helpers.setup import max_abs_diff

transformers = pytest.importorskip("transformers")

VOCAB = 64


def tiny_config():
    return transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True)


def train_worker(rank, world, hf_dir, ckpt):
    """Pretrained HF weights into a dmuon model (the tied embedding dedicated too), two steps of
    training, a dmuon checkpoint; the trained weights in full."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = transformers.LlamaForCausalLM(tiny_config())
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    dmuon.dedicate_params(model, mesh, lambda n, p: p.ndim == 2 and ("proj" in n or "embed" in n))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    ddcp.load(model, None, hf_dir)
    optimizer = dmuon.Muon(model, lr=0.02, adamw_lr=1e-3)
    for step in range(2):
        ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(step * 10 + rank))
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    ddcp.save(model, optimizer, ckpt)
    return dmuon.get_model_state_dict(model)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(checkpoint, the pretrained model's folder, the trained weights)."""
    root = tmp_path_factory.mktemp("export-hf")
    torch.manual_seed(11)
    transformers.LlamaForCausalLM(tiny_config()).save_pretrained(root / "pretrained")
    assert (root / "pretrained" / HF_GENERATION_CONFIG_FILE).exists()
    ckpt = root / "ckpt"
    full = run_ranks(train_worker, 2, str(root / "pretrained"), str(ckpt), timeout=180)[0]
    return ckpt, root / "pretrained", full


def dmuon_ckpt(*args):
    """The installed console script, as users run it."""
    argv = [str(Path(sys.executable).parent / "dmuon-ckpt"), *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=120)


def logits(model):
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(99))
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_cli_export_with_config_opens_in_from_pretrained_bit_exact(trained, tmp_path):
    ckpt, pretrained, full = trained
    out = tmp_path / "out"
    res = dmuon_ckpt("export", str(ckpt), str(out), "--config", str(pretrained))
    assert res.returncode == 0, res.stderr
    assert f"{out}/{HF_CONFIG_FILE}" in res.stdout and f"{out}/{HF_GENERATION_CONFIG_FILE}" in res.stdout
    assert "note:" not in res.stderr
    config = json.loads((out / HF_CONFIG_FILE).read_text())
    assert config["dtype"] == "float32" and "torch_dtype" not in config
    assert (out / HF_GENERATION_CONFIG_FILE).read_bytes() == (pretrained / HF_GENERATION_CONFIG_FILE).read_bytes()
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert type(loaded).__name__ == "LlamaForCausalLM" and loaded.dtype == torch.float32
    reference = transformers.LlamaForCausalLM(tiny_config())
    reference.load_state_dict(full)
    assert max_abs_diff(loaded.state_dict(), full) == 0.0
    assert torch.equal(logits(loaded), logits(reference))


def test_cli_bfloat16_export_names_its_dtype_in_the_config(trained, tmp_path):
    ckpt, pretrained, full = trained
    out = tmp_path / "bf16"
    res = dmuon_ckpt("export", str(ckpt), str(out), "--dtype", "bfloat16", "--max-shard-size", "20KB",
                     "--config", str(pretrained / HF_CONFIG_FILE))
    assert res.returncode == 0, res.stderr
    assert (out / "model.safetensors.index.json").exists()
    assert json.loads((out / HF_CONFIG_FILE).read_text())["dtype"] == "bfloat16"
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert loaded.dtype == torch.bfloat16
    assert all(torch.equal(loaded.state_dict()[k], v.to(torch.bfloat16)) for k, v in full.items())


def test_export_without_config_says_from_pretrained_needs_one(trained, tmp_path):
    ckpt, _, _ = trained
    res = dmuon_ckpt("export", str(ckpt), str(tmp_path / "cli"))
    assert res.returncode == 0, res.stderr
    assert "note:" in res.stderr and "from_pretrained will need one" in res.stderr and "--config PATH" in res.stderr
    assert not (tmp_path / "cli" / HF_CONFIG_FILE).exists()
    with pytest.warns(MissingConfigWarning, match=r"from_pretrained will need one; pass .* config=PATH"):
        ddcp.export(ckpt, tmp_path / "py")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ddcp.export(ckpt, tmp_path / "m.pt", format="torch")  # not a from_pretrained folder: no note


def test_a_bad_config_stops_the_export_before_any_file(trained, tmp_path):
    ckpt = trained[0]
    (tmp_path / "broken.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"broken\.json is not valid JSON"):
        ddcp.export(ckpt, tmp_path / "a", config=tmp_path / "broken.json")
    with pytest.raises(FileNotFoundError, match=r"empty/config\.json \(a folder given as the config"):
        ddcp.export(ckpt, tmp_path / "b", config=tmp_path / "empty")
    res = dmuon_ckpt("export", str(ckpt), str(tmp_path / "c"), "--config", str(tmp_path / "nothing.json"))
    assert res.returncode == 1 and "nothing.json" in res.stderr
    assert not any((tmp_path / name).exists() for name in "abc")


def test_config_goes_beside_weights_on_object_storage(trained, s3_server):
    import fsspec

    ckpt, pretrained, _ = trained
    url = s3_server.url()
    files = ddcp.export(ckpt, url, dtype="bfloat16", config=pretrained,
                        output_storage_options=s3_server.storage_options)
    assert [f.rsplit("/", 1)[1] for f in files] == ["model.safetensors", HF_CONFIG_FILE, HF_GENERATION_CONFIG_FILE]
    fs = fsspec.filesystem("s3", **s3_server.storage_options)
    config = json.loads(fs.cat(f"{url}/{HF_CONFIG_FILE}"))
    assert config["dtype"] == "bfloat16" and config["model_type"] == "llama"
    assert fs.cat(f"{url}/{HF_GENERATION_CONFIG_FILE}") == (pretrained / HF_GENERATION_CONFIG_FILE).read_bytes()


def test_dtype_fields_set_where_they_are():
    assert with_dtype({"torch_dtype": "float32"}, torch.bfloat16) == {"torch_dtype": "bfloat16"}
    assert with_dtype({"dtype": "float32", "torch_dtype": "float32"}, torch.float16) == {
        "dtype": "float16", "torch_dtype": "float16"}
    assert with_dtype({"model_type": "llama"}, torch.bfloat16) == {"model_type": "llama", "dtype": "bfloat16"}
    composite = {"dtype": "float32", "text_config": {"model_type": "x", "dtype": "float32"}, "vision_config": {
        "model_type": "y"}}
    assert with_dtype(composite, torch.bfloat16) == {
        "dtype": "bfloat16", "text_config": {"model_type": "x", "dtype": "bfloat16"},
        "vision_config": {"model_type": "y"}}
    assert with_dtype({"dtype": {"text": "float32", "vision": "float32"}}, torch.bfloat16) == {
        "dtype": {"text": "bfloat16", "vision": "bfloat16"}}


def test_read_config_from_a_file_or_its_folder(tmp_path):
    tiny_config().save_pretrained(tmp_path)
    by_folder, by_file = read_hf_config(tmp_path), read_hf_config(tmp_path / HF_CONFIG_FILE)
    assert by_folder.document == by_file.document and by_folder.document["model_type"] == "llama"
    assert by_folder.generation is None  # a config alone: save_pretrained of a config writes no generation config


# ---------------------------------------------------------------------------------------------
# docs/export.md, "From and to HuggingFace": the recipes run as written
# ---------------------------------------------------------------------------------------------
DOC = Path(__file__).resolve().parents[2] / "docs" / "export.md"


def doc_blocks(kind: str, language: str) -> dict[str, str]:
    """The ``<!-- kind: name -->`` blocks of docs/export.md in ``language``, by name."""
    import re

    return dict(re.findall(rf"<!-- {kind}: ([\w-]+) -->\n```{language}\n(.*?)```", DOC.read_text(), re.S))


def docs_worker(rank, world, workdir):
    """In ``workdir`` (which holds ``path/to/hf-model``): the load recipe into a dmuon model, a
    step of training, a dmuon checkpoint at ``checkpoints/step-1000``, the rank-0 save recipe."""
    import os

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    os.chdir(workdir)
    model = transformers.LlamaForCausalLM(tiny_config())
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    dmuon.dedicate_params(model, mesh, lambda n, p: p.ndim == 2 and "proj" in n)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    examples = doc_blocks("example", "python")
    scope = {"ddcp": ddcp, "dmuon": dmuon, "dist": dist, "model": model}
    exec(examples["hf-load"], scope)
    loaded = dmuon.get_model_state_dict(model)
    optimizer = dmuon.Muon(model, lr=0.02, adamw_lr=1e-3)
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(rank))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    ddcp.save(model, optimizer, "checkpoints/step-1000")
    exec(examples["hf-save-rank0"], scope)
    dist.barrier()
    return {"loaded": loaded, "trained": dmuon.get_model_state_dict(model)}


def test_doc_recipes_run_as_written(tmp_path):
    assert {"hf-load", "hf-save-rank0"} <= set(doc_blocks("example", "python"))
    torch.manual_seed(5)
    pretrained = transformers.LlamaForCausalLM(tiny_config())
    pretrained.save_pretrained(tmp_path / "path" / "to" / "hf-model")
    result = run_ranks(docs_worker, 2, str(tmp_path), timeout=180)[0]
    assert max_abs_diff(result["loaded"], pretrained.state_dict()) == 0.0
    script = doc_blocks("command", "sh")["hf-export"]
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    res = subprocess.run(["bash", "-euo", "pipefail", "-c", script], capture_output=True, text=True,
                         timeout=120, env=env, cwd=tmp_path)
    assert res.returncode == 0, f"{script}\n{res.stderr}"
    trained = transformers.LlamaForCausalLM(tiny_config())
    trained.load_state_dict(result["trained"])
    for out in ("hf-out", "hf-saved"):
        loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / out)
        assert max_abs_diff(loaded.state_dict(), result["trained"]) == 0.0, out
        assert torch.equal(logits(loaded), logits(trained)), out
