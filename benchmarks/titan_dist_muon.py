"""torchtitan 0.3.0's own distributed Muon (``DistMuon``) on the tests' tiny MoE, 4 CPU ranks.

    python benchmarks/titan_dist_muon.py [--json PATH]

What it answers (issue 42, the DistMuon column): does it run on CPU ranks with expert
parallelism, does a stopped job resume bit for bit, and does its checkpoint restore (weights and
momentum) when the expert- or data-parallel degree changes. The model and Trainer are
tests/helpers/titan_trainer.py's (Qwen3 MoE, 2 blocks of 8 experts, EP 2 on dp_shard 4, i.e.
experts on an (efsdp 2, ep 2) mesh); the same checkpoint is then loaded at EP 1 x fsdp 4 and at
EP 4, and a job resumed at EP 1 is compared with the uninterrupted EP 2 job.

DistMuon is configured as torchtitan's Kimi recipe does (``models/kimi_k2_7/config_registry.py``)
with this backend's mesh names (``partial_dtensor``: dense weights on ``fsdp``, experts on
``efsdp``/``ep``): each 2-D matrix (attention, router gate) ``Owned`` on ``fsdp``: gathered whole
to one rank, Newton-Schulz there, sent back; each expert stack ``Shard(0)`` on every axis it may
be stored on: each rank orthogonalizes the experts it stores, one batched call per stack, no
communication. Embeddings, norms and the head stay on AdamW.

Two things stop DistMuon on a CPU, both checks rather than work it needs a GPU for; this script
lifts them in its own processes:

* ``DistMuon._validate_parameter_storage`` (``flex_shard/dist_muon.py``) refuses any local
  device but CUDA. Replaced by one that returns the parameters' single device.
* its bucket runtime (``flex_shard/_optimizer_reshard_runtime.py``) makes a transfer stream
  with ``Stream(device=..., priority=0)``; ``torch.cpu.Stream`` takes no ``device``. Given a
  subclass that accepts and ignores it. CPU streams and events are no-ops and gloo's
  ``all_to_all_single`` is synchronous, so the overlap machinery is inert and the order holds;
  the runtime already skips ``record_stream`` for CPU buffers.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.helpers.launch import run_ranks  # noqa: E402

sys.path.insert(0, str(ROOT / "benchmarks"))
from moe_step import allow_dist_muon_on_cpu  # noqa: E402  (the same two lifts)

STEPS, INTERVAL = 6, 3
EXPERTS = ("w1_EFD", "w2_EDF", "w3_EFD")


def dist_muon_optimizer(layers: int, lr: float = 0.02):
    """DistMuon for every block matrix and expert stack, AdamW for the rest (see the docstring)."""
    from torch.distributed.tensor import Shard
    from torchtitan.components.optimizer import OptimizersContainer, ParamGroupConfig
    from torchtitan.distributed.flex_shard import BucketConfig, ComputeLayout, Owned

    owned = ComputeLayout(shardings_by_mesh_axis={"fsdp": Owned()})
    per_expert = ComputeLayout(shardings_by_mesh_axis={"fsdp": Shard(0), "efsdp": Shard(0), "ep": Shard(0)})
    layouts = {}
    for layer in range(layers):
        block = f"layers.{layer}"
        for name in ("qkv_linear.wq", "qkv_linear.wk", "qkv_linear.wv", "wo"):
            layouts[f"{block}.attention.{name}.weight"] = owned
        layouts[f"{block}.moe.router.gate.weight"] = owned
        for name in EXPERTS:
            layouts[f"{block}.moe.routed_experts.inner_experts.{name}"] = per_expert
    matrices = r"(attention\.(qkv_linear\.w[qkv]|wo)\.weight|moe\.router\.gate\.weight|inner_experts\.w[123]_E\w\w)$"
    return OptimizersContainer.Config(
        implementation="for-loop",  # DistMuon refuses foreach and fused
        param_groups=[
            ParamGroupConfig(pattern=matrices, optimizer_name="DistMuon",
                             optimizer_kwargs={"lr": lr, "weight_decay": 0.1, "foreach": False, "fused": False}),
            ParamGroupConfig(pattern=r".*", optimizer_name="AdamW",
                             optimizer_kwargs={"lr": 1e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}),
        ],
        optimizer_factory_kwargs_by_name={"DistMuon": {
            "bucket_configs": [BucketConfig(patterns=("layers.*",), name="blocks")],
            "compute_sharding_by_fqn": layouts,
        }},
    )


def job(rank, world, folder, *, stop_after=None, **knobs):
    from tests.helpers import titan_trainer

    allow_dist_muon_on_cpu()
    config = titan_trainer.tiny_config(folder, steps=STEPS, interval=INTERVAL, muon=False, model="moe", **knobs)
    config.optimizer = dist_muon_optimizer(titan_trainer.LAYERS)
    return titan_trainer.run(config, stop_after=stop_after, optimizer_state=True)


def differing(state, reference) -> list[str]:
    import torch

    return sorted(key for key, value in reference.items()
                  if not (torch.equal(state[key], value) if isinstance(value, torch.Tensor) else state[key] == value))


def largest_relative_difference(weights, reference) -> dict[str, float]:
    """The weight farthest from its reference, by the norm of the difference over its own."""
    relative = {key: float((weights[key] - value).norm() / value.norm().clamp_min(1e-30))
                for key, value in reference.items()}
    worst = max(relative, key=relative.__getitem__)
    return {worst: relative[worst]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    ep2, report = {"expert_parallel_degree": 2}, {}
    with tempfile.TemporaryDirectory(prefix="dist-muon-") as tmp:
        tmp = Path(tmp)
        whole = run_ranks(job, 4, str(tmp / "whole"), timeout=300, **ep2)[0]
        report["optimizer"] = whole["optimizer"]
        report["losses"] = whole["losses"]
        saved = run_ranks(job, 4, str(tmp / "saved"), timeout=300, stop_after=INTERVAL, **ep2)[0]
        for name, knobs in [("ep2", ep2), ("ep1-fsdp4", {"expert_parallel_degree": 1}),
                            ("ep4", {"expert_parallel_degree": 4})]:
            shutil.copytree(tmp / "saved", tmp / name)
            loaded = run_ranks(job, 4, str(tmp / name), timeout=300, stop_after=INTERVAL, **knobs)[0]
            resumed = run_ranks(job, 4, str(tmp / name), timeout=300, **knobs)[0]
            report[f"load at {name}"] = {
                "weights differing from the saved job's": differing(loaded["weights"], saved["weights"]),
                "optimizer state differing": differing(loaded["optimizer_state"], saved["optimizer_state"]),
                "resumed losses equal the uninterrupted job's": all(
                    resumed["losses"][s] == whole["losses"][s] for s in range(INTERVAL + 1, STEPS + 1)),
                "final weights differing from the uninterrupted job's": differing(resumed["weights"], whole["weights"]),
                "largest relative difference": largest_relative_difference(resumed["weights"], whole["weights"]),
            }
    text = json.dumps(report, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text)


if __name__ == "__main__":
    main()
