"""One optimizer for the whole model: Muon on dedicated matrices, AdamW on everything else.

Muon runs only on the global owner of each dedicated matrix, on its fp32 master. AdamW runs on
every rank's FSDP2 shards (elementwise, so local shards are enough) and on any other trainable
parameter. State is allocated eagerly so checkpoints always find it, keyed by FQN through
:attr:`Muon.fqn_of`.
"""
from __future__ import annotations

import math

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from ..dedicated import DedicatedParam, get_registry
from ..fsdp_patch import is_dedicated
from .newton_schulz import orthogonalize

MUON_GROUP = "muon"
ADAMW_GROUP = "adamw"


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """The rank-local storage of a DTensor (a view: in-place updates reach the DTensor)."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


class Muon(torch.optim.Optimizer):
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
        self.replicate_async = replicate_async
        self.fqn_of: dict[int, str] = {}
        self.dedicated_of: dict[int, DedicatedParam] = {}
        muon_params: list[nn.Parameter] = []
        adamw_params: list[nn.Parameter] = []
        for rec in self.registry or ():
            if rec.is_global_owner and rec.trainable:
                (muon_params if rec.uses_muon else adamw_params).append(rec.master)
                self.fqn_of[id(rec.master)] = rec.fqn
                self.dedicated_of[id(rec.master)] = rec
        for fqn, param in model.named_parameters():
            if is_dedicated(param) or not param.requires_grad:
                continue
            adamw_params.append(param)
            self.fqn_of[id(param)] = fqn
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
                self.state[param] = self.fresh_state(group["name"], param)

    @staticmethod
    def fresh_state(group_name: str, param: torch.Tensor) -> dict[str, torch.Tensor]:
        """Zero state for one parameter; also the template checkpoint loading fills in."""
        if group_name == MUON_GROUP:
            return {"momentum_buffer": torch.zeros_like(param, memory_format=torch.preserve_format)}
        return {
            "step": torch.zeros((), dtype=torch.float32),
            "exp_avg": torch.zeros_like(param, memory_format=torch.preserve_format),
            "exp_avg_sq": torch.zeros_like(param, memory_format=torch.preserve_format),
        }

    def group(self, name: str) -> dict:
        for group in self.param_groups:
            if group.get("name") == name:
                return group
        raise KeyError(f"optimizer has no param group named {name!r}")

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
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
        lr, mu, wd = group["lr"], group["momentum"], group["weight_decay"]
        for param in group["params"]:
            grad = param.grad
            if grad is None:
                continue
            buf = self.state[param]["momentum_buffer"]
            buf.mul_(mu).add_(grad)
            update = grad.add(buf, alpha=mu) if group["nesterov"] else buf
            rows = update.shape[0]
            ortho = orthogonalize(update.reshape(rows, -1), group["ns_steps"]).view(param.shape)
            scale = 0.2 * math.sqrt(max(rows, update[0].numel()))
            if wd:
                param.mul_(1.0 - lr * wd)
            param.add_(ortho, alpha=-lr * scale)

    def _adamw_step(self, group: dict) -> None:
        lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
        beta1, beta2 = group["betas"]
        for param in group["params"]:
            if param.grad is None:
                continue
            state = self.state[param]
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
