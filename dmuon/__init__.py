"""dmuon: Muon on FSDP2 with owner-dedicated parameters, and sharded DCP checkpoints."""

from . import exit_guard
from .dedicate import dedicate_params
from .dedicated import wait_all_replicate_broadcasts
from .deferred_init import MetaDeviceError
from .optim import Muon
from .state_dict import (
    StateDictError,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

__version__ = "0.1.0"

exit_guard.install()  # an async save in flight at teardown is finished or reported (exit_guard.py)

__all__ = [
    "MetaDeviceError",
    "Muon",
    "StateDictError",
    "__version__",
    "dedicate_params",
    "get_model_state_dict",
    "get_optimizer_state_dict",
    "set_model_state_dict",
    "set_optimizer_state_dict",
    "wait_all_replicate_broadcasts",
]
