"""Building a dmuon model inside a rank: mesh, dedicated params, FSDP2, optimizer."""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import dmuon

from .reference import HPARAMS


def make_mesh(replicate: int = 1):
    world = dist.get_world_size()
    if replicate == 1:
        return init_device_mesh("cpu", (world,))
    return init_device_mesh("cpu", (replicate, world // replicate), mesh_dim_names=("replicate", "shard"))


def shard_model(model, mesh, predicate, *, wrap=("layers",), replicate_async=True,
                reshard_after_forward=True, hp=HPARAMS, fsdp=True):
    """dedicate_params + fully_shard on each block and the root + dmuon.Muon (the seed's recipe)."""
    owners = dmuon.dedicate_params(model, mesh, predicate, reshard_after_forward=reshard_after_forward)
    if fsdp:
        for attr in wrap:
            for block in getattr(model, attr, []):
                fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    opt = dmuon.Muon(model, replicate_async=replicate_async, **hp)
    return owners, opt


def max_abs_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), (sorted(set(a) ^ set(b)))
    return max(((a[k].float() - b[k].float()).abs().max().item() if a[k].numel() else 0.0) for k in a)


def set_seed(seed: int = 0) -> None:
    torch.manual_seed(seed)
