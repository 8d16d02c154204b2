"""One short script for a machine with a CUDA GPU: does dmuon work there, and how fast.

    python benchmarks/gpu_check.py [--dim 1024] [--layers 4] [--out /tmp/gpu-check]

Runs as a single process (world size 1, NCCL; gloo where NCCL is missing) and prints one line
per check, then a JSON summary (also written to ``<out>/gpu_check.json``):

* train 3 steps of a transformer with dedicated projections, FSDP2 and ``dmuon.Muon`` on CUDA;
* ``dmuon.dcp.save`` / ``load`` and ``async_save`` round trips, bit-exact;
* the same blocks compiled with inductor (``block.compile(fullgraph=True)``): 10 steps against
  eager mode (relative loss difference) and the number of graphs compiled;
* device-to-host copy GiB/s into pageable and into pinned memory;
* save and load wall time against torch DCP (``dcp.save(model.state_dict())``), 3 rounds each,
  interleaved, min and median.

Nothing in CI depends on it; its figures go into docs/performance.md when a GPU is at hand.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up_proj = nn.Linear(dim, 4 * dim, bias=False)
        self.down_proj = nn.Linear(4 * dim, dim, bias=False)
        self.o_proj = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.down_proj(F.gelu(self.up_proj(self.norm(x))))
        return x + self.o_proj(x)


class Model(nn.Module):
    def __init__(self, dim: int, layers: int, vocab: int = 1024) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Block(dim) for _ in range(layers))
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def build(args, compile_blocks: bool = False):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import dmuon

    torch.manual_seed(0)
    model = Model(args.dim, args.layers).cuda()
    mesh = init_device_mesh("cuda", (1,))
    dmuon.dedicate_params(model, mesh, lambda name, p: p.ndim == 2 and "proj" in name)
    for layer in model.layers:
        if compile_blocks:
            layer.compile(fullgraph=True)
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, dmuon.Muon(model, lr=0.02, adamw_lr=1e-3)


def train(model, opt, steps: int) -> list[float]:
    losses = []
    for step in range(steps):
        gen = torch.Generator(device="cuda").manual_seed(step)
        tokens = torch.randint(0, 1024, (8, 129), device="cuda", generator=gen)
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), tokens[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def full_state(model) -> dict:
    import dmuon

    return {k: v.detach().cpu() for k, v in dmuon.get_model_state_dict(model).items()}


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def timed(fn) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def d2h_gib_per_s(nbytes: int = 1 << 30) -> dict:
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    pageable = torch.empty(nbytes, dtype=torch.uint8)
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    out = {}
    for name, dst in (("pageable", pageable), ("pinned", pinned)):
        dst.copy_(src)  # first touch
        secs = min(timed(lambda dst=dst: dst.copy_(src, non_blocking=True)) for _ in range(3))
        out[name] = round(nbytes / secs / 2**30, 2)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--out", default="/tmp/gpu-check")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gpu_check: no CUDA device")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29512")
    backend = "nccl" if dist.is_nccl_available() else "gloo"
    dist.init_process_group(backend, rank=0, world_size=1)
    torch.cuda.set_device(0)
    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    import torch.distributed.checkpoint as dcp

    import dmuon.dcp as ddcp

    summary: dict = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "backend": backend}
    model, opt = build(args)
    summary["train_losses"] = train(model, opt, 3)
    print("train 3 steps:", summary["train_losses"])

    want = full_state(model)
    ddcp.save(model, opt, str(out / "sync"))
    fresh, fresh_opt = build(args)
    ddcp.load(fresh, fresh_opt, str(out / "sync"))
    summary["save_load_bit_exact"] = same(full_state(fresh), want)
    handle = ddcp.async_save(model, opt, str(out / "async"))
    handle.wait()
    again, again_opt = build(args)
    ddcp.load(again, again_opt, str(out / "async"))
    summary["async_save_bit_exact"] = same(full_state(again), want)
    print("save/load bit-exact:", summary["save_load_bit_exact"], " async:", summary["async_save_bit_exact"])

    from torch._dynamo.utils import counters

    counters.clear()
    eager_model, eager_opt = build(args)
    eager = train(eager_model, eager_opt, 10)
    compiled_model, compiled_opt = build(args, compile_blocks=True)
    compiled = train(compiled_model, compiled_opt, 10)
    summary["compile_max_rel_loss_diff"] = max(abs(a - b) / abs(b) for a, b in zip(compiled, eager))
    summary["compile_graphs"] = counters["stats"]["unique_graphs"]
    print("inductor vs eager, max rel loss diff:", summary["compile_max_rel_loss_diff"],
          " graphs:", summary["compile_graphs"])

    summary["d2h_gib_per_s"] = d2h_gib_per_s()
    print("device-to-host GiB/s:", summary["d2h_gib_per_s"])

    times: dict[str, list[float]] = {"dmuon save": [], "torch save": [], "dmuon load": [], "torch load": []}
    for round_ in range(3):  # interleaved
        times["dmuon save"].append(timed(lambda r=round_: ddcp.save(model, opt, str(out / f"d{r}"))))
        times["torch save"].append(
            timed(lambda r=round_: dcp.save(model.state_dict(), checkpoint_id=str(out / f"t{r}")))
        )
        times["dmuon load"].append(timed(lambda r=round_: ddcp.load(fresh, fresh_opt, str(out / f"d{r}"))))
        state = fresh.state_dict()
        times["torch load"].append(
            timed(lambda r=round_, s=state: dcp.load(s, checkpoint_id=str(out / f"t{r}")))
        )
    summary["wall_s"] = {
        k: {"min": round(min(v), 3), "median": round(statistics.median(v), 3)} for k, v in times.items()
    }
    for key, value in summary["wall_s"].items():
        print(f"{key:<11} wall min {value['min']:.3f} s, median {value['median']:.3f} s")
    (out / "gpu_check.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary))
    ddcp.api.model_checkpointer(model).close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
