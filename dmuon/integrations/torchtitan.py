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

Call ``dmuon.dedicate_params`` in your parallelize function before torchtitan's
``fully_shard`` calls, then build the optimizers with :func:`build_muon_optimizers`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torchtitan.components.optimizer import OptimizersContainer

from ..optim.muon import Muon

__all__ = ["MuonOptimizersContainer", "build_muon_optimizers"]

#: torchtitan's own optimizer checkpoints are flat (``state.<fqn>.<name>``).
_FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


class MuonOptimizersContainer(OptimizersContainer):
    """torchtitan's optimizer container holding one ``dmuon.Muon`` per model part.

    ``step``, ``zero_grad``, hooks and the LR-scheduler builders behave as for torchtitan's own
    optimizers. Checkpoints hold, per model part, what torch's ``get_optimizer_state_dict``
    returns for it.
    """

    def __init__(self, model_parts: Iterable[nn.Module], optimizers: Iterable[Muon]) -> None:
        # OptimizersContainer.__init__ builds optimizers from regex configs: not wanted here.
        self.model_parts = list(model_parts)
        self.optimizers = list(optimizers)
        if len(self.model_parts) != len(self.optimizers):
            raise ValueError(f"{len(self.model_parts)} model parts but {len(self.optimizers)} optimizers")
        for model, optimizer in zip(self.model_parts, self.optimizers):
            if not isinstance(optimizer, Muon) or optimizer.model is not model:
                raise ValueError("each optimizer must be a dmuon.Muon built for the model part at its position")
        self._post_init([p for model in self.model_parts for p in model.parameters() if p.requires_grad])

    def state_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for model, optimizer in zip(self.model_parts, self.optimizers):
            out.update(get_optimizer_state_dict(model, optimizer, options=_FLAT))
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for model, optimizer in zip(self.model_parts, self.optimizers):
            set_optimizer_state_dict(model, optimizer, state_dict, options=_FLAT)


def build_muon_optimizers(model_parts: Iterable[nn.Module], **muon_kwargs: Any) -> MuonOptimizersContainer:
    """One ``dmuon.Muon(part, **muon_kwargs)`` per model part, in a torchtitan container.

    Each part must already have its dedicated parameters (``dmuon.dedicate_params``) and be
    wrapped with ``fully_shard``.
    """
    parts = list(model_parts)
    return MuonOptimizersContainer(parts, [Muon(part, **muon_kwargs) for part in parts])
