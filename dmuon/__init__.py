"""dmuon: Muon on FSDP2 with owner-dedicated parameters, and sharded DCP checkpoints.

The public names below are imported when first used (:mod:`dmuon.lazy`): ``import dmuon`` alone
imports neither torch nor the runtime, so that ``dmuon-ckpt --help`` answers at once. The first
one used installs the exit guard (an async save in flight at teardown is finished or reported,
``exit_guard.py``).
"""

from typing import TYPE_CHECKING, Any

from . import lazy

__version__ = "0.1.0"

#: public name -> the module it is imported from on first use
PUBLIC = {
    "MetaDeviceError": "dmuon.deferred_init",
    "ModelParts": "dmuon.model_parts",
    "Muon": "dmuon.optim",
    "StateDictError": "dmuon.state_dict",
    "dedicate_params": "dmuon.dedicate",
    "get_model_state_dict": "dmuon.state_dict",
    "get_optimizer_state_dict": "dmuon.state_dict",
    "set_model_state_dict": "dmuon.state_dict",
    "set_optimizer_state_dict": "dmuon.state_dict",
    "snapshot_window_closed": "dmuon.snapshot",
    "wait_all_replicate_broadcasts": "dmuon.dedicated",
    "wait_for_snapshots": "dmuon.snapshot",
}

__all__ = [
    "MetaDeviceError",
    "ModelParts",
    "Muon",
    "StateDictError",
    "__version__",
    "dedicate_params",
    "get_model_state_dict",
    "get_optimizer_state_dict",
    "set_model_state_dict",
    "set_optimizer_state_dict",
    "snapshot_window_closed",
    "wait_all_replicate_broadcasts",
    "wait_for_snapshots",
]

if TYPE_CHECKING:  # what type checkers and IDEs see; at run time, __getattr__ imports them
    from .dedicate import dedicate_params
    from .dedicated import wait_all_replicate_broadcasts
    from .deferred_init import MetaDeviceError
    from .model_parts import ModelParts
    from .optim import Muon
    from .snapshot import snapshot_window_closed, wait_for_snapshots
    from .state_dict import (
        StateDictError,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )


def __getattr__(name: str) -> Any:
    return lazy.load(globals(), name, PUBLIC)


def __dir__() -> list[str]:
    return lazy.public_dir(globals(), PUBLIC)
