"""The DCP examples of docs/checkpoint.md run as written."""
import os

import torch

from tests.core.test_docs_examples import examples
from tests.helpers.launch import run_ranks
from tests.helpers.setup import max_abs_diff


def dcp_examples_worker(rank, world, workdir, phase, s3):
    import torch.distributed as dist

    import dmuon
    import dmuon.dcp as ddcp
    from tests.helpers.training import build, train

    os.chdir(workdir)
    model, optimizer = build()
    code = examples()
    scope = {"ddcp": ddcp, "dist": dist, "torch": torch, "model": model, "optimizer": optimizer,
             "endpoint": s3["endpoint_url"], "key": s3["key"], "secret": s3["secret"]}
    if phase == "save":
        train(model, optimizer, rank, world, range(2))
        for name in ("dcp-save", "dcp-async", "torch-dcp", "dcp-s3", "dcp-plan-cache", "dcp-key-prefixes"):
            exec(code[name], scope)
        assert scope["cache"].local_hits == 1  # the second save reused its plan
    else:
        exec(code["dcp-load"], scope)
        assert scope["step"] == 100
    return dmuon.get_model_state_dict(model)


def test_dcp_examples_run_as_written(tmp_path, s3_server):
    import fsspec

    saved = run_ranks(dcp_examples_worker, 4, tmp_path, "save", s3_server.storage_options)[0]
    for name in ("step-100", "step-200", "torch-style", "cached-300", "cached-400"):
        assert (tmp_path / "checkpoints" / name / ".metadata").exists(), name
    fs = fsspec.filesystem("s3", **s3_server.storage_options)
    assert fs.exists("my-bucket/run-7/step-100/.metadata")
    prefixed = [name.rsplit("/", 1)[-1] for name in fs.ls("my-bucket/run-8/step-100") if name.endswith(".distcp")]
    assert sorted(name[:2] for name in prefixed) == ["00", "01", "02", "03"], prefixed  # 4 ranks, 64 prefixes
    loaded = run_ranks(dcp_examples_worker, 2, tmp_path, "load", s3_server.storage_options)[0]
    assert max_abs_diff(loaded, saved) == 0.0
    # plain torch, no dmuon objects: the "plain-torch" example
    from tests.helpers.models import TinyTransformer

    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        import torch.distributed.checkpoint as dcp

        scope = {"plain_model": TinyTransformer(), "dcp": dcp}
        exec(examples()["plain-torch"], scope)
    finally:
        os.chdir(cwd)
    assert max_abs_diff(scope["plain_model"].state_dict(), saved) == 0.0
