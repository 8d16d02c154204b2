"""The main job: train a small transformer with dmuon on 2 CPU ranks, checkpoint, crash, resume.

    python -m dmuon.demo [--steps 40] [--save-every 10] [--crash-at 27]
                         [--checkpoint-dir ./checkpoints | s3://bucket/prefix] [--storage-option k=v]

Each rank runs the seed's recipe: ``dedicate_params`` for the attention / MLP projections,
``fully_shard`` for the rest, one ``dmuon.Muon`` optimizer. The data is a synthetic language
(each token is a fixed function of the two before it) that a small model learns quickly.

Three runs: (1) a reference run straight through; (2) the same run with a CheckpointManager
saving every few steps, killed by a simulated crash (one rank SIGKILLs itself); (3) fresh
processes that resume from the newest committed checkpoint and finish. The resumed run must end
bit-identical to the reference. The final checkpoint is then exported to safetensors.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import dmuon

__all__ = ["main"]

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


def _reference(rank: int, world_size: int, args, out_dir: str) -> None:
    mesh = init_device_mesh("cpu", (world_size,))
    model, optimizer, owners = build(mesh)
    rows = train_steps(model, optimizer, 0, args.steps, rank)
    state = dmuon.get_model_state_dict(model)
    if rank == 0:
        torch.save({"rows": rows, "state": state, "owners": owners}, os.path.join(out_dir, "reference.pt"))


def _crashing(rank: int, world_size: int, args, out_dir: str) -> None:
    import signal

    import dmuon.dcp as ddcp

    mesh = init_device_mesh("cpu", (world_size,))
    model, optimizer, _ = build(mesh)
    manager = ddcp.CheckpointManager(args.run_dir, keep=2, storage_options=args.storage_options)
    save_times = []
    for step in range(args.steps):
        if step == args.crash_at and rank == world_size - 1:
            os.kill(os.getpid(), signal.SIGKILL)  # the simulated crash: no cleanup, no goodbye
        train_steps(model, optimizer, step, step + 1, rank)
        if (step + 1) % args.save_every == 0:
            t0 = time.perf_counter()
            manager.save(step + 1, model, optimizer, extra={"step": step + 1})
            save_times.append(time.perf_counter() - t0)
            if rank == 0:
                torch.save(save_times, os.path.join(out_dir, "save_times.pt"))


def _resumed(rank: int, world_size: int, args, out_dir: str) -> None:
    import dmuon.dcp as ddcp

    mesh = init_device_mesh("cpu", (world_size,))
    model, optimizer, _ = build(mesh)
    manager = ddcp.CheckpointManager(args.run_dir, keep=2, storage_options=args.storage_options)
    t0 = time.perf_counter()
    start = manager.resume(model, optimizer)
    load_secs = time.perf_counter() - t0
    if start is None:  # the crashing run committed checkpoints: not finding one is a failure
        raise RuntimeError(f"no committed checkpoint under {args.run_dir} to resume from")
    rows = train_steps(model, optimizer, start, args.steps, rank)
    manager.save(args.steps, model, optimizer, extra={"step": args.steps})
    state = dmuon.get_model_state_dict(model)
    if rank == 0:
        torch.save(
            {"rows": rows, "state": state, "start": start, "load_secs": load_secs}, os.path.join(out_dir, "resumed.pt")
        )


PHASES = {"reference": _reference, "crashing": _crashing, "resumed": _resumed}


def run(rank: int, world_size: int, port: int, phase: str, args: argparse.Namespace, out_dir: str) -> None:
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world_size))
    # the rendezvous given to torch, not written into the process's environment
    store = dist.TCPStore("127.0.0.1", port, world_size, is_master=rank == 0, timeout=timedelta(seconds=300))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=300))
    try:
        PHASES[phase](rank, world_size, args, out_dir)
    finally:
        dist.destroy_process_group()
    # The work is done and saved. Skip the interpreter's teardown: now and then a C++ thread
    # of the process group is still joinable there and aborts (SIGABRT) a finished rank.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _spawn(phase: str, args, out_dir: str) -> None:
    mp.spawn(run, args=(args.world_size, free_port(), phase, args, out_dir), nprocs=args.world_size, join=True)


def _print_losses(rows, every: int = 5) -> None:
    print(f"{'step':>6} {'loss':>8} {'ms/step':>8}")
    for step, loss, secs in rows:
        if step % every == 0 or step == rows[-1][0]:
            print(f"{step:>6} {loss:>8.4f} {secs * 1e3:>8.1f}")


def main(argv: list[str] | None = None) -> int:
    import tempfile

    from .dcp import export, inspect
    from .dcp.cli import storage_options_from_pairs
    from .dcp.hf_config import MissingConfigWarning
    from .dcp.storage.registry import absolute

    parser = argparse.ArgumentParser(prog="python -m dmuon.demo", description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--save-every", type=int, default=10)
    parser.add_argument("--crash-at", type=int, default=27)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--checkpoint-dir", default="./checkpoints")
    parser.add_argument("--storage-option", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args(argv)
    if not 0 < args.crash_at < args.steps or args.crash_at < args.save_every:
        parser.error("--crash-at must fall after the first checkpoint and before the last step")
    try:
        args.storage_options = storage_options_from_pairs(args.storage_option)
    except ValueError as exc:
        parser.error(str(exc))
    base = absolute(args.checkpoint_dir)
    args.run_dir = f"{base}/run-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"

    with tempfile.TemporaryDirectory(prefix="dmuon-demo-") as out_dir:
        print(f"dmuon demo: {args.world_size} CPU ranks (gloo), {args.steps} steps; checkpoints in {args.run_dir}")
        print("\n[1/3] reference run, straight through")
        _spawn("reference", args, out_dir)
        reference = torch.load(os.path.join(out_dir, "reference.pt"))
        owners = reference["owners"]
        print(f"  {len(owners)} dedicated matrices trained with Muon by their owners, the rest FSDP2 + AdamW")
        for fqn, owner in list(owners.items())[:4]:
            print(f"    {fqn:<28} owner: shard rank {owner[1]}")
        _print_losses(reference["rows"])

        print(
            f"\n[2/3] same run, checkpoint every {args.save_every} steps; rank {args.world_size - 1} "
            f"crashes (SIGKILL) at step {args.crash_at}"
        )
        try:
            _spawn("crashing", args, out_dir)
            print("  (no crash happened?)")
        except Exception as exc:
            print(f"  crashed as planned: {type(exc).__name__}")
        save_times = torch.load(os.path.join(out_dir, "save_times.pt"))

        print("\n[3/3] fresh processes resume from the newest committed checkpoint")
        _spawn("resumed", args, out_dir)
        resumed = torch.load(os.path.join(out_dir, "resumed.pt"))
        print(f"  resumed at step {resumed['start']}")
        _print_losses(resumed["rows"])
        same_losses = [r[1] for r in resumed["rows"]] == [r[1] for r in reference["rows"][resumed["start"] :]]
        same_params = all(torch.equal(resumed["state"][k], reference["state"][k]) for k in reference["state"])

    final = f"{args.run_dir}/step-{args.steps}"
    t0 = time.perf_counter()
    target = f"{args.run_dir}/export"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", MissingConfigWarning)  # the demo's model is no HF model
        files = export(final, target, storage_options=args.storage_options)
    export_secs = time.perf_counter() - t0
    doc = inspect(final, storage_options=args.storage_options)
    first, last = reference["rows"][0][1], reference["rows"][-1][1]
    print("\nsummary")
    print(f"  loss                      {first:.3f} -> {last:.3f} ({'down' if last < first else 'NOT down'})")
    print(
        f"  resumed run == reference  losses {'identical' if same_losses else 'DIFFER'}, "
        f"parameters {'bit-identical' if same_params else 'DIFFER'}"
    )
    print(f"  checkpoint bytes per rank {doc['bytes_per_rank']}  (+ .metadata and manifest)")
    print(f"  save (median of {len(save_times)})    {sorted(save_times)[len(save_times) // 2]:.3f} s")
    print(f"  load (resume)             {resumed['load_secs']:.3f} s")
    print(f"  export to safetensors     {export_secs:.3f} s -> {', '.join(files)}")
    ok = same_losses and same_params and last < first
    print("\ndemo " + ("OK" if ok else "FAILED"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
