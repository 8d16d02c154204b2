"""What the optimizer keeps per parameter, declared once: checkpoints derive keys and shapes here.

:data:`STATE_FIELDS` names each group's per-parameter state; a dedicated parameter's state
lives on its global owner only, so the checkpoint code asks :func:`state_field_spec` for what
every rank should expect under its keys.
"""

from __future__ import annotations

import torch

from ..dedicated import DedicatedParam

__all__ = [
    "ADAMW_GROUP",
    "MUON_GROUP",
    "SCALAR_DTYPE",
    "STATE_FIELDS",
    "apply_hyperparameters",
    "state_field_shape",
    "state_field_spec",
    "state_fields",
]

MUON_GROUP = "muon"
ADAMW_GROUP = "adamw"

#: Per-parameter optimizer state of each group: name -> "param" (shaped like the parameter,
#: in the master's dtype) or "scalar" (a 0-d float32 counter).
STATE_FIELDS: dict[str, dict[str, str]] = {
    MUON_GROUP: {"momentum_buffer": "param"},
    ADAMW_GROUP: {"step": "scalar", "exp_avg": "param", "exp_avg_sq": "param"},
}
SCALAR_DTYPE = torch.float32


def state_field_shape(kind: str, param_shape) -> tuple[int, ...]:
    return () if kind == "scalar" else tuple(param_shape)


def state_fields(rec: DedicatedParam) -> dict[str, str]:
    """The optimizer state a dedicated parameter has on its global owner: name -> kind."""
    return STATE_FIELDS[MUON_GROUP if rec.uses_muon else ADAMW_GROUP]


def state_field_spec(kind: str, rec: DedicatedParam) -> tuple[tuple[int, ...], torch.dtype]:
    """(shape, dtype) of one field of a dedicated parameter's state, on every rank alike."""
    return state_field_shape(kind, rec.shape), SCALAR_DTYPE if kind == "scalar" else rec.master_dtype


def apply_hyperparameters(group: dict, saved: dict) -> None:
    """Saved hyper-parameters into a param group; a tuple comes back as a tuple, even where a
    checkpoint format turned it into a list (``betas``)."""
    for key, value in saved.items():
        if key == "params":
            continue
        if isinstance(group.get(key), tuple) and isinstance(value, list):
            value = tuple(value)
        group[key] = value
