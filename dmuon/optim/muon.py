"""One optimizer for the whole model: Muon on dedicated matrices and expert stacks, AdamW on
everything else.

The param groups hold the model's own parameters, the same list on every rank, so that code
which maps optimizer state to FQNs through ``model.named_parameters()`` (torch's
``get_optimizer_state_dict``) finds every entry. The update of a dedicated parameter is
applied to its fp32 master, on its global owner only: there ``state[param]`` holds its
momentum (or Adam moments); on every other rank it is an empty dict. AdamW runs on every
rank's FSDP2 shards (elementwise, so local shards are enough) and on any other trainable
parameter. State is allocated eagerly so checkpoints always find it: what each group keeps
per parameter is declared once, in ``state_fields.py``.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from typing import Any, TypeVar

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from .. import compat
from ..dedicated import DedicatedParam, get_registry
from ..fsdp_patch import is_dedicated
from ..owner_transfer import from_global_owner
from ..snapshot import wait_for_snapshots
from .expert_stacks import StackPlan, muon_scale, orthogonalize_stacks, plan_stacks
from .newton_schulz import orthogonalize
from .sharded_matrices import MatrixPlan, orthogonalize_matrices, plan_matrices
from .state_fields import (
    ADAMW_GROUP,
    MUON_GROUP,
    SCALAR_DTYPE,
    STATE_FIELDS,
    apply_hyperparameters,
    state_field_spec,
    state_fields,
)

__all__ = ["Muon"]

_Plan = TypeVar("_Plan", StackPlan, MatrixPlan)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """The rank-local storage of a DTensor (a view: in-place updates reach the DTensor)."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _or_zeros(held: list[tuple[_Plan, torch.Tensor, torch.Tensor | None]]) -> list[tuple[_Plan, torch.Tensor]]:
    """Every rank of a mesh takes part in the update, with or without a gradient (a zero one)."""
    return [(plan, update if update is not None else torch.zeros_like(value)) for plan, value, update in held]


def _apply(group: dict, held: list[tuple[tuple[int, int], torch.Tensor, torch.Tensor | None]], done) -> None:
    """Weight decay and the scaled orthogonalised update on each local piece that had a gradient."""
    lr, wd = group["lr"], group["weight_decay"]
    for (matrix, value, update), ortho in zip(held, done):
        if update is None:
            continue
        if wd:
            value.mul_(1.0 - lr * wd)
        value.add_(ortho, alpha=-lr * muon_scale(*matrix))


class Muon(torch.optim.Optimizer):
    """One optimizer for the whole model: Muon for dedicated matrices, AdamW for the rest.

    Build it after ``dmuon.dedicate_params`` and ``fully_shard``. Each dedicated matrix (2-D or
    more, flattened to 2-D) is updated by Muon on its global owner only: momentum, Nesterov,
    then ``ns_steps`` Newton-Schulz iterations that orthogonalise the update. Each expert of an
    expert stack (``dedicate_params(..., expert_stacks=...)``) gets the same update as a 2-D
    matrix of its own, on the one rank that owns it (``expert_stacks.py``). Every other
    trainable parameter (FSDP2 shards, dedicated vectors) gets AdamW on its local shard. Both
    groups live in ``param_groups`` (named ``"muon"`` and ``"adamw"``) so schedulers see them.

    Args:
        model: the model ``dedicate_params`` was called on (the optimizer reads its registry).
        lr: Muon's learning rate.
        momentum: Muon's momentum coefficient, in [0, 1).
        nesterov: use the Nesterov form of the momentum update.
        ns_steps: Newton-Schulz iterations per step (0 skips orthogonalisation).
        weight_decay: Muon's decoupled weight decay.
        adamw_lr, adamw_betas, adamw_eps, adamw_weight_decay: AdamW's hyper-parameters for
            every parameter that is not a dedicated matrix.
        replicate_async: under HSDP, send the global owner's new master to its replicas
            without waiting (drained at the next forward of its module, or by
            ``dmuon.wait_all_replicate_broadcasts``); False waits inside ``step()``.
    """

    def __init__(
        self,
        model: nn.Module,
        lr: float = 0.02,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_steps: int = 5,
        weight_decay: float = 0.0,
        adamw_lr: float = 1e-3,
        adamw_betas: tuple[float, float] = (0.9, 0.999),
        adamw_eps: float = 1e-8,
        adamw_weight_decay: float = 0.01,
        replicate_async: bool = True,
    ) -> None:
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"momentum must be in [0, 1), got {momentum}")
        if ns_steps < 0:
            raise ValueError(f"ns_steps must be >= 0, got {ns_steps}")
        self.model = model
        self.registry = get_registry(model)
        if self.registry is not None:
            self.registry.materialize()  # a meta-built model: adopt what init wrote (deferred_init.py)
        self.replicate_async = replicate_async
        self.fqn_of: dict[int, str] = {}
        self.dedicated_of: dict[int, DedicatedParam] = {}
        muon_params: list[nn.Parameter] = []
        adamw_params: list[nn.Parameter] = []
        for rec in self.registry or ():
            if rec.trainable:
                (muon_params if rec.uses_muon else adamw_params).append(rec.param)
                self.fqn_of[id(rec.param)] = rec.fqn
                self.dedicated_of[id(rec.param)] = rec
        stack_names = self.registry.stack_fqns if self.registry is not None else frozenset()
        matrix_names = self.registry.matrix_fqns if self.registry is not None else frozenset()
        stacks: list[tuple[str, nn.Parameter]] = []
        matrices: list[tuple[str, nn.Parameter]] = []
        for fqn, param in model.named_parameters():
            if is_dedicated(param) or not param.requires_grad:
                continue
            name = compat.state_dict_name(fqn)  # checkpoint keys, as state_dict's
            if name in stack_names or name in matrix_names:
                (stacks if name in stack_names else matrices).append((name, param))
                muon_params.append(param)
            else:
                adamw_params.append(param)
            self.fqn_of[id(param)] = name
        # the owners of each expert follow from the stack's layout: refused here, by name, if
        # the update cannot handle it, before any step
        self.stack_plans = {id(param): plan for (_, param), plan in zip(stacks, plan_stacks(stacks).values())}
        # a sharded matrix's home follows from its layout too (sharded_matrices.py)
        self.matrix_plans = {id(p): plan for (_, p), plan in zip(matrices, plan_matrices(matrices).values())}
        groups = [
            dict(
                name=MUON_GROUP,
                params=muon_params,
                lr=lr,
                momentum=momentum,
                nesterov=nesterov,
                ns_steps=ns_steps,
                weight_decay=weight_decay,
            ),
            dict(
                name=ADAMW_GROUP,
                params=adamw_params,
                lr=adamw_lr,
                betas=tuple(adamw_betas),
                eps=adamw_eps,
                weight_decay=adamw_weight_decay,
            ),
        ]
        super().__init__(groups, defaults={})
        self._init_state()

    def _init_state(self) -> None:
        for group in self.param_groups:
            for param in group["params"]:
                target = self.update_target(param)
                self.state[param] = {} if target is None else self.fresh_state(group["name"], target)

    @staticmethod
    def fresh_state(group_name: str, param: torch.Tensor) -> dict[str, torch.Tensor]:
        """Zero state for one parameter; also the template checkpoint loading fills in."""
        return {
            name: torch.zeros((), dtype=SCALAR_DTYPE)
            if kind == "scalar"
            else torch.zeros_like(param, memory_format=torch.preserve_format)
            for name, kind in STATE_FIELDS[group_name].items()
        }

    def update_target(self, param: torch.Tensor) -> torch.Tensor | None:
        """What ``step`` updates for ``param``: itself, or a dedicated parameter's master on its
        global owner (None on every other rank)."""
        rec = self.dedicated_of.get(id(param))
        if rec is None:
            return param
        return rec.master if rec.is_global_owner else None

    def plain_params(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(fqn, param) of the parameters that are not dedicated (FSDP2 shards, expert stacks,
        any other trainable tensor), with their state where they lie: the same list on every
        rank that holds the model."""
        for group in self.param_groups:
            for param in group["params"]:
                if id(param) not in self.dedicated_of:
                    yield self.fqn_of[id(param)], param

    def gather_dedicated_state(self, rec: DedicatedParam, rank0_only: bool) -> dict[str, torch.Tensor]:
        """Collective: the optimizer state of a dedicated parameter, sent from its global owner
        to global rank 0 (``rank0_only``) or to every rank; ``{}`` on the ranks that get none."""
        gathered = {}
        for name, kind in state_fields(rec).items():
            shape, dtype = state_field_spec(kind, rec)
            mine = self.state[rec.param][name] if rec.is_global_owner else None
            full = from_global_owner(rec, mine, rank0_only, shape=shape, dtype=dtype)
            if full is not None:
                gathered[name] = full
        return gathered

    def group(self, name: str) -> dict:
        for group in self.param_groups:
            if group.get("name") == name:
                return group
        raise KeyError(f"optimizer has no param group named {name!r}")

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        for rec in self.dedicated_of.values():
            master = rec.master if rec.is_global_owner else None
            if master is None or master.grad is None:
                continue
            if set_to_none:
                master.grad = None
            else:
                master.grad.detach_().zero_()

    # -- torch's optimizer state-dict protocol --------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """torch's layout (state keyed by position in the param groups).

        A dedicated parameter's entry is empty except on its global owner. Under torch's
        ``get_optimizer_state_dict(full_state_dict=True)`` it is sent from the owner to the
        ranks torch returns a full dict on, as torch does with DTensor shards.
        """
        if self.registry is not None:
            self.registry.wait_all()  # a replica's master must not be mid-broadcast when read
        out = super().state_dict()
        request = compat.state_dict_request("optim")
        if request is None or not request.full_state_dict:
            return out
        positions = {
            id(p): i for i, p in enumerate(itertools.chain.from_iterable(g["params"] for g in self.param_groups))
        }
        for group in self.param_groups:
            for param in group["params"]:
                rec = self.dedicated_of.get(id(param))
                gathered = self.gather_dedicated_state(rec, request.cpu_offload) if rec is not None else None
                if gathered:
                    out["state"][positions[id(param)]] = gathered
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Copy a ``state_dict()``-shaped dict into the existing state, in place.

        Everything is checked first (nothing changes on a mismatch). Entries for dedicated
        parameters this rank does not own are ignored, so a full dict loads on every rank;
        tensors keep their dtype (a master's fp32 momentum is never cast to the compute dtype).
        """
        pre_hooks, post_hooks = compat.optimizer_load_state_dict_hooks(self)
        for pre_hook in pre_hooks:
            result = pre_hook(self, state_dict)
            if result is not None:
                state_dict = result
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(
                f"the state dict has {len(saved_groups)} param groups, the optimizer {len(self.param_groups)}"
            )
        id_map: dict[Any, nn.Parameter] = {}
        for mine, saved in zip(self.param_groups, saved_groups):
            if len(saved["params"]) != len(mine["params"]):
                raise ValueError(
                    f"param group {mine['name']!r}: {len(saved['params'])} parameters in the "
                    f"state dict, {len(mine['params'])} in the optimizer"
                )
            id_map.update(zip(saved["params"], mine["params"]))
        problems: list[str] = []
        copies: list[tuple[torch.Tensor, Any]] = []
        for key, entry in state_dict["state"].items():
            param = id_map.get(key)
            if param is None:
                problems.append(f"state for parameter {key!r}, which no param group lists")
                continue
            targets = self.state[param]
            name_of = self.fqn_of.get(id(param), key)
            for field_name, target in targets.items():
                value = entry.get(field_name)
                if value is None:
                    problems.append(f"{name_of}: no {field_name!r}")
                elif isinstance(value, torch.Tensor) and tuple(value.shape) != tuple(target.shape):
                    problems.append(
                        f"{name_of}.{field_name}: shape {tuple(value.shape)}, expected {tuple(target.shape)}"
                    )
                else:
                    copies.append((target, value))
        if problems:
            raise ValueError(
                "Muon.load_state_dict: the state dict does not fit the optimizer "
                "(nothing was loaded):\n  " + "\n  ".join(problems)
            )
        with torch.no_grad():
            for target, value in copies:
                if isinstance(value, torch.Tensor):
                    target.copy_(value)
                else:
                    target.fill_(value)
        for mine, saved in zip(self.param_groups, saved_groups):
            apply_hyperparameters(mine, saved)
        for post_hook in post_hooks:
            post_hook(self)

    # -- the update --------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        wait_for_snapshots(self.model)  # an async save's copy of the state at its call comes first
        if self.registry is not None:
            # A second step without a forward in between must not race the pending broadcast.
            self.registry.wait_all()
        for group in self.param_groups:
            if group["name"] == MUON_GROUP:
                self._muon_step(group)
            else:
                self._adamw_step(group)
        if self.registry is not None:
            for rec in self.registry:
                rec.reshard()  # full copies from this step's forward are stale now
                if rec.trainable:
                    rec.publish_to_replicas(async_op=self.replicate_async)
        return loss

    def _muon_step(self, group: dict) -> None:
        lr, wd = group["lr"], group["weight_decay"]
        stacks: list[tuple[StackPlan, torch.Tensor, torch.Tensor | None]] = []
        matrices: list[tuple[MatrixPlan, torch.Tensor, torch.Tensor | None]] = []
        for model_param in group["params"]:
            # (a stack or a sharded matrix is not dedicated: its own update target)
            if (stack := self.stack_plans.get(id(model_param))) is not None:
                stacks.append((stack, _local(model_param), self._momentum_update(group, model_param, model_param)))
                continue
            if (matrix := self.matrix_plans.get(id(model_param))) is not None:
                matrices.append((matrix, _local(model_param), self._momentum_update(group, model_param, model_param)))
                continue
            param = self.update_target(model_param)
            if param is None or param.grad is None:
                continue
            update = self._momentum_update(group, model_param, param)
            assert update is not None
            rows = update.shape[0]  # a dedicated tensor of more dims: flattened, as convolutions are
            ortho = orthogonalize(update.reshape(rows, -1), group["ns_steps"]).view(param.shape)
            if wd:
                param.mul_(1.0 - lr * wd)
            param.add_(ortho, alpha=-lr * muon_scale(rows, update[0].numel()))
        if stacks:
            done = orthogonalize_stacks(_or_zeros(stacks), group["ns_steps"])
            _apply(group, [(plan.matrix, value, update) for plan, value, update in stacks], done)
        if matrices:
            done = orthogonalize_matrices(_or_zeros(matrices), group["ns_steps"])
            _apply(group, [(plan.matrix, value, update) for plan, value, update in matrices], done)

    def _momentum_update(self, group: dict, model_param: torch.Tensor, param: torch.Tensor) -> torch.Tensor | None:
        """Momentum (and Nesterov) on this rank's part of ``param``: the update to orthogonalise."""
        if param.grad is None:
            return None
        grad, mu = _local(param.grad), group["momentum"]
        buf = _local(self.state[model_param]["momentum_buffer"])
        buf.mul_(mu).add_(grad)
        return grad.add(buf, alpha=mu) if group["nesterov"] else buf

    def _adamw_step(self, group: dict) -> None:
        lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
        beta1, beta2 = group["betas"]
        for model_param in group["params"]:
            param = self.update_target(model_param)
            if param is None or param.grad is None:
                continue
            state = self.state[model_param]
            state["step"] += 1
            step = state["step"].item()
            grad = _local(param.grad)
            value = _local(param)
            exp_avg, exp_avg_sq = _local(state["exp_avg"]), _local(state["exp_avg_sq"])
            exp_avg.mul_(beta1).add_(grad, alpha=1.0 - beta1)
            exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
            if wd:
                value.mul_(1.0 - lr * wd)
            denom = (exp_avg_sq.sqrt() / math.sqrt(1.0 - beta2**step)).add_(eps)
            value.addcdiv_(exp_avg, denom, value=-lr / (1.0 - beta1**step))
