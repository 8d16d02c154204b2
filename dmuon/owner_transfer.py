"""Moving a tensor only the global owner of a dedicated parameter has, to rank 0 or to all.

The flat state-dict API (``state_dict.py``), the optimizer's state gathering and torch's
``get_model_state_dict(full_state_dict=True)`` (``dedicated_state_dict.py``) all need a
dedicated weight or its optimizer state where only its global owner keeps it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .dedicated import DedicatedParam
from .topology import current_rank

__all__ = ["from_global_owner"]


def from_global_owner(
    rec: DedicatedParam,
    value: torch.Tensor | None,
    rank0_only: bool,
    shape: tuple[int, ...] | None = None,
    dtype: torch.dtype | None = None,
) -> torch.Tensor | None:
    """Collective: ``value`` (given on the global owner) to global rank 0, or to every rank.

    ``shape`` / ``dtype`` default to the master's; optimizer step counters pass ``()``.
    """
    shape = tuple(rec.shape) if shape is None else shape
    dtype = rec.master_dtype if dtype is None else dtype
    src = rec.topo.global_rank(rec.owner)
    me = current_rank()
    if me == src:
        if value is None:
            raise ValueError(f"the global owner of {rec.fqn} must pass its value")
        value = value.to(rec.topo.device)  # a CPU step counter must travel on the device
    if rank0_only:
        if me == src:
            assert value is not None
            if me != 0:
                dist.send(value.contiguous(), dst=0)
            return value if me == 0 else None
        if me == 0:
            buf = torch.empty(shape, dtype=dtype, device=rec.topo.device)
            dist.recv(buf, src=src)
            return buf
        return None
    buf = value if value is not None and me == src else torch.empty(shape, dtype=dtype, device=rec.topo.device)
    dist.broadcast(buf, src=src)
    return buf
