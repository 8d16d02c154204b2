"""Scenario 7: loading into the wrong model: every mismatch in one error, nothing changed;
with ``allow_partial_load=True`` the listed keys are skipped and the rest loads."""
import hashlib

import torch

import dmuon
import dmuon.dcp as ddcp
from tests.helpers.launch import run_ranks
from tests.helpers.models import TinyTransformer
from tests.helpers.setup import make_mesh, shard_model
from tests.helpers.training import build, train


class WrongModel(TinyTransformer):
    """Every kind of mismatch at once, against a TinyTransformer checkpoint."""

    def __init__(self):
        super().__init__()
        self.extra_head = torch.nn.Linear(32, 8)                       # missing from the checkpoint
        del self.layers[1].o_proj                                     # checkpoint has keys the model lacks
        self.layers[1].o_proj = torch.nn.Identity()
        self.layers[0].up_proj = torch.nn.Linear(32, 40, bias=False)  # wrong shape
        self.layers[0].mlp_norm.double()                              # wrong dtype


# a different dedicated predicate: q_proj goes to FSDP2/AdamW, lm_head becomes dedicated
OTHER_PREDICATE = lambda n, p: p.ndim == 2 and (("proj" in n and "q_proj" not in n) or n == "lm_head.weight")  # noqa: E731


def digest(model, opt) -> str:
    h = hashlib.sha256()
    state = dmuon.get_model_state_dict(model, rank0_only=False)
    optim = dmuon.get_optimizer_state_dict(model, opt, rank0_only=False)
    for key in sorted(state):
        h.update(key.encode() + state[key].numpy().tobytes())
    for section in ("fsdp2", "dedicated"):
        for fqn in sorted(optim[section]):
            for name in sorted(optim[section][fqn]):
                h.update(f"{fqn}.{name}".encode() + optim[section][fqn][name].numpy().tobytes())
    return h.hexdigest()


def save_worker(rank, world, path):
    model, opt = build()
    train(model, opt, rank, world, range(2))
    ddcp.save(model, opt, path)
    return dmuon.get_model_state_dict(model)


def wrong_worker(rank, world, path):
    torch.manual_seed(0)
    model = WrongModel()
    _, opt = shard_model(model, make_mesh(), OTHER_PREDICATE)
    before = digest(model, opt)
    try:
        ddcp.load(model, opt, path)
        error = None
    except ddcp.CheckpointMismatchError as exc:
        error = str(exc)
    unchanged = digest(model, opt) == before
    ddcp.load(model, opt, path, allow_partial_load=True)
    partial = dmuon.get_model_state_dict(model)
    return {"error": error, "unchanged": unchanged, "partial": partial}


EXPECTED_IN_ERROR = [
    "model.extra_head.weight: missing from the checkpoint",
    "model.layers.1.o_proj.weight: in the checkpoint but not in the model",
    "model.layers.0.up_proj.weight: shape (48, 32) in the checkpoint, (40, 32) in the model",
    "model.layers.0.mlp_norm.weight: dtype float32 in the checkpoint, float64 in the model",
    "optim.state.layers.0.q_proj.weight.exp_avg: missing from the checkpoint",
    "optim.state.layers.0.q_proj.weight.momentum_buffer: in the checkpoint but not in the model",
    "optim.state.lm_head.weight.momentum_buffer: missing from the checkpoint",
]


def test_wrong_model_one_error_unchanged_then_partial_load(tmp_path, reliability_report):
    path = str(tmp_path / "ckpt")
    saved = run_ranks(save_worker, 2, path)[0]
    results = run_ranks(wrong_worker, 2, path)
    for res in results:
        assert res["error"] is not None
        for line in EXPECTED_IN_ERROR:
            assert line in res["error"], (line, res["error"])
        assert res["unchanged"]
    partial = results[0]["partial"]
    # what fits was loaded; what did not keeps the wrong model's own values
    for key in ("embed.weight", "layers.0.q_proj.weight", "layers.1.up_proj.weight", "lm_head.weight"):
        assert torch.equal(partial[key], saved[key]), key
    assert torch.equal(partial["layers.0.mlp_norm.weight"], torch.ones(32, dtype=torch.float64))  # skipped
    assert not torch.equal(saved["layers.0.mlp_norm.weight"], torch.ones(32))
    reliability_report["wrong_model"] = {
        "mismatch_kinds": 5, "reported_in_one_error": len(EXPECTED_IN_ERROR),
        "model_and_optimizer_unchanged": all(r["unchanged"] for r in results), "partial_load": "rest loaded"}
