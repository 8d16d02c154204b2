"""Training step time: dmuon (dedicated matrices + Muon) vs plain FSDP2 + AdamW, same model.

    python benchmarks/step_time.py [--world-size 2] [--dim 256] [--layers 4] [--steps 20] [--runs 3]

"dmuon+compile" is dmuon with each block compiled in place (``block.compile()``, inductor,
before ``fully_shard``); its first 3 steps (which compile) are not counted, like every mode's.
"dmuon-ns0" is dmuon with ns_steps=0: the difference to "dmuon" is the Newton-Schulz compute,
the rest is communication and bookkeeping. All runs use the same transformer, data and mesh.
"dmuon" dedicates every attention / MLP projection (Muon on its owner, the rest FSDP2 + AdamW);
"fsdp2+adamw" shards everything with FSDP2 and steps torch.optim.AdamW. Reports the median step
time (after 3 warm-up steps) of each run and the median over runs, and the ratio."""
from __future__ import annotations

import argparse
import statistics
import time

from harness import run_ranks


def transformer(vocab: int, dim: int, layers: int, heads: int = 4):
    """A small pre-norm decoder: attention and MLP projections are the matrices Muon takes."""
    import torch.nn.functional as F
    from torch import nn

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn_norm, self.mlp_norm = nn.LayerNorm(dim), nn.LayerNorm(dim)
            self.qkv_proj = nn.Linear(dim, 3 * dim, bias=False)
            self.out_proj = nn.Linear(dim, dim, bias=False)
            self.up_proj = nn.Linear(dim, 4 * dim, bias=False)
            self.down_proj = nn.Linear(4 * dim, dim, bias=False)

        def forward(self, x):
            b, t, _ = x.shape
            q, k, v = self.qkv_proj(self.attn_norm(x)).view(b, t, 3, heads, dim // heads).unbind(2)
            att = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                 is_causal=True)
            x = x + self.out_proj(att.transpose(1, 2).reshape(b, t, dim))
            return x + self.down_proj(F.gelu(self.up_proj(self.mlp_norm(x))))

    class Decoder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(vocab, dim)
            self.layers = nn.ModuleList(Block() for _ in range(layers))
            self.norm = nn.LayerNorm(dim)
            self.lm_head = nn.Linear(dim, vocab, bias=False)

        def forward(self, tokens):  # the loss: FSDP2's hooks run around forward
            x = self.embed(tokens[:, :-1])
            for layer in self.layers:
                x = layer(x)
            logits = self.lm_head(self.norm(x))
            return F.cross_entropy(logits.reshape(-1, vocab).float(), tokens[:, 1:].reshape(-1))

    return Decoder()


def worker(rank, world, mode, dim, layers, steps):
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import dmuon

    torch.manual_seed(0)
    model = transformer(vocab=512, dim=dim, layers=layers)
    mesh = init_device_mesh("cpu", (world,))
    if mode.startswith("dmuon"):
        dmuon.dedicate_params(model, mesh, lambda n, p: p.ndim == 2 and "proj" in n)
    if mode == "dmuon+compile":
        for layer in model.layers:
            layer.compile(fullgraph=True)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if mode == "fsdp2+adamw":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    else:  # "dmuon-ns0" isolates the cost of Newton-Schulz by skipping it
        opt = dmuon.Muon(model, ns_steps=0 if mode == "dmuon-ns0" else 5)
    times = []
    gen = torch.Generator().manual_seed(rank)
    for _ in range(steps + 3):
        tokens = torch.randint(0, 512, (4, 65), generator=gen)
        t0 = time.perf_counter()
        model(tokens).backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[3:])


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    results = {"fsdp2+adamw": [], "dmuon": [], "dmuon+compile": [], "dmuon-ns0": []}
    for _ in range(args.runs):  # interleaved, so drift of the machine hits both alike
        for mode in results:
            per_rank = run_ranks(worker, args.world_size, mode, args.dim, args.layers, args.steps, timeout=1800)
            results[mode].append(max(per_rank))
    print(f"model: dim {args.dim}, {args.layers} layers; {args.world_size} CPU ranks (gloo); "
          f"{args.steps} steps per run, {args.runs} runs")
    for mode, runs in results.items():
        print(f"  {mode:<12} median step {statistics.median(runs) * 1e3:7.1f} ms   runs: "
              + ", ".join(f"{r * 1e3:.1f}" for r in runs))
    ratio = statistics.median(results["dmuon"]) / statistics.median(results["fsdp2+adamw"])
    print(f"  ratio dmuon / fsdp2+adamw: {ratio:.2f}")
    ratio = statistics.median(results["dmuon+compile"]) / statistics.median(results["dmuon"])
    print(f"  ratio dmuon+compile / dmuon: {ratio:.2f}")


if __name__ == "__main__":
    main()
