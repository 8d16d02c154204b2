"""The one monkey patch dmuon makes: torch's ``fully_shard`` skips dedicated parameters.

``fully_shard`` already accepts ``ignored_params``; this patch wraps the internal helper that
collects a module's parameters so it adds every parameter marked by ``dedicate_params``, and
gathers the dedicated parameters' unshard/reshard hooks onto the module being sharded
(:meth:`~dmuon.dedicated.DedicatedRegistry.gather_hooks`), where FSDP2 puts its own. Users
keep calling ``fully_shard(layer, mesh=mesh)`` unchanged, however they imported it, because
``fully_shard`` looks the helper up in its module's globals on every call.
"""

from __future__ import annotations

import functools
import inspect

import torch

from .compat import FSDP_PATCH_MODULE as _TARGET_MODULE
from .compat import FSDP_PATCH_TARGET as _TARGET_NAME

__all__ = ["DEDICATED_ATTR", "FSDPPatchError", "install", "is_dedicated"]

DEDICATED_ATTR = "_dmuon_dedicated"


class FSDPPatchError(RuntimeError):
    pass


def is_dedicated(param: torch.Tensor) -> bool:
    return getattr(param, DEDICATED_ATTR, None) is not None


def install() -> None:
    """Idempotent. Fails loudly if the installed torch no longer has the patched helper."""
    import importlib

    try:
        module = importlib.import_module(_TARGET_MODULE)
    except ImportError as exc:  # pragma: no cover - depends on torch version
        raise FSDPPatchError(
            f"dmuon needs {_TARGET_MODULE} (FSDP2) but torch {torch.__version__} lacks it: {exc}"
        ) from exc
    original = getattr(module, _TARGET_NAME, None)
    if original is None or "ignored_params" not in inspect.signature(original).parameters:
        raise FSDPPatchError(
            f"dmuon's fully_shard patch target {_TARGET_MODULE}.{_TARGET_NAME}(..., ignored_params) "
            f"is missing in torch {torch.__version__}; dedicated parameters would be sharded by "
            "FSDP2, so dedicate_params is disabled (the rest of dmuon works); install a torch release the "
            "README lists as tested."
        )
    if getattr(original, "_dmuon_patched", False):
        return

    @functools.wraps(original)
    def skip_dedicated(module_arg, device, ignored_params, *args, **kwargs):
        roots = (module_arg,) if isinstance(module_arg, torch.nn.Module) else tuple(module_arg)
        dedicated = {p for root in roots for p in root.parameters() if is_dedicated(p)}
        if dedicated:
            ignored_params = set(ignored_params or ()) | dedicated
            registries = {
                id(rec.registry): rec.registry for p in dedicated if (rec := getattr(p, DEDICATED_ATTR)).registry
            }
            for registry in registries.values():
                for root in roots:
                    registry.gather_hooks(root)
        return original(module_arg, device, ignored_params, *args, **kwargs)

    skip_dedicated._dmuon_patched = True  # type: ignore[attr-defined]
    setattr(module, _TARGET_NAME, skip_dedicated)
