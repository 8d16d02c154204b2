"""How often a 2-rank CPU job that ends well exits with a status other than 0.

torch 2.13's gloo backend can abort a process at interpreter exit ("terminate called without
an active exception", SIGABRT) after ``destroy_process_group()``, with or without dmuon. This
script counts it, so that what dmuon adds (its gloo groups, its exit guard, what it keeps on
the model) can be told apart from what torch does on its own (docs/reliability.md).

    python scripts/exit_status.py --runs 20                 # every variant, 20 jobs each
    python scripts/exit_status.py --runs 20 --variant torch --variant dmuon-async

Each job trains 3 steps of a small MLP on 2 ranks (gloo, FSDP2), saves once, calls
``destroy_process_group()`` and returns. Variants:

* ``torch``: FSDP2 and AdamW, ``torch.distributed.checkpoint.save``; no dmuon import at all;
* ``torch-async``: the same with ``dcp.async_save`` on a gloo group of its own;
* ``dmuon``: dedicated weights, ``dmuon.Muon``, ``dmuon.dcp.save``;
* ``dmuon-async``: the same with ``dmuon.dcp.async_save`` (the model's AsyncCheckpointer and its
  gloo group);
* ``dmuon-tiers``: ``TieredCheckpointManager`` (its two gloo groups and background thread).

How the script ends after ``destroy_process_group()`` (``--ending``, repeatable):

* ``return``: it returns, as most scripts do;
* ``collect``: it drops its model, optimizer and checkpointing objects and runs ``gc.collect()``
  first, so that the process groups they hold are freed before the interpreter shuts down;
* ``os-exit``: it flushes stdout and stderr and calls ``os._exit(0)``, skipping the
  interpreter's shutdown (and the C++ destructors that abort).

Run from the repository root with the venv's Python. Prints one line per variant and ending:
exit statuses counted (negative: killed by that signal), and how many runs printed "terminate
called".
"""

from __future__ import annotations

import argparse
import collections
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

VARIANTS = ("torch", "torch-async", "dmuon", "dmuon-async", "dmuon-tiers")
ENDINGS = ("return", "collect", "os-exit")
ABORT_TEXT = "terminate called"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_once(variant: str, workdir: Path, timeout: float, ending: str = "return") -> tuple[int, bool]:
    """One torchrun job; its launcher's exit status (a worker killed by a signal makes it 1),
    the workers' own statuses as torchrun reports them, and whether a worker printed the abort."""
    argv = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
        "--master-addr", "127.0.0.1", "--master-port", str(_free_port()),
        __file__, "--job", variant, "--dir", str(workdir), "--ending", ending,
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    try:
        proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return 124, False
    output = proc.stdout + proc.stderr
    status = proc.returncode
    if status != 0 and "Signal 6 (SIGABRT)" in output:
        status = -6
    return status, ABORT_TEXT in output


def drive(variants: list[str], runs: int, timeout: float, endings: list[str]) -> None:
    for variant, ending in ((v, e) for e in endings for v in variants):
        statuses: collections.Counter = collections.Counter()
        aborts = 0
        started = time.monotonic()
        for i in range(runs):
            with tempfile.TemporaryDirectory() as tmp:
                status, aborted = launch_once(variant, Path(tmp), timeout, ending)
            statuses[status] += 1
            aborts += aborted
            print(
                f"  {variant} {ending} run {i + 1}: status {status}{' (terminate called)' if aborted else ''}",
                flush=True,
            )
        elapsed = time.monotonic() - started
        counts = ", ".join(f"{status}: {n}" for status, n in sorted(statuses.items()))
        print(f"{variant:<12} {ending:<8} {runs} runs in {elapsed:.0f} s; exit statuses {{{counts}}}; "
              f"'{ABORT_TEXT}' in {aborts}", flush=True)  # fmt: skip


# ---------------------------------------------------------------------------------------------
# the job, run by torchrun on every rank
# ---------------------------------------------------------------------------------------------
def job(variant: str, workdir: Path, ending: str = "return") -> None:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 8))
    path = str(workdir / "ckpt")
    keep: list = []  # what holds process groups: dropped before the end by the "collect" ending
    if variant.startswith("dmuon"):
        import dmuon
        import dmuon.dcp as ddcp

        dmuon.dedicate_params(model, mesh, predicate=lambda name, p: p.ndim == 2)
        fully_shard(model, mesh=mesh)
        opt = dmuon.Muon(model, lr=0.02, adamw_lr=1e-3)
    else:
        fully_shard(model, mesh=mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(3):
        loss = model(torch.randn(4, 32)).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
    if variant == "torch" or variant == "torch-async":
        import torch.distributed.checkpoint as dcp

        state = {"model": model.state_dict()}
        if variant == "torch":
            dcp.save(state, checkpoint_id=path)
        else:
            group = dist.new_group(backend="gloo")
            dcp.async_save(state, checkpoint_id=path, process_group=group).result()
            keep.append(group)
    elif variant == "dmuon":
        ddcp.save(model, opt, path)
    elif variant == "dmuon-async":
        ddcp.async_save(model, opt, path).wait()
    elif variant == "dmuon-tiers":
        tiers = ddcp.TieredCheckpointManager(str(workdir / "local"), path, persistent_every=1)
        tiers.step(1, model, opt)
        tiers.close()
        keep.append(tiers)
    dist.destroy_process_group()
    if ending == "collect":
        import gc

        del model, opt, keep
        gc.collect()
    elif ending == "os-exit":
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--variant", action="append", choices=VARIANTS, help="repeatable; default: all")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds for one job")
    parser.add_argument("--ending", action="append", choices=ENDINGS, help="repeatable; default: return")
    parser.add_argument("--job", choices=VARIANTS, help=argparse.SUPPRESS)
    parser.add_argument("--dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.job:
        job(args.job, Path(args.dir), (args.ending or ["return"])[0])
    else:
        drive(args.variant or list(VARIANTS), args.runs, args.timeout, args.ending or ["return"])


if __name__ == "__main__":
    main()
