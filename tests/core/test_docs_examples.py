"""Every example in docs/checkpoint.md runs as written (on gloo/CPU ranks)."""
import os
import re
from pathlib import Path

import torch

from tests.helpers.launch import run_ranks

DOC = Path(__file__).resolve().parents[2] / "docs" / "checkpoint.md"


def examples(doc: Path = DOC) -> dict[str, str]:
    """The ``<!-- example: name -->`` python blocks of a document, by name."""
    text = doc.read_text()
    return dict(re.findall(r"<!-- example: ([\w-]+) -->\n```python\n(.*?)```", text, re.S))


def flat_examples_worker(rank, world, workdir, phase):
    import torch.distributed as dist
    from safetensors.torch import save_file

    import dmuon
    from tests.helpers.models import TinyTransformer
    from tests.helpers.training import build, train

    os.chdir(workdir)
    model, optimizer = build()
    code = examples()
    scope = {"dmuon": dmuon, "dist": dist, "torch": torch, "model": model, "optimizer": optimizer}
    if phase == "save":
        train(model, optimizer, rank, world, range(2))
        scope["step"] = 2
        exec(code["flat-save"], scope)
        if rank == 0:
            torch.manual_seed(1)
            save_file(TinyTransformer().state_dict(), "model.safetensors")
        dist.barrier()
        return dmuon.get_model_state_dict(model)
    exec(code[phase], scope)
    return {"model": dmuon.get_model_state_dict(model), "step": scope.get("step")}


def test_doc_has_the_examples():
    assert {"flat-save", "flat-load", "flat-pretrained", "flat-other-topology"} <= set(examples())


def test_flat_examples_run_as_written(tmp_path):
    from safetensors.torch import load_file

    saved = run_ranks(flat_examples_worker, 4, tmp_path, "save")[0]
    assert set(saved) and (tmp_path / "checkpoint.pt").exists()
    resumed = run_ranks(flat_examples_worker, 2, tmp_path, "flat-load")[0]
    assert resumed["step"] == 2
    assert all(torch.equal(resumed["model"][k], saved[k]) for k in saved)
    other = run_ranks(flat_examples_worker, 1, tmp_path, "flat-other-topology")[0]
    assert all(torch.equal(other["model"][k], saved[k]) for k in saved)
    pretrained = run_ranks(flat_examples_worker, 2, tmp_path, "flat-pretrained")[0]
    weights = load_file(tmp_path / "model.safetensors")
    assert all(torch.equal(pretrained["model"][k], weights[k]) for k in weights)
