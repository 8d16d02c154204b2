"""Every private torch name dmuon depends on, in one place, each checked on import.

dmuon is tested with the torch releases listed in ``pyproject.toml``. A name that moved or
vanished in another release fails here, at import, with a message that says which one, instead
of deep inside a save. ``tests/core/test_compat.py`` exercises each name.

What is private, and why dmuon needs it:

* ``state_dict_request`` reads the options torch's ``get_model_state_dict`` /
  ``get_optimizer_state_dict`` were called with, from the caller's frame. A dedicated weight
  is held by its owner alone; in ``full_state_dict`` mode torch only gathers DTensors, so
  without knowing the mode the full dict would silently lack every weight held elsewhere.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from types import CodeType, FrameType

import torch
import torch.distributed.checkpoint.state_dict as _torch_state_dict

__all__ = [
    "CURRENT_DCP_VERSION",
    "DCP_ASYNC_THREAD_PREFIX",
    "FSDP_PATCH_MODULE",
    "FSDP_PATCH_TARGET",
    "StateDictRequest",
    "StorageInfo",
    "TorchCompatError",
    "rebuild_tensor",
    "set_element",
    "state_dict_request",
    "storage_type_names",
]


class TorchCompatError(ImportError):
    """The installed torch lacks a private name dmuon relies on."""


def _require(module, name: str):
    value = getattr(module, name, None)
    if value is None:
        raise TorchCompatError(
            f"dmuon needs {module.__name__}.{name}, which torch {torch.__version__} lacks; "
            "install a torch release listed in dmuon's pyproject.toml"
        )
    return value


def _code_of(function) -> CodeType:
    """The code object of a function, through decorators such as ``torch.no_grad()``."""
    while hasattr(function, "__wrapped__"):
        function = function.__wrapped__
    return function.__code__


# ---------------------------------------------------------------------------------------------
# torch.distributed.checkpoint.state_dict: which options is the caller using?
# ---------------------------------------------------------------------------------------------
_GET_MODEL = _code_of(_require(_torch_state_dict, "_get_model_state_dict"))
_GET_OPTIM = _code_of(_require(_torch_state_dict, "_get_optim_state_dict"))
_FRAMES_TO_SEARCH = 12


@dataclass(frozen=True)
class StateDictRequest:
    """The options of an enclosing torch ``get_model_state_dict``/``get_optimizer_state_dict``."""

    full_state_dict: bool
    cpu_offload: bool


def state_dict_request(kind: str) -> StateDictRequest | None:
    """Options of the torch ``get_*_state_dict`` call that is asking, or None if none is.

    ``kind`` is ``"model"`` or ``"optim"``. Looks a few frames up the stack for torch's
    private worker function and reads its ``info`` argument (a ``_StateDictInfo``).
    """
    target = _GET_MODEL if kind == "model" else _GET_OPTIM
    frame: FrameType | None = sys._getframe(1)
    for _ in range(_FRAMES_TO_SEARCH):
        if frame is None:
            return None
        if frame.f_code is target:
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
# torch.distributed.checkpoint: the storage format torch's own readers understand
# ---------------------------------------------------------------------------------------------
import torch.distributed.checkpoint.filesystem as _dcp_filesystem  # noqa: E402

#: The byte range of one item in a data file (``relative_path``, ``offset``, ``length``).
#: dmuon writes it into ``Metadata.storage_data`` so that torch's ``FileSystemReader`` (and
#: ``dcp.load`` without dmuon installed) reads dmuon checkpoints.
StorageInfo = _require(_dcp_filesystem, "_StorageInfo")
#: The DCP format version torch's writers record in ``Metadata.version``.
CURRENT_DCP_VERSION: str = _require(_dcp_filesystem, "CURRENT_DCP_VERSION")

import torch.distributed.checkpoint._traverse as _dcp_traverse  # noqa: E402

#: ``set_element(root, path, value)``: put a value at a DCP flattening path (the tuples in
#: ``Metadata.planner_data``), creating dicts and lists on the way, as DCP's loaders do.
set_element = _require(_dcp_traverse, "set_element")


# ---------------------------------------------------------------------------------------------
# the torch.save format, which dmuon writes itself (dcp/torch_file.py)
# ---------------------------------------------------------------------------------------------
import torch.storage as _storage  # noqa: E402

#: What a pickled tensor is rebuilt with (``torch.load`` allows it with ``weights_only``).
rebuild_tensor = _require(torch._utils, "_rebuild_tensor_v2")
#: dtype -> the name of its legacy typed storage class, as torch.save pickles it.
storage_type_names = _require(_storage, "_dtype_to_storage_type_map")


# ---------------------------------------------------------------------------------------------
# FSDP2: the helper dmuon's one patch wraps (see fsdp_patch.py)
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
