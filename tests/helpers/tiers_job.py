"""A training job on two "nodes" with a TieredCheckpointManager, run by
tests/dcp/tiers/test_manager.py.

Started by ``tests.helpers.nodes.launch_nodes`` (torchrun agents with c10d rendezvous); each
node's local tier is ``--local-root`` with ``{node}`` replaced by torchrun's node rank.

Modes:

* ``train``: from scratch, ``--steps`` steps through ``manager.step()``; at every step that the
  manager saved, rank 0 writes the full model and optimizer state to ``<out>/expected-<N>.pt``;
  at the end ``<out>/final.pt``. A preemption notice ends the loop early: ``<out>/preempted.json``.
* ``restore``: restore only; ``<out>/restored.pt`` (state) and ``<out>/restore.json`` (report).
* ``resume``: restore, then train on to ``--steps``; ``<out>/final.pt``.

``--kill replication|promotion``: rank ``--kill-rank`` SIGKILLs itself in the middle of the
background replication (while receiving its partner's file) or promotion (while uploading its
file) of step ``--kill-step``. Every rank writes ``<out>/pid.<rank>`` and, after each step,
``<out>/step.<rank>`` (the steps done), for a test that sends signals.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

import dmuon
import dmuon.dcp as ddcp
from dmuon.dcp.storage import write_path
from tests.helpers import faults
from tests.helpers.training import build, train

KILL_POINTS = {"replication": "_store", "promotion": "_CopyingReader.read"}


def full_state(model, opt) -> dict:
    return {"model": dmuon.get_model_state_dict(model), "optim": dmuon.get_optimizer_state_dict(model, opt)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=("train", "restore", "resume"), required=True)
    parser.add_argument("--local-root", required=True)
    parser.add_argument("--persistent", default=None)
    parser.add_argument("--storage-option", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--local-every", type=int, default=2)
    parser.add_argument("--persistent-every", type=int, default=None)
    parser.add_argument("--step-seconds", type=float, default=0.0, help="sleep per step (signal tests)")
    parser.add_argument("--deadline", type=float, default=None)
    parser.add_argument("--kill", choices=sorted(KILL_POINTS), default=None)
    parser.add_argument("--kill-rank", type=int, default=1)
    parser.add_argument("--kill-step", type=int, default=4)
    parser.add_argument("--chunk-bytes", type=int, default=4096)
    args = parser.parse_args()
    options = dict(pair.split("=", 1) for pair in args.storage_option) or None

    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    out = args.out
    with open(os.path.join(out, f"pid.{rank}"), "w") as f:
        f.write(str(os.getpid()))
    kill_armed = threading.Event()
    if args.kill is not None and rank == args.kill_rank:
        # counted only once step --kill-step is being saved; the 3rd call is mid-transfer
        faults.on_call(KILL_POINTS[args.kill], faults.sigkill, nth=3 if args.kill == "replication" else 1,
                       when=kill_armed.is_set, this_thread=False)  # both run on the background thread
    model, opt = build()
    manager = ddcp.TieredCheckpointManager(
        args.local_root.format(node=os.environ["GROUP_RANK"]), args.persistent, local_every=args.local_every,
        persistent_every=args.persistent_every, storage_options=options, preemption_deadline_s=args.deadline,
        chunk_bytes=args.chunk_bytes,
    )
    start = 0
    if args.mode in ("restore", "resume"):
        start = manager.resume(model, opt) or 0
        report = dataclasses.asdict(manager.last_restore)
        report["extra"] = manager.last_extra
        if rank == 0:
            with open(os.path.join(out, "restore.json"), "w") as f:
                json.dump(report, f)
        with open(os.path.join(out, f"restore.{rank}.json"), "w") as f:
            json.dump(report, f)
        state = full_state(model, opt)
        if rank == 0:
            torch.save(state, os.path.join(out, "restored.pt"))
    if args.mode in ("train", "resume"):
        for step in range(start + 1, args.steps + 1):
            train(model, opt, rank, world, range(step - 1, step))
            if step == args.kill_step and args.kill is not None:
                manager.wait()  # the earlier step's background work is over: count this step's only
                kill_armed.set()
            stop = manager.step(step, model, opt, extra={"step": step})
            if stop:
                if rank == 0:
                    with open(os.path.join(out, "preempted.json"), "w") as f:
                        json.dump(dataclasses.asdict(manager.last_preemption), f)
                break
            if manager.last_saved_step == step:
                state = full_state(model, opt)
                if rank == 0:
                    torch.save(state, os.path.join(out, f"expected-{step}.pt"))
            with open(os.path.join(out, f"step.{rank}"), "w") as f:
                f.write(str(step))
            time.sleep(args.step_seconds)
        else:
            state = full_state(model, opt)
            if rank == 0:
                torch.save(state, os.path.join(out, "final.pt"))
        with open(os.path.join(out, f"write_paths.{rank}.json"), "w") as f:  # how its local files went
            json.dump([choice.describe() for choice in write_path.known_choices().values()], f)
    manager.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
