"""The scale simulator checked against real gloo ranks (``python benchmarks/scale sim --check-real``).

The tiny model of ``scale_sim_state.SPECS`` is built for real on 8 and 32 CPU ranks: dmuon's
(Muon weights dedicated, the rest FSDP2, saved twice by a ``Checkpointer``, then loaded twice:
cooperative between every pair of ranks, as from object storage, which gathers the plans; and
alone, ``cooperative=False``) and torch's (the same parameters all FSDP2, the same optimizer
keys as DTensors, ``dcp.save``/``dcp.load`` with the default planners, with and without plan
caching). In each rank process, and only there, ``torch.distributed``'s object collectives and
``all_reduce`` are wrapped to record the pickled size of what the rank puts in (for an
all-reduce, its tensor's bytes); the calls of all ranks, matched by order, give the same
:class:`Call` lists the simulator makes, and both are tallied alike.
"""

from __future__ import annotations

import functools
import os
import pickle
import tempfile
import time
from typing import Any

from scale_sim_state import PARAM_GROUPS, SPECS, Call, is_muon, param_shapes, tally

KINDS = {"gather_object": "gather", "scatter_object_list": "scatter", "broadcast_object_list": "broadcast",
         "all_gather_object": "all_gather", "all_reduce": "all_reduce"}


METRICS = ("rank0_in", "rank0_out", "other_in_max", "total", "wire_max_in")


def _record(log: list, op: list[str]) -> None:
    """Wrap the object collectives of this process: each call appends (op, kind, my sizes)."""
    import torch.distributed as dist

    def wrap(name: str, original):
        @functools.wraps(original)
        def call(*args: Any, **kwargs: Any):
            rank = dist.get_rank()
            if not op[0]:  # outside the operations counted (model set-up)
                return original(*args, **kwargs)
            if name == "all_reduce":
                tensor = kwargs.get("tensor", args[0] if args else None)
                mine = [tensor.numel() * tensor.element_size()]
            elif name in ("gather_object", "all_gather_object"):
                obj = kwargs["obj"] if "obj" in kwargs else args[1 if name == "all_gather_object" else 0]
                mine = len(pickle.dumps(obj))
            elif name == "scatter_object_list":
                objects = kwargs.get("scatter_object_input_list", args[1] if len(args) > 1 else None)
                mine = [len(pickle.dumps(o)) for o in objects] if rank == 0 else None
            else:
                objects = kwargs.get("object_list", args[0] if args else None)
                mine = [len(pickle.dumps(objects[0]))] if rank == 0 else None
            log.append((op[0], KINDS[name], mine))
            return original(*args, **kwargs)
        return call

    for name in KINDS:
        setattr(dist, name, wrap(name, getattr(dist, name)))


def _tiny_module(spec):
    """The model of ``spec`` as modules, parameters registered in ``param_shapes`` order."""
    import torch
    from torch import nn

    root = nn.Module()
    for fqn, shape in param_shapes(spec):
        *path, leaf = fqn.split(".")
        module = root
        for part in path:
            if part.isdigit():
                module = module[int(part)]
                continue
            if not hasattr(module, part):
                module.add_module(part, nn.ModuleList(nn.Module() for _ in range(spec.layers))
                                  if part == "layers" else nn.Module())
            module = getattr(module, part)
        module.register_parameter(leaf, nn.Parameter(torch.randn(shape) * 0.02))
    return root


def _sharded(spec, dedicated: bool):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import dmuon

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = _tiny_module(spec)
    if dedicated:
        dmuon.dedicate_params(model, mesh, predicate=lambda name, p: is_muon(name, p.shape))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _torch_state(model) -> dict:
    """torch's view of the same state: every tensor a shard, dmuon.Muon's keys."""
    import torch

    state: dict[str, Any] = {}
    for fqn, p in model.named_parameters():
        value = p.detach()
        state[fqn] = ({"momentum_buffer": torch.zeros_like(value)} if is_muon(fqn, p.shape) else
                      {"step": torch.zeros(()), "exp_avg": torch.zeros_like(value),
                       "exp_avg_sq": torch.zeros_like(value)})
    groups = {name: dict(values) for name, values in PARAM_GROUPS.items()}
    return {"model": model.state_dict(), "optim": {"state": state, "param_groups": groups}}


def worker(rank: int, world: int, root: str, spec_key: str) -> dict[str, Any]:
    """Every method's first save, steady save and load; this rank's collective log."""
    import torch.distributed.checkpoint as dcp

    import dmuon
    import dmuon.dcp as ddcp

    spec = SPECS[spec_key]
    log: list = []
    op = [""]
    _record(log, op)
    model = _sharded(spec, dedicated=True)
    optimizer = dmuon.Muon(model)
    checkpointer = ddcp.Checkpointer()
    for name, sub in (("first save", "d0"), ("steady save", "d1")):
        op[0] = f"dmuon/{name}"
        checkpointer.save(model, optimizer, os.path.join(root, sub))
    for name, cooperative in (("load", True), ("load alone", False)):
        op[0] = f"dmuon/{name}"
        checkpointer.load(model, optimizer, os.path.join(root, "d0"), cooperative=cooperative)
    op[0] = ""
    plain = _sharded(spec, dedicated=False)
    state = _torch_state(plain)
    for method, caching in (("torch", False), ("torch+cache", True)):
        for name, sub in (("first save", "0"), ("steady save", "1")):
            op[0] = f"{method}/{name}"
            dcp.save(state, storage_writer=dcp.FileSystemWriter(os.path.join(root, method + sub)),
                     planner=dcp.DefaultSavePlanner(enable_plan_caching=caching))
        op[0] = f"{method}/load"
        dcp.load(state, storage_reader=dcp.FileSystemReader(os.path.join(root, method + "0")),
                 planner=dcp.DefaultLoadPlanner())
        op[0] = ""
    return {"log": log}


def real_calls(logs: list[list], world: int) -> dict[str, list[Call]]:
    """The ranks' logs, matched call by call, as the simulator's Call lists per method/op."""
    out: dict[str, list[Call]] = {}
    for entries in zip(*logs, strict=True):
        op, kind, _ = entries[0]
        if kind in ("gather", "all_gather", "all_reduce"):
            sizes = [entry[2] for entry in entries]
            if kind == "all_reduce":
                sizes = sizes[0]  # every rank's tensor is the same size
        else:
            sizes = entries[0][2]
        out.setdefault(op, []).append(Call(kind, sizes))
    return out


def check_real(worlds: list[int], simulate) -> dict[str, Any]:
    """Real ranks against the simulator on the tiny model; a table of both tallies."""
    from harness import run_ranks

    rows, lines = [], ["| N | method | operation | collectives (real / sim) | into rank 0 real / sim | "
                       "out of rank 0 real / sim | any other rank in real / sim | all ranks real / sim | "
                       "any rank, wire in real / sim |", "|---|---|---|---|---|---|---|---|---|"]
    for world in worlds:
        with tempfile.TemporaryDirectory(prefix="dmuon-scale-real-") as root:
            t0 = time.perf_counter()
            results = run_ranks(worker, world, root, "tiny", timeout=1800)
            real_s = time.perf_counter() - t0
        real = {op: (calls, tally(calls, world)) for op, calls in real_calls([r["log"] for r in results],
                                                                             world).items()}
        t0 = time.perf_counter()
        sim_rows = simulate(["tiny"], ["fsdp"], [world], world, log=lambda *a: None)
        sim_s = time.perf_counter() - t0
        for row in sim_rows:
            key = f"{row['method']}/{row['op']}"
            calls, counted = real[key]
            entry = {"world": world, "method": row["method"], "op": row["op"], "real_s": real_s, "sim_s": sim_s,
                     "real_calls": [c.kind for c in calls], "sim_calls": row["calls"]}
            for metric in METRICS:
                entry[metric] = (counted[metric], row[metric])
            rows.append(entry)
            same = "same" if entry["real_calls"] == entry["sim_calls"] else f"{entry['real_calls']} / {row['calls']}"
            cells = [f"{world}", row["method"], row["op"], same] + [
                f"{entry[m][0]:,} / {entry[m][1]:,}" for m in METRICS]
            lines.append("| " + " | ".join(cells) + " |")
        lines.append(f"\n(N={world}: real ranks {real_s:.0f} s wall, from spawn to the last result; "
                     f"simulator {sim_s:.1f} s)\n")
    return {"rows": rows, "table": "\n".join(lines)}
