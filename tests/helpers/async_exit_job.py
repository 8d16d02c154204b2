"""A training script that ends with an async save in flight, the way real scripts end.

Run under torchrun (``python -m torch.distributed.run --nproc-per-node 2 -m
tests.helpers.async_exit_job ...``) by ``tests/dcp/test_async_exit.py``. It trains two steps,
starts an async save through one of dmuon's entry points, whose background write is slowed
down so that it is surely still in flight, and then ends one way:

* ``destroy``: ``dist.destroy_process_group()``, then the script returns;
* ``exit``: the script returns without destroying the process group;
* ``raise``: an exception unwinds the training loop (every rank), with a ``finally`` that
  destroys the process group, as torchtitan's and most scripts' ``main`` do;
* ``sigterm``: keeps training until the launcher's SIGTERM ends it (the test sends it once
  every rank has written ``<out>/in-flight.<rank>``).

Rank 0 writes the state the save was started from to ``<out>/expected.pt`` first.
"""
from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist

import dmuon
import dmuon.dcp as ddcp
from tests.helpers import faults
from tests.helpers.training import build, train

ENDINGS = ("destroy", "exit", "raise", "sigterm")
ENTRY_POINTS = ("async_save", "manager", "torch")


class TrainingLoopError(RuntimeError):
    pass


def start_save(entry: str, model, opt, path: str, storage_options: dict | None):
    """Start an async save through ``entry``; returns what keeps it alive (never waited on)."""
    if entry == "async_save":
        return ddcp.async_save(model, opt, path, extra={"step": 2}, storage_options=storage_options)
    if entry == "manager":
        manager = ddcp.CheckpointManager(path, keep=2, async_save=True, storage_options=storage_options)
        manager.save(2, model, opt, extra={"step": 2})
        return manager
    # torch's own dcp.async_save (what torchtitan's async mode calls), on a gloo group of its own
    import torch.distributed.checkpoint as dcp

    group = dist.new_group(backend="gloo")
    writer = ddcp.DMuonStorageWriter(path, storage_options=storage_options)
    state = ddcp.AppState(model, opt, {"step": 2}).state_dict()
    return dcp.async_save(state, storage_writer=writer, planner=ddcp.DMuonSavePlanner(), process_group=group)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--path", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--ending", choices=ENDINGS, required=True)
    parser.add_argument("--entry", choices=ENTRY_POINTS, default="async_save")
    parser.add_argument("--slow", type=float, default=2.0, help="seconds each data file's write is held back")
    parser.add_argument("--storage-option", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args()
    options = dict(pair.split("=", 1) for pair in args.storage_option) or None

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model, opt = build()
    train(model, opt, rank, world, range(2))
    expected = dmuon.get_model_state_dict(model)
    if rank == 0:
        torch.save(expected, os.path.join(args.out, "expected.pt"))
    faults.on_call("DMuonStorageWriter._write_file", faults.pause(args.slow))
    keep_alive = start_save(args.entry, model, opt, args.path, options)  # noqa: F841
    with open(os.path.join(args.out, f"in-flight.{rank}"), "w") as marker:
        marker.write(str(os.getpid()))
    try:
        if args.ending == "raise":
            raise TrainingLoopError("the training loop failed with a save in flight")
        if args.ending == "sigterm":
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:  # training goes on until the launcher stops it
                time.sleep(0.05)
            raise SystemExit("no SIGTERM came")
    finally:
        if args.ending in ("destroy", "raise"):
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
