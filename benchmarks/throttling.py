"""Save and load through a request-rate throttling proxy (issue 37's target).

    python benchmarks/throttling.py [--backends s3 gcs] [--world 4] [--mib 64] [--share 0.3]

Starts the local S3 (SeaweedFS) and GCS (fake-gcs-server) servers of the test suite and, in
front of each, ``tests/helpers/throttle_proxy.py`` (a token bucket per key prefix; S3's
``503 SlowDown`` and GCS's ``429`` above the rate). For each backend:

1. after a save and a load that warm the server up, unthrottled (the proxy lets everything
   through): a ``--world``-rank save of a model of
   1024 x 1024 fp32 matrices, ``--mib`` MiB a rank, every other matrix dedicated, then a load;
   the requests each sends to the checkpoint's prefix and its wall time (barrier to barrier)
   give its request rate;
2. throttled to ``--share`` of that rate (writes for the save, reads for the load, one
   second's worth at most held): the same save and load, bit-exact (a hash of the whole model
   after the load against the one saved).

"Implied" is the time the allowed rate implies for the requests the proxy let through, that
is the requests the operation needed (counted unthrottled) over the rate, less the one
second's burst the bucket starts with. The issue's target: throttled wall <= 1.3 x implied.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import tempfile
import time
import uuid

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))

from tests.helpers.launch import run_ranks  # noqa: E402
from tests.helpers.throttle_proxy import ThrottleProxy  # noqa: E402

DIM = 1024
TARGET = 1.3


def build(n_matrices: int, seed: int):
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import dmuon

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(seed)
    model = torch.nn.Sequential(*[torch.nn.Linear(DIM, DIM, bias=False) for _ in range(n_matrices)])
    dmuon.dedicate_params(model, mesh, lambda name, p: int(name.split(".")[0]) % 2 == 0)
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def model_hash(model) -> str | None:
    import dmuon

    state = dmuon.get_model_state_dict(model)  # whole tensors, on rank 0
    if not state:
        return None
    digest = hashlib.sha256()
    for key in sorted(state):
        digest.update(key.encode())
        digest.update(state[key].contiguous().view(-1).view(dtype=__import__("torch").uint8).numpy().tobytes())
    return digest.hexdigest()


def operation_worker(rank, world, op, n_matrices, url, options):
    """One timed save (of the seed-0 model) or load (into a seed-1 model), barrier to barrier."""
    import torch.distributed as dist

    import dmuon.dcp as ddcp

    model = build(n_matrices, seed=0 if op == "save" else 1)
    dist.barrier()
    started = time.monotonic()
    if op == "save":
        ddcp.save(model, None, url, storage_options=options)
    else:
        ddcp.load(model, None, url, storage_options=options)
    dist.barrier()
    return {"seconds": time.monotonic() - started, "hash": model_hash(model)}


def timed(proxy: ThrottleProxy, prefix: str, world: int, op: str, n_matrices: int, url: str, options: dict):
    """(seconds, requests let through to ``prefix``, refused there, model hash) of one op."""
    forwarded, refused = proxy.forwarded[prefix], proxy.refused[prefix]
    ranks = run_ranks(operation_worker, world, op, n_matrices, url, options, timeout=600)
    return (ranks[0]["seconds"], proxy.forwarded[prefix] - forwarded, proxy.refused[prefix] - refused,
            ranks[0]["hash"])


def measure(kind: str, server, world: int, mib: int, share: float) -> list[dict]:
    n_matrices = max(world, mib * world // 4)  # 4 MiB a matrix
    proxy = ThrottleProxy(server.port, kind, rate=1e9, burst=1e9)
    options = dict(server.storage_options, endpoint_url=proxy.endpoint)
    rows = []
    try:
        warm = server.url(f"warm-{uuid.uuid4().hex[:8]}")  # the server's first writes allocate its volumes
        for op in ("save", "load"):
            run_ranks(operation_worker, world, op, n_matrices, warm, options, timeout=600)
        for op in ("save", "load"):
            free_url, limited_url = server.url(f"free-{uuid.uuid4().hex[:8]}"), server.url(f"lim-{uuid.uuid4().hex[:8]}")
            if op == "load":  # both checkpoints saved unthrottled first
                for url in (free_url, limited_url):
                    run_ranks(operation_worker, world, "save", n_matrices, url, options, timeout=600)
            proxy.set_rate(1e9, burst=1e9)
            seconds, requests, _, free_hash = timed(
                proxy, free_url.split("://", 1)[1], world, op, n_matrices, free_url, options)
            rate = share * requests / seconds
            proxy.set_rate(rate if op == "save" else 1e9, read_rate=rate if op == "load" else 1e9,
                           burst=max(1.0, rate))
            t_seconds, t_requests, t_refused, t_hash = timed(
                proxy, limited_url.split("://", 1)[1], world, op, n_matrices, limited_url, options)
            implied = max(t_requests - max(1.0, rate), 0.0) / rate
            rows.append({"backend": kind, "op": op, "requests": requests, "free_s": seconds,
                         "free_rate": requests / seconds, "allowed_rate": rate, "throttled_s": t_seconds,
                         "throttled_requests": t_requests, "refused": t_refused, "implied_s": implied,
                         "ratio": t_seconds / implied if implied else float("nan"),
                         "bit_exact": op == "save" or (t_hash == free_hash and t_hash is not None)})
    finally:
        proxy.stop()
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backends", nargs="+", default=["s3", "gcs"], choices=["s3", "gcs"])
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--mib", type=int, default=64, help="MiB of model per rank")
    parser.add_argument("--share", type=float, default=0.3, help="the allowed share of the unthrottled rate")
    args = parser.parse_args(argv)
    from tests.helpers.object_storage import FakeGCS, SeaweedS3

    rows = []
    with tempfile.TemporaryDirectory(prefix="dmuon-throttling-") as workdir:
        for kind in args.backends:
            server = (SeaweedS3 if kind == "s3" else FakeGCS)(os.path.join(workdir, kind))
            try:
                rows += measure(kind, server, args.world, args.mib, args.share)
            finally:
                server.stop()
    print(f"\n{args.world} ranks x {args.mib} MiB, throttled to {args.share:.0%} of the unthrottled request rate "
          f"per prefix; target: throttled <= {TARGET} x implied")
    print(f"{'backend':8}{'op':6}{'requests':>9}{'free s':>8}{'req/s':>7}{'allowed/s':>10}{'throttled s':>12}"
          f"{'refused':>8}{'implied s':>10}{'ratio':>7}  bit-exact  target")
    for r in rows:
        print(f"{r['backend']:8}{r['op']:6}{r['requests']:>9}{r['free_s']:>8.2f}{r['free_rate']:>7.1f}"
              f"{r['allowed_rate']:>10.2f}{r['throttled_s']:>12.2f}{r['refused']:>8}{r['implied_s']:>10.2f}"
              f"{r['ratio']:>7.2f}  {'yes' if r['bit_exact'] else 'NO':9}  {'met' if r['ratio'] <= TARGET else 'missed'}")


if __name__ == "__main__":
    main()
