"""dmuon in torchtitan 0.3.0: train with ``dmuon.Muon``, checkpoint with torchtitan's own
``CheckpointManager`` and its config, unchanged.

What torchtitan needs and does not have is an optimizer container for ``dmuon.Muon`` (its
registry builds Adam, AdamW and its own DistMuon from regex groups). Everything else already
works through torch's entry points:

* torchtitan saves the model through ``model.state_dict()`` with DCP's default planner: dmuon
  shows each dedicated weight whole on the ranks that hold it and nowhere else, so it is
  written once, whole (``interval``, ``keep_latest_k``, ``async_mode="async"``, the last-step
  model-only export with ``export_dtype``, and the HuggingFace export all go through it);
* :class:`MuonOptimizersContainer` saves the optimizer through torch's
  ``get_optimizer_state_dict(..., flatten_optimizer_state_dict=True)``, which works with
  ``dmuon.Muon``: momentum buffers are written by their owners, Adam moments as DTensor
  shards, and loading works on another topology.

Two ways in:

* your own loop: call ``dmuon.dedicate_params`` before torchtitan's ``fully_shard`` calls, then
  build the optimizers with :func:`build_muon_optimizers`;
* torchtitan's own ``Trainer`` (its config-registry path, ``--module/--config``):
  :func:`with_dmuon` turns any ``Trainer.Config`` into one that trains with ``dmuon.Muon``.
  It wraps the model spec's ``parallelize_fn`` (:func:`dedicated_parallelize`: dedicate the
  selected weights of the meta-device model, then torchtitan's own parallelisms) and sets
  the optimizer to :class:`MuonOptimizersContainer.Config`. The Trainer's order (build on
  meta, parallelize, ``to_empty``, ``init_weights``, build optimizers, load a checkpoint)
  is kept: the owners adopt what ``init_weights`` wrote when ``dmuon.Muon`` is built.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor
from torchtitan.components.optimizer import OptimizersContainer

from .. import compat
from ..dedicate import dedicate_params
from ..dedicated import get_registry
from ..optim.muon import Muon
from .torchtitan_tp import dedicate_after_tensor_parallelism, refuse_with_tensor_parallelism

__all__ = [
    "MuonOptimizersContainer",
    "build_muon_optimizers",
    "dedicated_parallelize",
    "default_expert_stacks",
    "default_predicate",
    "with_dmuon",
]

#: torchtitan's own optimizer checkpoints are flat (``state.<fqn>.<name>``).
_FLAT = StateDictOptions(flatten_optimizer_state_dict=True)
#: where :func:`dedicated_parallelize` leaves the clipping threshold the Trainer was given
_MAX_NORM_ATTR = "_dmuon_max_norm"
#: and how many ranks hold each dedicated weight's owner copy (one per TP rank)
_COPIES_ATTR = "_dmuon_dedicated_copies"


class MuonOptimizersContainer(OptimizersContainer):
    """torchtitan's optimizer container holding one ``dmuon.Muon`` per model part.

    ``step``, ``zero_grad``, hooks and the LR-scheduler builders behave as for torchtitan's own
    optimizers. Checkpoints hold, per model part, what torch's ``get_optimizer_state_dict``
    returns for it.

    Two things torchtitan's Trainer does around ``step`` do not see dedicated gradients, which
    live on their owners' masters, not in ``model.parameters()``; ``step`` does them itself:

    * ``sum_gradients``: torchtitan divides the loss by the global token count and has FSDP
      sum gradients over the data-parallel ranks; dmuon averages a dedicated gradient. True
      multiplies dedicated gradients by the data-parallel size so that both agree.
    * ``max_norm``: clip every gradient, sharded and dedicated, by their joint norm (kept in
      ``grad_norm``). :func:`dedicated_parallelize` moves the Trainer's
      ``training.max_norm`` here, where torchtitan's own clipping would leave dedicated
      gradients out of the norm and unclipped.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(OptimizersContainer.Config):
        """``Trainer.Config.optimizer`` for ``dmuon.Muon``: its arguments, with its defaults.

        Which weights Muon updates is decided by ``dedicate_params`` (dedicated matrices),
        not by regexes: the inherited ``param_groups`` and ``implementation`` are not used.
        """

        lr: float = 0.02
        momentum: float = 0.95
        nesterov: bool = True
        ns_steps: int = 5
        weight_decay: float = 0.0
        adamw_lr: float = 1e-3
        adamw_betas: tuple[float, float] = (0.9, 0.999)
        adamw_eps: float = 1e-8
        adamw_weight_decay: float = 0.01
        replicate_async: bool = True

        def build(self, *, model_parts: list[nn.Module], **unused: Any) -> MuonOptimizersContainer:
            inherited = {f.name for f in dataclasses.fields(OptimizersContainer.Config)}
            muon_kwargs = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in inherited}
            norms = {getattr(part, _MAX_NORM_ATTR, None) for part in model_parts}
            if len(norms) != 1:
                raise ValueError(f"model parts disagree on the clipping threshold: {sorted(map(str, norms))}")
            return build_muon_optimizers(model_parts, max_norm=norms.pop(), sum_gradients=True, **muon_kwargs)

    def __init__(
        self,
        model_parts: Iterable[nn.Module],
        optimizers: Iterable[Muon],
        *,
        max_norm: float | None = None,
        sum_gradients: bool = False,
    ) -> None:
        # OptimizersContainer.__init__ builds optimizers from regex configs: not wanted here.
        self.model_parts = list(model_parts)
        self.optimizers = list(optimizers)
        self.max_norm = max_norm
        self.sum_gradients = sum_gradients
        self.grad_norm: torch.Tensor | None = None
        if len(self.model_parts) != len(self.optimizers):
            raise ValueError(f"{len(self.model_parts)} model parts but {len(self.optimizers)} optimizers")
        for model, optimizer in zip(self.model_parts, self.optimizers):
            if not isinstance(optimizer, Muon) or optimizer.model is not model:
                raise ValueError("each optimizer must be a dmuon.Muon built for the model part at its position")
        self._post_init([p for model in self.model_parts for p in model.parameters() if p.requires_grad])

    def step(self, closure: Callable[[], float] | None = None) -> None:
        if closure is not None:
            raise ValueError("MuonOptimizersContainer does not support closures")
        dedicated = _dedicated_grads(self.model_parts)
        if self.sum_gradients:
            for grad, world_size, _ in dedicated:
                grad.mul_(world_size)
        if self.max_norm is not None and math.isfinite(self.max_norm):
            owned = [(grad, copies) for grad, _, copies in dedicated]
            self.grad_norm = _clip_jointly_(self.model_parts, owned, self.max_norm)
        for optimizer in self.optimizers:
            optimizer.step()

    def state_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for model, optimizer in zip(self.model_parts, self.optimizers):
            out.update(get_optimizer_state_dict(model, optimizer, options=_FLAT))
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for model, optimizer in zip(self.model_parts, self.optimizers):
            set_optimizer_state_dict(model, optimizer, state_dict, options=_FLAT)


def _dedicated_grads(model_parts: list[nn.Module]) -> list[tuple[torch.Tensor, int, int]]:
    """Each dedicated gradient this rank holds as global owner, with its data-parallel size and
    the number of owners holding the same gradient (one per tensor-parallel rank)."""
    out = []
    for part in model_parts:
        copies = getattr(part, _COPIES_ATTR, 1)
        for rec in get_registry(part) or ():
            master = rec.master if rec.is_global_owner else None
            if master is not None and master.grad is not None:
                out.append((master.grad, rec.topo.world_size, copies))
    return out


def _clip_jointly_(
    model_parts: list[nn.Module], dedicated: list[tuple[torch.Tensor, int]], max_norm: float
) -> torch.Tensor:
    """Clip sharded and dedicated gradients by their joint 2-norm; return that norm.

    Each rank sums the squares of what it holds, counted once per job: a DTensor gradient's
    local shard divided by the number of ranks that hold the same shard (its ``Replicate``
    dimensions), a dedicated gradient on its global owner (divided by the number of such owners:
    one per tensor-parallel rank). One all-reduce over the world adds
    the shares. That is right whatever meshes the gradients live on (expert stacks on
    ``(efsdp, ep)``, dense weights on ``fsdp``) and across pipeline stages, whose parts hold
    different weights; a norm per mesh, as ``get_total_norm`` takes it, would not add up.
    """
    grads = [p.grad for part in model_parts for p in part.parameters() if p.grad is not None]
    device = next((g.device for g, _ in dedicated), None) or next(iter(model_parts[0].parameters())).device
    mine = torch.zeros((), dtype=torch.float32, device=device)
    for grad in grads:
        mine = mine + _squares_once(grad).to(device)
    for grad, copies in dedicated:
        mine = mine + grad.detach().float().pow(2).sum() / copies
    dist.all_reduce(mine)
    total = mine.sqrt()
    # torch's clip_grads_with_norm_ takes parameters, not gradients; scale the tensors here
    scale = (max_norm / (total + 1e-6)).clamp(max=1.0)
    with torch.no_grad():
        for grad in grads + [g for g, _ in dedicated]:
            local = grad.to_local() if isinstance(grad, DTensor) else grad
            local.mul_(scale.to(local.device))
    return total


def _squares_once(grad: torch.Tensor) -> torch.Tensor:
    """This rank's share of ``grad``'s sum of squares, such that the world's shares add to it."""
    if not isinstance(grad, DTensor):
        # a plain gradient outside any mesh: every rank of the job holds the same one
        return grad.detach().float().pow(2).sum() / dist.get_world_size()
    copies = 1
    for size, placement in zip(grad.device_mesh.shape, grad.placements):
        if placement.is_partial():
            raise ValueError(f"cannot clip a gradient still waiting for its reduction ({grad.placements})")
        if placement.is_replicate():
            copies *= size
    return grad.to_local().detach().float().pow(2).sum() / copies


def build_muon_optimizers(
    model_parts: Iterable[nn.Module], *, max_norm: float | None = None, sum_gradients: bool = False, **muon_kwargs: Any
) -> MuonOptimizersContainer:
    """One ``dmuon.Muon(part, **muon_kwargs)`` per model part, in a torchtitan container.

    Each part must already have its dedicated parameters (``dmuon.dedicate_params``) and be
    wrapped with ``fully_shard``. ``max_norm`` and ``sum_gradients``: see
    :class:`MuonOptimizersContainer` (both off for a hand-written loop that averages).
    """
    parts = list(model_parts)
    return MuonOptimizersContainer(
        parts, [Muon(part, **muon_kwargs) for part in parts], max_norm=max_norm, sum_gradients=sum_gradients
    )


def default_predicate(fqn: str, param: nn.Parameter) -> bool:
    """The matrices of the transformer blocks (``layers.*``): Muon's usual choice.

    Embeddings and the output head stay FSDP shards updated with AdamW.
    """
    return param.ndim == 2 and fqn.startswith("layers.")


def default_expert_stacks(model: nn.Module) -> Callable[[str, nn.Parameter], bool]:
    """The 3-D parameters of the model's ``GroupedExperts`` (``w1``, ``w2``, ``w3``: one matrix
    per expert, ``[experts, out, in]``), for ``dedicate_params(expert_stacks=)``.

    Chosen by module type, not by name or shape: a 3-D weight of another module (a convolution)
    keeps the meaning it had.
    """
    from torchtitan.models.common.moe import GroupedExperts

    stacks = {
        compat.state_dict_name(f"{prefix}.{name}" if prefix else name)
        for prefix, module in model.named_modules()
        if isinstance(module, GroupedExperts)
        for name, param in module.named_parameters(recurse=False)
        if param.ndim == 3
    }
    return lambda fqn, param: fqn in stacks


def dedicated_parallelize(
    parallelize_fn: Callable[..., nn.Module],
    predicate: Callable[[str, nn.Parameter], bool] = default_predicate,
    **dedicate_kwargs: Any,
) -> Callable[..., nn.Module]:
    """A torchtitan ``parallelize_fn`` that dedicates the selected weights, then runs ``parallelize_fn``.

    The Trainer calls it with the model (with pipeline stages: each model part in turn) still on
    the meta device; ``dedicate_params`` takes it there, before the wrapped function applies
    expert parallelism, activation checkpointing, ``torch.compile`` and ``fully_shard`` (FSDP2
    leaves dedicated parameters alone). The mesh is the Trainer's ``fsdp`` mesh (with
    ``dp_replicate``: HSDP; with pipeline stages: the data-parallel ranks of this stage);
    dedicated weights compute in ``training.mixed_precision_param``, as FSDP's shards do.
    The experts' stacks (:func:`default_expert_stacks`) are updated by Muon per expert where
    expert parallelism and FSDP put them. ``dedicate_kwargs`` overrides these choices.
    With tensor parallelism (``parallelism.tensor_parallel_degree``) the weights are chosen
    once torchtitan's TP plan has laid the model out, before FSDP: the selected matrices the
    plan laid out stay its DTensors and are updated whole on a home rank
    (``sharded_matrices=``, :mod:`.torchtitan_tp`); the others are dedicated. Context
    parallelism is refused (a dedicated weight is whole), and so are asynchronous TP, float8
    layers under TP, and an ``spmd_backend`` other than ``"partial_dtensor"`` (set it in the
    config).

    It also takes gradient clipping over: ``training.max_norm`` is handed to
    :class:`MuonOptimizersContainer` (through the model parts) and set to infinity for
    torchtitan's own clipping, which does not see dedicated gradients.
    """
    from torchtitan.config import TORCH_DTYPE_MAP

    # the threshold each Trainer config was given, kept across the calls for its model parts
    thresholds: dict[int, float] = {}

    @functools.wraps(parallelize_fn)
    def parallelize(
        model: nn.Module, *, parallel_dims: Any, training: Any, parallelism: Any, **kwargs: Any
    ) -> nn.Module:
        if parallelism.spmd_backend != "partial_dtensor":
            raise NotImplementedError(
                f"dmuon needs parallelism.spmd_backend='partial_dtensor' (got {parallelism.spmd_backend!r}): "
                "the other backends have FSDP expect every parameter as a DTensor on the full mesh, "
                "and a dedicated parameter is a plain tensor"
            )
        refused = [name for name in _REFUSED if getattr(parallel_dims, f"{name}_enabled")]
        if refused:
            raise NotImplementedError(
                f"dmuon's dedicated weights do not support {', '.join(_REFUSED[name] for name in refused)} yet; "
                f"enabled here: {refused}"
            )
        if parallel_dims.tp_enabled:
            refuse_with_tensor_parallelism(model, kwargs.get("compile_config"))
        replicate = parallel_dims.get_mesh("dp_replicate") if parallel_dims.dp_replicate_enabled else None
        options = {
            "param_dtype": TORCH_DTYPE_MAP[training.mixed_precision_param],
            "expert_stacks": default_expert_stacks(model),
            **dedicate_kwargs,
        }

        def dedicate(model: nn.Module, **chosen: Any) -> None:
            mesh = parallel_dims.get_mesh("fsdp")
            dedicate_params(model, mesh, predicate, replicate_mesh=replicate, **{**options, **chosen})

        if parallel_dims.tp_enabled:
            ran = dedicate_after_tensor_parallelism(model, predicate, options, dedicate)
        else:
            dedicate(model)
            ran = [True]
        model = parallelize_fn(model, parallel_dims=parallel_dims, training=training, parallelism=parallelism, **kwargs)
        if not ran:
            raise NotImplementedError(
                "with tensor parallelism dmuon needs the model's parallelize_fn to apply the TP plan through "
                "torchtitan's Module.parallelize (as Llama 3's does); this one did not call it"
            )
        threshold = thresholds.setdefault(id(training), training.max_norm)
        setattr(model, _MAX_NORM_ATTR, threshold)
        # a dedicated weight outside the TP plan is held by an owner in each TP rank's fsdp mesh
        setattr(model, _COPIES_ATTR, parallel_dims.tp if parallel_dims.tp_enabled else 1)
        training.max_norm = math.inf
        return model

    return parallelize


#: the parallelisms a dedicated weight cannot take part in yet, by torchtitan's short name
_REFUSED = {"cp": "context parallelism"}


def with_dmuon(
    config: Any,
    *,
    predicate: Callable[[str, nn.Parameter], bool] = default_predicate,
    dedicate_options: dict[str, Any] | None = None,
    **muon_kwargs: Any,
) -> Any:
    """Make a torchtitan ``Trainer.Config`` train with ``dmuon.Muon``; return it.

    Its model spec's ``parallelize_fn`` becomes :func:`dedicated_parallelize` of itself
    (``predicate`` and ``dedicate_options`` go to ``dmuon.dedicate_params``), and its optimizer
    :class:`MuonOptimizersContainer.Config` with ``muon_kwargs`` (``dmuon.Muon``'s arguments:
    ``lr``, ``adamw_lr``, ...; each is also a ``--optimizer.<name>`` command-line option).
    Everything else (checkpointing and its async modes, compile, the LR schedule) is the
    config's own.
    """
    spec = config.model_spec
    if spec is None:
        raise ValueError("the Trainer.Config has no model_spec to run with dmuon")
    parallelize = dedicated_parallelize(spec.parallelize_fn, predicate, **(dedicate_options or {}))
    config.model_spec = dataclasses.replace(spec, parallelize_fn=parallelize)
    config.optimizer = MuonOptimizersContainer.Config(**muon_kwargs)
    return config
