"""Every private torch name dmuon depends on, in one place, each looked up on import.

dmuon is tested with the torch releases the README names and installs beside any newer one
``pyproject.toml`` admits. Each name is looked up where the tested releases keep it, then where
a newer torch moved it (the ``places`` of its :class:`_Need`). A name that no place has is not
an import error: ``import dmuon`` still works, and only the feature that needs the name is
disabled; using it raises :class:`TorchCompatError`, which names the feature, the missing name
and the installed torch version. :func:`missing_features` lists what is disabled.
``tests/core/test_compat.py`` exercises each name, and a torch without them.

What is private, and why dmuon needs it:

* ``state_dict_request`` reads the options torch's ``get_model_state_dict`` /
  ``get_optimizer_state_dict`` were called with, from the caller's frame. A dedicated weight
  is held by its owner alone; in ``full_state_dict`` mode torch only gathers DTensors, so
  without knowing the mode the full dict would silently lack every weight held elsewhere.
* ``StorageInfo``, ``CURRENT_DCP_VERSION``: the metadata torch's own DCP reader understands.
* ``rebuild_tensor``, ``storage_type_names``: the torch.save format of dmuon's data files.
* ``set_element``: non-tensor entries and extra state are put back where DCP flattened them.
"""

from __future__ import annotations

import importlib
import sys
from dataclasses import dataclass
from types import CodeType, FrameType
from typing import Any

import torch

__all__ = [
    "CURRENT_DCP_VERSION",  # noqa: F822 - served by __getattr__
    "DCP_ASYNC_THREAD_PREFIX",
    "FSDP_PATCH_MODULE",
    "FSDP_PATCH_TARGET",
    "StateDictRequest",
    "StorageInfo",  # noqa: F822 - served by __getattr__
    "TorchCompatError",
    "missing_features",
    "rebuild_tensor",  # noqa: F822 - served by __getattr__
    "require_all",
    "set_element",  # noqa: F822 - served by __getattr__
    "state_dict_request",
    "storage_type_names",  # noqa: F822 - served by __getattr__
]


class TorchCompatError(RuntimeError):
    """A dmuon feature was used whose private torch name the installed torch lacks."""


@dataclass(frozen=True)
class _Need:
    """A private torch name: the feature that needs it, and where torch releases keep it."""

    feature: str
    places: tuple[tuple[str, str], ...]  # (module, attribute), the tested releases' place first

    def find(self) -> Any:
        for module_name, attribute in self.places:
            try:
                module = importlib.import_module(module_name)
            except ImportError:
                continue
            value = getattr(module, attribute, None)
            if value is not None:
                return value
        return None

    def error(self) -> TorchCompatError:
        wanted = " or ".join(f"{module}.{attribute}" for module, attribute in self.places)
        return TorchCompatError(
            f"{self.feature} is disabled: it needs {wanted}, which torch {torch.__version__} lacks. "
            "The rest of dmuon works; for this feature install a torch release the README lists as tested"
        )


_DCP_FILES = "dmuon.dcp checkpoints (save, load, dmuon-ckpt)"
_NEEDS = {
    "StorageInfo": _Need(_DCP_FILES, (("torch.distributed.checkpoint.filesystem", "_StorageInfo"),)),
    "CURRENT_DCP_VERSION": _Need(_DCP_FILES, (("torch.distributed.checkpoint.filesystem", "CURRENT_DCP_VERSION"),)),
    "rebuild_tensor": _Need(_DCP_FILES, (("torch._utils", "_rebuild_tensor_v2"),)),
    "storage_type_names": _Need(_DCP_FILES, (("torch.storage", "_dtype_to_storage_type_map"),)),
    "set_element": _Need(
        "loading non-tensor entries and extra state from dmuon.dcp checkpoints",
        (("torch.distributed.checkpoint._traverse", "set_element"),),
    ),
    "_get_model_state_dict": _Need(
        "dedicated parameters under torch's get_model_state_dict / get_state_dict",
        (("torch.distributed.checkpoint.state_dict", "_get_model_state_dict"),),
    ),
    "_get_optim_state_dict": _Need(
        "dedicated parameters under torch's get_optimizer_state_dict / get_state_dict",
        (("torch.distributed.checkpoint.state_dict", "_get_optim_state_dict"),),
    ),
}
_found: dict[str, Any] = {name: need.find() for name, need in _NEEDS.items()}


def missing_features() -> dict[str, str]:
    """Each dmuon feature disabled by the installed torch, with the error its use raises."""
    return {need.feature: str(need.error()) for name, need in _NEEDS.items() if _found[name] is None}


def require_all(*names: str) -> None:
    """Raise :class:`TorchCompatError` before a feature starts if this torch lacks a name it needs."""
    for name in names:
        _need(name)


def _need(name: str) -> Any:
    value = _found[name]
    if value is None:
        raise _NEEDS[name].error()
    return value


def __getattr__(name: str) -> Any:
    """``compat.StorageInfo`` and the other looked-up names: raises if this torch lacks it.

    Modules that use them read them as ``compat.NAME`` when the feature runs, never with
    ``from .compat import NAME`` at import, so that a missing one fails only its feature.
    """
    if name in _NEEDS and not name.startswith("_"):
        return _need(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _code_of(function: Any) -> CodeType | None:
    """The code object of a function, through decorators such as ``torch.no_grad()``."""
    while hasattr(function, "__wrapped__"):
        function = function.__wrapped__
    return getattr(function, "__code__", None)


# ---------------------------------------------------------------------------------------------
# torch.distributed.checkpoint.state_dict: which options is the caller using?
# ---------------------------------------------------------------------------------------------
_WORKER_CODE = {kind: _code_of(_found[f"_get_{kind}_state_dict"]) for kind in ("model", "optim")}
_FRAMES_TO_SEARCH = 12


def _public_codes() -> set[CodeType]:
    """The code of torch's public state-dict functions (what calls the private workers)."""
    import torch.distributed.checkpoint.state_dict as torch_state_dict

    names = ("get_model_state_dict", "get_optimizer_state_dict", "get_state_dict")
    return {code for name in names if (code := _code_of(getattr(torch_state_dict, name, None))) is not None}


@dataclass(frozen=True)
class StateDictRequest:
    """The options of an enclosing torch ``get_model_state_dict``/``get_optimizer_state_dict``."""

    full_state_dict: bool
    cpu_offload: bool


def state_dict_request(kind: str) -> StateDictRequest | None:
    """Options of the torch ``get_*_state_dict`` call that is asking, or None if none is.

    ``kind`` is ``"model"`` or ``"optim"``. Looks a few frames up the stack for torch's
    private worker function and reads its ``info`` argument (a ``_StateDictInfo``). Where this
    torch lacks the worker, a call from torch's public functions raises
    :class:`TorchCompatError` (the options cannot be read) and any other call returns None.
    """
    target = _WORKER_CODE[kind]
    targets = {target} if target is not None else _public_codes()
    frame: FrameType | None = sys._getframe(1)
    for _ in range(_FRAMES_TO_SEARCH):
        if frame is None:
            return None
        if frame.f_code in targets:
            if target is None:
                raise _NEEDS[f"_get_{kind}_state_dict"].error()
            info = frame.f_locals.get("info")
            if info is None or not hasattr(info, "full_state_dict"):
                raise TorchCompatError(
                    f"torch {torch.__version__}'s {target.co_name} has no 'info' options: dmuon "
                    "cannot tell whether a full state dict was asked for"
                )
            return StateDictRequest(bool(info.full_state_dict), bool(info.cpu_offload))
        frame = frame.f_back
    return None


# ---------------------------------------------------------------------------------------------
# FSDP2: the helper dmuon's one patch wraps (see fsdp_patch.py; it raises FSDPPatchError when
# dedicate_params is used with a torch that lacks it)
# ---------------------------------------------------------------------------------------------
FSDP_PATCH_MODULE = "torch.distributed.fsdp._fully_shard._fully_shard"
FSDP_PATCH_TARGET = "_get_modules_and_states"


# ---------------------------------------------------------------------------------------------
# torch's thread-based dcp.async_save: how its worker thread is named (see exit_guard.py)
# ---------------------------------------------------------------------------------------------
#: ``_ThreadBasedAsyncCheckpointExecutor`` runs each save on a thread named with this prefix;
#: dmuon's exit guard waits for such threads before a process group is torn down.
#: ``tests/core/test_compat.py`` starts a torch async save and finds its thread by this name.
DCP_ASYNC_THREAD_PREFIX = "AsyncCheckpointExecutor"
