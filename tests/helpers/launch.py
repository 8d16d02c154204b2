"""Run a function on N real gloo ranks, with a hard timeout that kills every rank.

Ranks are forked from a forkserver that imported torch once, so a 4-rank job starts in well
under a second after the first. A rank that raises writes its traceback; the parent then kills
the others (they are usually blocked in a collective) and raises with every traceback it has.

A native crash (abort, segfault: faulthandler wrote a report) is different from a failure the
test provoked: it has been seen, rarely, inside gloo's TCP transport and aiohttp, never in
dmuon (which has no native code). Such a job is run once more, with a warning that carries the
crash report (pytest lists it in its summary); a second crash, or any ordinary failure, fails
the test.
"""
from __future__ import annotations

import faulthandler
import multiprocessing as mp
import os
import socket
import tempfile
import time
import traceback
import warnings
from datetime import timedelta
from pathlib import Path

_CTX = mp.get_context("forkserver")
# Everything a rank imports lazily costs that time again in every rank of every test (FSDP2
# pulls in torch._dynamo: over a second): import it once, in the forkserver.
_CTX.set_forkserver_preload([
    "torch", "torch._dynamo", "torch.distributed", "torch.distributed.fsdp", "torch.distributed.tensor",
    "torch.distributed.checkpoint", "dmuon", "dmuon.dcp", "fsspec", "safetensors.torch",
])


class RankFailed(RuntimeError):
    pass


class NativeCrash(RankFailed):
    """A rank died in native code (faulthandler reported a fatal signal)."""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank_main(fn, rank, world_size, port, args, kwargs, out_dir, env):
    import torch
    import torch.distributed as dist

    os.environ.update(env)
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
    )
    torch.set_num_threads(1)
    # A native crash (abort, segfault) leaves no Python traceback: have one written per rank.
    fault_log = open(Path(out_dir, f"rank{rank}.fault"), "w")
    faulthandler.enable(fault_log, all_threads=True)
    # ...and keep what native code prints before it aborts (C++ "terminate called after ...").
    native_err = os.open(Path(out_dir, f"rank{rank}.stderr"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(native_err, 2)
    code = 0
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=120))
        result = fn(rank, world_size, *args, **kwargs)
        torch.save(result, Path(out_dir) / f"rank{rank}.pt")
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - report everything, including CheckpointException
        Path(out_dir, f"rank{rank}.err").write_text(traceback.format_exc())
        code = 1
    os._exit(code)


def run_ranks(fn, world_size: int, *args, timeout: float = 90.0, env: dict | None = None,
              grace: float = 5.0, daemon: bool = True, agent_store: bool = False, **kwargs):
    """Call ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` ranks; return results by rank.

    Once a rank fails, the others get ``grace`` seconds to report their own errors, then die.
    ``daemon=False`` lets ranks start processes of their own (killed all the same on timeout).
    ``agent_store=True``: this process hosts the rendezvous store, as torchrun's agent does, so
    that it outlives any rank (by default rank 0 hosts it).
    A job whose rank crashed natively runs once more (see the module docstring).
    """
    try:
        return _run_once(fn, world_size, args, kwargs, timeout, env, grace, daemon, agent_store)
    except NativeCrash as crash:
        warnings.warn(f"native crash in a rank of {fn.__qualname__}; running the job once more:\n{crash}",
                      stacklevel=2)
    return _run_once(fn, world_size, args, kwargs, timeout, env, grace, daemon, agent_store)


def _tail(path: Path, limit: int = 4000) -> str:
    text = path.read_text(errors="replace") if path.exists() else ""
    return text[-limit:]


def _run_once(fn, world_size, args, kwargs, timeout, env, grace, daemon, agent_store):
    import torch

    with tempfile.TemporaryDirectory(prefix="dmuon-ranks-") as out_dir:
        port = free_port()
        store = None
        if agent_store:
            import torch.distributed as dist

            store = dist.TCPStore("127.0.0.1", port, world_size, is_master=True, wait_for_workers=False)
            env = {**(env or {}), "TORCHELASTIC_USE_AGENT_STORE": "True"}
        procs = [
            _CTX.Process(
                target=_rank_main,
                args=(fn, rank, world_size, port, args, kwargs, out_dir, dict(env or {})),
                daemon=daemon,
            )
            for rank in range(world_size)
        ]
        for proc in procs:
            proc.start()
        deadline = time.monotonic() + timeout
        failed_at = None
        while any(p.is_alive() for p in procs):
            now = time.monotonic()
            if failed_at is None and any(p.exitcode not in (None, 0) for p in procs):
                failed_at = now
            if now > deadline or (failed_at is not None and now - failed_at > grace):
                break
            time.sleep(0.02)
        alive = [rank for rank, p in enumerate(procs) if p.is_alive()]
        for proc in procs:
            if proc.is_alive():
                proc.kill()
            proc.join(5)
        del store  # the agent's store goes once every rank is gone
        errors = {
            rank: Path(out_dir, f"rank{rank}.err").read_text()
            for rank in range(world_size)
            if Path(out_dir, f"rank{rank}.err").exists()
        }
        crashed = []
        for rank in range(world_size):
            crash = Path(out_dir, f"rank{rank}.fault")
            if crash.exists() and crash.stat().st_size:
                crashed.append(rank)
                errors[rank] = (
                    errors.get(rank, "")
                    + f"native crash (exit code {procs[rank].exitcode}):\n{crash.read_text()}"
                    + f"\nits stderr ends:\n{_tail(Path(out_dir, f'rank{rank}.stderr'))}"
                )
        if errors:
            detail = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items()))
            raise (NativeCrash if crashed else RankFailed)(f"{len(errors)} rank(s) failed:\n{detail}")
        if alive and failed_at is None:
            raise TimeoutError(f"ranks {alive} still running after {timeout:.0f}s (deadlock?); killed")
        bad = {r: p.exitcode for r, p in enumerate(procs) if p.exitcode != 0}
        if bad:
            raise RankFailed(f"ranks exited abnormally without a traceback: {bad}")
        return [
            torch.load(Path(out_dir, f"rank{rank}.pt"), weights_only=False)
            for rank in range(world_size)
        ]
