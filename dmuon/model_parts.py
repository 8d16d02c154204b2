"""A pipeline-parallel model as one model: the parts a rank holds, under the names of the whole.

Pipeline parallelism splits a model into stages; a rank holds one or several parts (an
interleaved schedule gives it several), each its own FSDP2 root with its own dedicated
parameters (``dedicate_params`` over that stage's data-parallel mesh). torchtitan builds the
parts by deleting, from the whole model, the layers another stage runs, so each part keeps the
whole model's parameter names and the parts of all stages together hold every name once.

:class:`ModelParts` is what dmuon's doors take for such a model: one optimizer over all parts
(``dmuon.Muon(ModelParts(parts))``) and one checkpoint for all stages (``dmuon.dcp.save``,
the managers), which loads on any other split, or without pipeline parallelism. It is a module
only to be handed where a model is asked for: its names, state dict and dedicated registry are
the union of its parts', with no prefix; it does not run forward (the pipeline schedule runs
the parts). Each rank passes the parts it holds.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from .dedicated import DedicatedRegistry, get_registry, register
from .dedicated_state_dict import raw_state_dict

__all__ = ["IncompatibleKeys", "ModelParts", "PartsRegistry", "mesh_smaller_than_job"]


class IncompatibleKeys(NamedTuple):
    """What ``load_state_dict`` returns, as torch's modules return it."""

    missing_keys: list[str]
    unexpected_keys: list[str]


@dataclass(eq=False)
class PartsRegistry(DedicatedRegistry):
    """The dedicated parameters of every part, each still moved by its own part's hooks."""

    parts: list[DedicatedRegistry] = field(default_factory=list)

    @contextlib.contextmanager
    def showing_placeholders(self) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            for part in self.parts:
                stack.enter_context(part.showing_placeholders())
            yield


class ModelParts(nn.Module):
    """The model parts this rank holds, seen as one model with the whole model's names.

    Build it after ``dedicate_params`` and ``fully_shard`` on every part. The parts are not
    registered as submodules (their names would gain a prefix); iterate :attr:`parts` to run
    or wrap them.
    """

    parts: list[nn.Module]

    def __init__(self, parts: Sequence[nn.Module]) -> None:
        super().__init__()
        parts = list(parts)
        if not parts:
            raise ValueError("ModelParts needs at least one model part")
        object.__setattr__(self, "parts", parts)  # not submodules: no prefix on their names
        registries = [registry for part in parts if (registry := get_registry(part)) is not None]
        seen: dict[str, int] = {}
        for index, part in enumerate(parts):
            for key in raw_state_dict(part):
                if key in seen:
                    raise ValueError(f"ModelParts: {key!r} is held by part {seen[key]} and part {index}")
                seen[key] = index
        if registries:
            first = registries[0]
            merged = PartsRegistry(
                topo=first.topo,
                reshard_after_forward=first.reshard_after_forward,
                stack_fqns=frozenset().union(*(r.stack_fqns for r in registries)),
                matrix_fqns=frozenset().union(*(r.matrix_fqns for r in registries)),
                parts=registries,
            )
            for registry in registries:
                merged.records.update(registry.records)
            register(self, merged)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("ModelParts does not run forward: the pipeline schedule runs each part")

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        for part in self.parts:
            yield from part.named_parameters(prefix, recurse, remove_duplicate)

    def named_buffers(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        for part in self.parts:
            yield from part.named_buffers(prefix, recurse, remove_duplicate)

    def named_modules(self, memo=None, prefix: str = "", remove_duplicate: bool = True):
        for part in self.parts:
            yield from part.named_modules(memo, prefix, remove_duplicate)

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:  # type: ignore[override]
        """Every part's ``state_dict()`` (dedicated-aware), merged: the names never clash."""
        merged: dict[str, Any] = {}
        for part in self.parts:
            merged.update(part.state_dict(*args, **kwargs))
        return merged

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False):
        """Each part loads the keys it holds; a key no part holds is unexpected."""
        missing: list[str] = []
        held: set[str] = set()
        for part in self.parts:
            held |= set(raw_state_dict(part))
            missing += part.load_state_dict(state_dict, strict=False, assign=assign).missing_keys
        unexpected = [key for key in state_dict if key not in held]
        if strict and (missing or unexpected):
            raise RuntimeError(
                f"ModelParts.load_state_dict: missing keys {sorted(missing)}, unexpected keys {sorted(unexpected)}"
            )
        return IncompatibleKeys(missing, unexpected)


def mesh_smaller_than_job(model: nn.Module) -> int | None:
    """The size of a mesh of ``model``'s (dedicated or DTensor parameters) that does not span
    the whole job, as a pipeline stage's does; None when the model spans it.

    Under tensor parallelism the data mesh is one slice of the job per TP rank, each holding
    the same values, while the TP-sharded matrices span it: a model with one mesh that spans
    the job spans it."""
    if not dist.is_initialized():
        return None
    world = dist.get_world_size()
    sizes = [rec.topo.world_size for rec in get_registry(model) or ()]
    sizes += [p.device_mesh.size() for p in model.parameters() if isinstance(p, DTensor)]
    if world in sizes:
        return None
    return next((size for size in sizes if size != world), None)
