"""A small pipeline-parallel job without torch's schedules: stages, parts, a send/recv pipeline.

The model keeps its layers in a ``ModuleDict`` keyed by layer number, as torchtitan does, so a
part made by deleting what another stage runs keeps the whole model's names. With ``pp``
pipeline ranks and ``virtual`` parts per rank, part ``v`` (of ``pp * virtual``) runs the
``v``-th share of the layers; it lives on pipeline rank ``v % pp`` (an interleaved split: rank 0 holds parts 0 and
``pp``...). One microbatch goes through the parts in order and back: activations forward and
gradients backward travel between pipeline ranks by ``send``/``recv``, each part a dmuon model
(dedicated matrices over its stage's data-parallel ranks) under FSDP2.
"""
from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import fully_shard

import dmuon

from .models import Block, batch, proj_predicate
from .reference import HPARAMS

DIM, HEADS, HIDDEN, VOCAB = 32, 2, 48, 64


class StagedTransformer(nn.Module):
    """``TinyTransformer``'s shape with layers by number; runs whatever parts it still has."""

    def __init__(self, layers: int) -> None:
        super().__init__()
        self.embed: nn.Module | None = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleDict({str(i): Block(DIM, HEADS, HIDDEN) for i in range(layers)})
        self.norm: nn.Module | None = nn.LayerNorm(DIM)
        self.lm_head: nn.Module | None = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            x = self.embed(x)
        for layer in self.layers.values():
            x = layer(x)
        if self.lm_head is not None:
            assert self.norm is not None
            x = self.lm_head(self.norm(x))
        return x


def make_part(whole: StagedTransformer, index: int, parts: int) -> StagedTransformer:
    """Part ``index`` of ``parts``: its share of the layers, the embedding first, the head last."""
    part = copy.deepcopy(whole)
    per_part = len(whole.layers) // parts
    for name in list(part.layers):
        if int(name) // per_part != index:
            del part.layers[name]
    if index != 0:
        part.embed = None
    if index != parts - 1:
        part.norm = part.lm_head = None
    return part


def build(pp: int, virtual: int, seed: int = 0, layers: int = 4):
    """This rank's parts, each dedicated and sharded over its stage's data-parallel mesh, and
    one ``dmuon.Muon`` over them all. Returns (parts, model, optimizer, pipeline rank)."""
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    dp = world // pp
    torch.manual_seed(seed)
    whole = StagedTransformer(layers)
    if pp == 1 and virtual == 1:
        parts = [whole]
        mesh = init_device_mesh("cpu", (dp,))
        stage = 0
    else:
        mesh2 = init_device_mesh("cpu", (pp, dp), mesh_dim_names=("pp", "dp"))
        mesh, stage = mesh2["dp"], mesh2.get_local_rank("pp")
        parts = [make_part(whole, v, pp * virtual) for v in range(stage, pp * virtual, pp)]
    for part in parts:
        dmuon.dedicate_params(part, mesh, proj_predicate)
        for layer in part.layers.values():
            fully_shard(layer, mesh=mesh)
        fully_shard(part, mesh=mesh)
    model = dmuon.ModelParts(parts) if len(parts) > 1 or pp > 1 else parts[0]
    return parts, model, dmuon.Muon(model, **HPARAMS), stage


def train_step(parts, stage: int, pp: int, step: int, per_rank: int = 2) -> float | None:
    """One microbatch through every part and back; the loss on the rank holding the last part."""
    rank, world = dist.get_rank(), dist.get_world_size()
    dp = world // pp
    dp_rank = rank % dp  # rank = stage * dp + dp_rank (the pp x dp mesh)
    tokens = batch(step, per_rank * dp)[per_rank * dp_rank : per_rank * (dp_rank + 1)]
    total = len(parts) * pp

    def peer(v: int) -> int:
        return (v % pp) * dp + dp_rank

    outputs, inputs = [], []
    loss = None
    for i, part in enumerate(parts):
        v = stage + i * pp
        if v == 0:
            x = tokens[:, :-1]
        else:
            x = torch.empty(per_rank, tokens.shape[1] - 1, DIM)
            dist.recv(x, src=peer(v - 1))
            x.requires_grad_(True)
        y = part(x)
        inputs.append(x)
        outputs.append(y)
        if v == total - 1:
            loss = F.cross_entropy(y.reshape(-1, VOCAB).float(), tokens[:, 1:].reshape(-1))
        else:
            dist.send(y.detach().contiguous(), dst=peer(v + 1))
    for i in reversed(range(len(parts))):
        v = stage + i * pp
        if v == total - 1:
            assert loss is not None
            loss.backward()
        else:
            grad = torch.empty_like(outputs[i])
            dist.recv(grad, src=peer(v + 1))
            outputs[i].backward(grad)
        if v != 0:
            dist.send(inputs[i].grad.contiguous(), dst=peer(v - 1))
    return None if loss is None else loss.item()
