"""Two (or more) torchrun agents on localhost with c10d rendezvous: a job on several "nodes".

Each agent is started in its own session and killed by its process group (never by name)
when the job outlives ``timeout`` or when one agent failed and the others are left hanging
in a collective with a dead peer (torchrun's agents do not tell each other).
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from .launch import free_port

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class NodesJob:
    agents: list[subprocess.Popen]
    logs: list[Path]

    def wait(self, timeout: float = 90.0, grace: float = 5.0) -> list[int]:
        """Exit codes of the agents; a job still running after ``timeout`` (or ``grace``
        seconds after one agent failed) is killed, and reported as -9 for those agents."""
        deadline = time.monotonic() + timeout
        failed_at = None
        while any(a.poll() is None for a in self.agents):
            now = time.monotonic()
            if failed_at is None and any(a.poll() not in (None, 0) for a in self.agents):
                failed_at = now
            if now > deadline or (failed_at is not None and now - failed_at > grace):
                break
            time.sleep(0.05)
        for agent in self.agents:
            if agent.poll() is None:
                os.killpg(agent.pid, signal.SIGKILL)
            agent.wait(10)
        return [a.returncode for a in self.agents]

    def output(self) -> str:
        return "\n".join(f"--- agent {i} ---\n{p.read_text(errors='replace')[-4000:]}" for i, p in enumerate(self.logs))


def launch_nodes(target: str, args: list[str], log_dir: Path, *, nodes: int = 2, per_node: int = 1,
                 envs: list[dict] | None = None, cwd: Path = ROOT) -> NodesJob:
    """Start ``python -m target args`` (or the script ``target``, a path ending in .py) on
    ``nodes`` torchrun agents of ``per_node`` workers; ``envs``: extra environment per agent
    (per machine: a path on its own disk, say)."""
    log_dir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    program = [str(target)] if str(target).endswith(".py") else ["-m", target]
    argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nodes), "--nproc-per-node",
            str(per_node), "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id",
            f"dmuon-{port}", "--max-restarts", "0", "--monitor-interval", "0.1", *program, *args]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    agents, logs = [], []
    for i in range(nodes):
        log = log_dir / f"agent{i}.log"
        with open(log, "wb") as out:
            agents.append(subprocess.Popen(argv, cwd=cwd, env={**env, **(envs[i] if envs else {})}, stdout=out,
                                           stderr=subprocess.STDOUT, start_new_session=True))
        logs.append(log)
    return NodesJob(agents, logs)
