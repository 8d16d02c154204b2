"""The main job: train a small transformer with dmuon on 2 CPU ranks and report.

    python -m dmuon.demo [--steps 40] [--world-size 2]

Each rank runs the seed's recipe: ``dedicate_params`` for the attention / MLP projections,
``fully_shard`` for the rest, one ``dmuon.Muon`` optimizer. The data is a synthetic language
(each token is a fixed function of the two before it) that a small model learns quickly, so the
loss table visibly goes down.
"""
from __future__ import annotations

import argparse
import os
import socket
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import dmuon

VOCAB, DIM, LAYERS, HEADS, SEQ, PER_RANK_BATCH = 96, 64, 2, 4, 32, 8


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn_norm = nn.LayerNorm(DIM)
        self.qkv_proj = nn.Linear(DIM, 3 * DIM, bias=False)
        self.out_proj = nn.Linear(DIM, DIM, bias=False)
        self.mlp_norm = nn.LayerNorm(DIM)
        self.up_proj = nn.Linear(DIM, 4 * DIM, bias=False)
        self.down_proj = nn.Linear(4 * DIM, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv_proj(self.attn_norm(x)).view(b, t, 3, HEADS, DIM // HEADS).unbind(2)
        att = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.out_proj(att.transpose(1, 2).reshape(b, t, DIM))
        return x + self.down_proj(F.gelu(self.up_proj(self.mlp_norm(x))))


class DemoLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.pos = nn.Parameter(torch.randn(SEQ, DIM) * 0.02)
        self.layers = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm = nn.LayerNorm(DIM)
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))


def is_dedicated(name: str, param: torch.Tensor) -> bool:
    return param.ndim == 2 and name.endswith("proj.weight")


def synthetic_batch(step: int, rank: int) -> torch.Tensor:
    """Sequences with t[i] = (t[i-1] + t[i-2] * 3) mod VOCAB: learnable, never repeated."""
    gen = torch.Generator().manual_seed(step * 1000 + rank)
    tokens = torch.empty(PER_RANK_BATCH, SEQ + 1, dtype=torch.long)
    tokens[:, :2] = torch.randint(0, VOCAB, (PER_RANK_BATCH, 2), generator=gen)
    for i in range(2, SEQ + 1):
        tokens[:, i] = (tokens[:, i - 1] + 3 * tokens[:, i - 2]) % VOCAB
    return tokens


def build(mesh):
    torch.manual_seed(0)
    model = DemoLM()
    owners = dmuon.dedicate_params(model, mesh, is_dedicated)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = dmuon.Muon(model, lr=0.02, adamw_lr=3e-3)
    return model, optimizer, owners


def train_steps(model, optimizer, start: int, stop: int, rank: int) -> list[tuple[int, float, float]]:
    rows = []
    for step in range(start, stop):
        t0 = time.perf_counter()
        tokens = synthetic_batch(step, rank)
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        rows.append((step, mean.item() / dist.get_world_size(), time.perf_counter() - t0))
    return rows


def run(rank: int, world_size: int, port: int, args: argparse.Namespace) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world_size))
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=300))
    try:
        mesh = init_device_mesh("cpu", (world_size,))
        model, optimizer, owners = build(mesh)
        rows = train_steps(model, optimizer, 0, args.steps, rank)
        if rank == 0:
            print(f"dmuon demo: {world_size} CPU ranks, {len(owners)} dedicated matrices (Muon), "
                  f"the rest FSDP2 + AdamW")
            for fqn, owner in list(owners.items())[:4]:
                print(f"  owner of {fqn}: shard rank {owner[1]}")
            print(f"\n{'step':>5} {'loss':>8} {'ms':>7}")
            for step, loss, secs in rows:
                if step % 5 == 0 or step == args.steps - 1:
                    print(f"{step:>5} {loss:>8.4f} {secs * 1e3:>7.1f}")
            first, last = rows[0][1], rows[-1][1]
            verdict = "goes down" if last < first else "DID NOT go down"
            print(f"\nloss {first:.3f} -> {last:.3f}: {verdict}")
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m dmuon.demo", description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--world-size", type=int, default=2)
    args = parser.parse_args(argv)
    mp.spawn(run, args=(args.world_size, free_port(), args), nprocs=args.world_size, join=True)


if __name__ == "__main__":
    main()
