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
* ``tree_flatten``: the tensors of a module's output, however nested, get the hook that
  re-broadcasts dedicated weights before backward (torch has no public pytree module).
* :data:`PICKLED_METADATA_GLOBALS`: the private objects a ``.metadata`` pickle names, which the
  allow-listed unpickler must let through.
* the state DCP's default planners keep (:func:`planner_flat_state` and the functions around
  it): dmuon's planners extend torch's and work on the flattened state dict torch built.
* :data:`CREATE_WRITE_ITEMS`: DCP's checkpointable protocol, by which a plain planner handed a
  dedicated parameter itself (or an AppState's layout) refuses before writing anything.
* :func:`optimizer_load_state_dict_hooks`: ``Muon.load_state_dict`` loads in place (it keeps
  dtypes and skips entries of parameters this rank does not own) and runs the hooks users
  registered, which torch keeps in private attributes.
* :func:`is_strided_shard`: FSDP2 composed with expert parallelism shards an expert stack's
  first dimension with DTensor's private ``_StridedShard``; Muon must know that such a shard
  still holds whole experts (``optim/expert_stacks.py``).
* ``local_shape_and_offset()``: where any rank's piece of a DTensor lies (DTensor's own
  computation, which DCP's public one runs for the calling rank): a sharded matrix's home
  assembles the pieces of every rank (``optim/sharded_matrices.py``).
* ``default_store()``, :func:`collective_count`: the job's rendezvous store, and a group's
  count of collectives; after a collective failed, the surviving ranks hold a roll
  call there, under a name that count gives, to name the rank that stopped
  (``dcp/rank_failure.py``).
"""

from __future__ import annotations

import importlib
import sys
from dataclasses import dataclass
from types import CodeType, FrameType
from typing import Any

import torch

__all__ = [
    "CHECKPOINT_WRAPPER_PREFIX",
    "CREATE_WRITE_ITEMS",
    "CURRENT_DCP_VERSION",  # noqa: F822 - served by __getattr__
    "DCP_ASYNC_THREAD_PREFIX",
    "FSDP_PATCH_MODULE",
    "FSDP_PATCH_TARGET",
    "PICKLED_METADATA_GLOBALS",
    "StateDictRequest",
    "StorageInfo",  # noqa: F822 - served by __getattr__
    "TorchCompatError",
    "collective_count",
    "default_store",  # noqa: F822 - served by __getattr__
    "is_strided_shard",
    "local_shape_and_offset",  # noqa: F822 - served by __getattr__
    "missing_features",
    "optimizer_load_state_dict_hooks",
    "planner_flat_state",
    "planner_mappings",
    "planner_nested_state",
    "rebuild_tensor",  # noqa: F822 - served by __getattr__
    "require_all",
    "set_element",  # noqa: F822 - served by __getattr__
    "set_planner_flat_state",
    "state_dict_name",
    "state_dict_request",
    "storage_type_names",  # noqa: F822 - served by __getattr__
    "tree_flatten",  # noqa: F822 - served by __getattr__
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
    "tree_flatten": _Need(
        "dedicate_params (dedicated weights re-broadcast before backward)", (("torch.utils._pytree", "tree_flatten"),)
    ),
    "default_store": _Need(
        "naming the rank that stopped during a save or load (a roll call through the rendezvous store)",
        (("torch.distributed.distributed_c10d", "_get_default_store"),),
    ),
    "_get_model_state_dict": _Need(
        "dedicated parameters under torch's get_model_state_dict / get_state_dict",
        (("torch.distributed.checkpoint.state_dict", "_get_model_state_dict"),),
    ),
    "_get_optim_state_dict": _Need(
        "dedicated parameters under torch's get_optimizer_state_dict / get_state_dict",
        (("torch.distributed.checkpoint.state_dict", "_get_optim_state_dict"),),
    ),
    "_StridedShard": _Need(
        "expert stacks sharded by FSDP2 over expert parallelism",
        (("torch.distributed.tensor.placement_types", "_StridedShard"),),
    ),
    # (global shape, mesh shape, coordinate, placements) -> (local shape, global offset) of any
    # rank's piece, as DCP's public compute_local_shape_and_global_offset gives for this rank
    "local_shape_and_offset": _Need(
        "Muon on sharded matrices (dedicate_params(sharded_matrices=): tensor parallelism)",
        (("torch.distributed.tensor._utils", "_compute_local_shape_and_global_offset"),),
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
# DTensor: the strided shard of a dimension sharded twice (FSDP2 over expert parallelism)
# ---------------------------------------------------------------------------------------------
def is_strided_shard(placement: Any) -> bool:
    """Is ``placement`` DTensor's ``_StridedShard`` (a torch without it never makes one)?"""
    strided = _found["_StridedShard"]
    return strided is not None and isinstance(placement, strided)


# ---------------------------------------------------------------------------------------------
# FSDP2: the helper dmuon's one patch wraps (see fsdp_patch.py; it raises FSDPPatchError when
# dedicate_params is used with a torch that lacks it)
# ---------------------------------------------------------------------------------------------
FSDP_PATCH_MODULE = "torch.distributed.fsdp._fully_shard._fully_shard"
FSDP_PATCH_TARGET = "_get_modules_and_states"


# ---------------------------------------------------------------------------------------------
# activation checkpointing's wrapper: the module name it inserts (see dedicate.py)
# ---------------------------------------------------------------------------------------------
#: ``checkpoint_wrapper`` (torchtitan's activation checkpointing) puts the wrapped module under
#: this name; ``named_parameters`` shows it, ``state_dict`` strips it. ``dedicate_params`` may run
#: after the wrapping (the order torchtitan's parallelize functions use) and names dedicated
#: weights as ``state_dict`` does. ``tests/core/test_compat.py`` wraps a module and checks both.
CHECKPOINT_WRAPPER_PREFIX = "_checkpoint_wrapped_module."


def state_dict_name(name: str) -> str:
    """A parameter's name from ``named_parameters`` as ``state_dict`` shows it."""
    return name.replace(CHECKPOINT_WRAPPER_PREFIX, "")


# ---------------------------------------------------------------------------------------------
# torch's thread-based dcp.async_save: how its worker thread is named (see exit_guard.py)
# ---------------------------------------------------------------------------------------------
#: ``_ThreadBasedAsyncCheckpointExecutor`` runs each save on a thread named with this prefix;
#: dmuon's exit guard waits for such threads before a process group is torn down.
#: ``tests/core/test_compat.py`` starts a torch async save and finds its thread by this name.
DCP_ASYNC_THREAD_PREFIX = "AsyncCheckpointExecutor"


# ---------------------------------------------------------------------------------------------
# DCP's checkpointable protocol: the method its planners ask an object for its write items
# ---------------------------------------------------------------------------------------------
#: ``planner_helpers._create_write_items`` asks any object of a state dict that has this
#: attribute for its write items (DTensor implements it). dmuon sets it on every dedicated
#: parameter (``dedicate.py``: a plain planner handed the parameter itself, whose data is a
#: placeholder, refuses before writing) and on ``DedicatedLayout`` (``dcp/app_state.py``: the
#: layout needs dmuon's planner). ``tests/core/test_compat.py`` checks that torch's default save
#: planner still calls it.
CREATE_WRITE_ITEMS = "__create_write_items__"


# ---------------------------------------------------------------------------------------------
# the .metadata pickle: private objects it names
# ---------------------------------------------------------------------------------------------
#: ``(module, name)`` of the private objects a pickled DCP ``Metadata`` refers to: the storage
#: entries torch's file readers understand, the encoding of a tensor's memory format, and how a
#: layout is unpickled. ``format/safe_metadata.py`` allows them besides public classes;
#: ``tests/core/test_compat.py`` pickles torch's own ``Metadata`` and finds no other.
PICKLED_METADATA_GLOBALS = frozenset(
    {
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"),
        ("torch.serialization", "_get_layout"),
    }
)


# ---------------------------------------------------------------------------------------------
# DCP's default planners: the state their subclasses work with
# ---------------------------------------------------------------------------------------------
# ``DefaultSavePlanner``/``DefaultLoadPlanner.set_up_planner`` flatten the nested state dict
# and keep it, with the mapping back to the nesting, in attributes that torch's own planning
# (``create_local_plan``, ``resolve_data``, ``resolve_tensor``, ``load_bytes``) reads again. A
# subclass that changes what is planned changes that state. ``tests/core/test_compat.py`` checks
# on torch's own planners that these attributes hold what these functions say.
_FLAT_STATE, _MAPPINGS, _NESTED_STATE = "state_dict", "mappings", "original_state_dict"


def _planner_attribute(planner: Any, name: str) -> Any:
    try:
        return getattr(planner, name)
    except AttributeError:
        raise TorchCompatError(
            f"torch {torch.__version__}'s default DCP planners keep no {name!r} after set_up_planner: "
            "dmuon's DCP planners are disabled; install a torch release the README lists as tested"
        ) from None


def collective_count(group: Any = None) -> int:
    """How many collectives ``group`` (None: the default group) has run: the same number on every
    rank at the same point of an SPMD program (``ProcessGroup._get_sequence_number_for_group``),
    so it names one operation on all ranks at once (``dcp/rank_failure.py``'s roll call)."""
    import torch.distributed as dist

    group = dist.group.WORLD if group is None else group
    method = getattr(group, "_get_sequence_number_for_group", None)
    if method is None:
        raise TorchCompatError(
            f"naming the rank that stopped needs ProcessGroup._get_sequence_number_for_group, which torch "
            f"{torch.__version__} lacks"
        )
    return int(method())


def planner_flat_state(planner: Any) -> dict[str, Any]:
    """The flattened state dict a default planner plans and resolves items from."""
    return _planner_attribute(planner, _FLAT_STATE)


def set_planner_flat_state(planner: Any, flat: dict[str, Any]) -> None:
    """Make the default planner plan (and resolve items from) ``flat`` instead."""
    _planner_attribute(planner, _FLAT_STATE)
    setattr(planner, _FLAT_STATE, flat)


def planner_mappings(planner: Any) -> dict[str, tuple]:
    """Flattened key -> path in the nested state dict (DCP's ``FLATTEN_MAPPING``)."""
    return _planner_attribute(planner, _MAPPINGS)


def planner_nested_state(planner: Any) -> dict[str, Any]:
    """The nested state dict a default load planner was set up with (loaded objects go there)."""
    return _planner_attribute(planner, _NESTED_STATE)


# ---------------------------------------------------------------------------------------------
# torch.optim.Optimizer: the hooks of load_state_dict
# ---------------------------------------------------------------------------------------------
_LOAD_HOOKS = ("_optimizer_load_state_dict_pre_hooks", "_optimizer_load_state_dict_post_hooks")


def optimizer_load_state_dict_hooks(optimizer: torch.optim.Optimizer) -> tuple[list, list]:
    """The hooks registered with ``register_load_state_dict_pre_hook`` and
    ``register_load_state_dict_post_hook``, in registration order."""
    try:
        pre, post = (getattr(optimizer, name) for name in _LOAD_HOOKS)
    except AttributeError:
        raise TorchCompatError(
            f"torch {torch.__version__}'s Optimizer keeps its load_state_dict hooks elsewhere than {_LOAD_HOOKS}: "
            "Muon.load_state_dict cannot run them; install a torch release the README lists as tested"
        ) from None
    return list(pre.values()), list(post.values())
