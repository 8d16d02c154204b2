"""torchtitan's tensor parallelism with ``with_dmuon``: the TP plan's matrices become sharded matrices.

torchtitan 0.3.0 lays a model out for TP inside its ``parallelize_fn``, through each module's
``sharding_config`` (``Module.parallelize``), before activation checkpointing, compile and
``fully_shard``. A dedicated weight cannot be TP-sharded, and the plan's placements are only
known once it has run; so :func:`dedicate_after_tensor_parallelism` has ``dedicate_params`` run
between the plan and FSDP, handing it the matrices the plan laid out as ``sharded_matrices=``
(``optim/sharded_matrices.py``: each one updated whole on a home rank).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

from torch import nn
from torch.distributed.tensor import DTensor

from .. import compat

__all__ = ["dedicate_after_tensor_parallelism", "refuse_with_tensor_parallelism"]


def refuse_with_tensor_parallelism(model: nn.Module, compile_config: Any) -> None:
    """What tensor parallelism with dmuon is not checked with, and a model without torchtitan's
    ``Module.parallelize`` (whose TP plan dmuon reads): refused by name, before any step."""
    if getattr(compile_config, "enable_async_tensor_parallel", False):
        raise NotImplementedError(
            "dmuon does not support compile.enable_async_tensor_parallel yet: asynchronous tensor parallelism "
            "(symmetric-memory matmuls fused with TP collectives) is not checked with its sharded matrices"
        )
    float8 = [name for name, module in model.named_modules() if "float8" in type(module).__name__.lower()]
    if float8:
        raise NotImplementedError(
            f"dmuon does not support float8 layers with tensor parallelism yet (found {float8[0]!r}, "
            f"{type(model.get_submodule(float8[0])).__name__}): their TP layouts are not checked with its "
            "sharded matrices"
        )
    if not callable(getattr(model, "parallelize", None)):
        raise NotImplementedError(
            f"dmuon takes tensor parallelism from torchtitan's Module.parallelize (its TP plan), which "
            f"{type(model).__name__} does not have"
        )


def dedicate_after_tensor_parallelism(
    model: nn.Module,
    predicate: Callable[[str, nn.Parameter], bool],
    options: dict[str, Any],
    dedicate: Callable[..., None],
) -> list[bool]:
    """Run ``dedicate`` as soon as torchtitan's TP plan has laid the model out, before FSDP.

    torchtitan 0.3.0 applies TP inside ``parallelize_fn`` through ``Module.parallelize`` (each
    module's ``sharding_config``), then activation checkpointing, compile and ``fully_shard``.
    The root's ``parallelize`` is wrapped for that one call: afterwards every parameter the plan
    laid out is a DTensor on the ``tp`` mesh, and the selected 2-D ones go to
    ``dedicate_params(sharded_matrices=)`` (ColwiseParallel ``Shard(0)``, RowwiseParallel
    ``Shard(1)``, ``Replicate`` where the plan keeps a matrix whole), to be updated whole on a
    home rank; the selected ones the plan left alone are dedicated as without TP. Returns a
    list that holds True once that has happened.
    """
    ran: list[bool] = []
    lay_out = cast(Callable[[Any], None], model.parallelize)
    own = model.__dict__.get("parallelize")  # an instance's own, put back after the one call

    def parallelize_then_dedicate(parallel_dims: Any) -> None:
        if own is None:
            del model.__dict__["parallelize"]
        else:
            model.__dict__["parallelize"] = own
        lay_out(parallel_dims)
        laid_out = {compat.state_dict_name(name) for name, p in model.named_parameters() if isinstance(p, DTensor)}
        stacks = options.get("expert_stacks") or (lambda fqn, param: False)
        given = options.get("sharded_matrices") or (lambda fqn, param: False)
        for name, param in model.named_parameters():
            fqn = compat.state_dict_name(name)
            if fqn in laid_out and param.ndim != 2 and predicate(fqn, param) and not stacks(fqn, param):
                raise NotImplementedError(
                    f"{fqn!r} (shape {tuple(param.shape)}) is selected for dmuon and laid out by the tensor-parallel "
                    "plan; under TP dmuon takes 2-D matrices and expert stacks only (leave it out of the predicate)"
                )

        def sharded(fqn: str, param: nn.Parameter) -> bool:
            return given(fqn, param) or (fqn in laid_out and param.ndim == 2 and predicate(fqn, param))

        dedicate(model, sharded_matrices=sharded)
        ran.append(True)

    model.__dict__["parallelize"] = parallelize_then_dedicate  # this instance's, for one call
    return ran
