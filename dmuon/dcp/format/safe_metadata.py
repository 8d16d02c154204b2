"""Reading ``.metadata`` without letting a checkpoint run code.

``.metadata`` is a pickle, and unpickling runs whatever it names. Only the classes DCP's
``Metadata`` is made of, torch dtypes and a few standard containers are allowed; anything else
is refused with :class:`UnsafeCheckpointError` before it is imported.

What a pickle of the same ``Metadata`` names depends on the Python that wrote it, and a
checkpoint written on any Python the package claims must load on every other:

- Python 3.11.0 to (at least) 3.11.2 reduce an ``Enum`` member to ``getattr(EnumClass, "NAME")``
  (``TensorProperties`` holds one), where other releases reduce it to ``EnumClass(value)``.
  ``builtins.getattr`` is therefore answered with :func:`_enum_member`, which looks up a member
  name of an allow-listed enum class and nothing else.
- Python 3.13 moved the path classes to ``pathlib._local`` (torch's ``FileSystemWriter`` pickles
  a ``checkpoint_id`` given as a ``pathlib.Path``); that name is read as ``pathlib``'s own.
"""

from __future__ import annotations

import enum
import io
import pickle

import torch
from torch.distributed.checkpoint.metadata import Metadata

from ... import compat
from ..errors import CheckpointCorruptError, UnsafeCheckpointError
from ..gc_pause import paused_gc

__all__ = ["load_allowed_pickle", "load_metadata_bytes"]

_ALLOWED_GLOBALS = (
    {
        ("torch.distributed.checkpoint.metadata", name)
        for name in (
            "Metadata",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "TensorProperties",
            "MetadataIndex",
            "StorageMeta",
        )
    }
    | compat.PICKLED_METADATA_GLOBALS
    | {("torch", "Size"), ("collections", "OrderedDict")}
    | {("pathlib", name) for name in ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath")}
)
# Where another Python keeps an allowed class: looked up under its public name, which every
# Python has (``pathlib._local`` does not exist before 3.13).
_MOVED = {("pathlib._local", name): ("pathlib", name) for module, name in _ALLOWED_GLOBALS if module == "pathlib"}


def _enum_member(owner: object, name: object) -> enum.Enum:
    """What ``getattr(owner, name)`` in a pickle may mean here: a member of an allowed enum.

    ``owner`` has come through :meth:`_MetadataUnpickler.find_class` (or from another reduce),
    so it is checked again: only an ``Enum`` subclass on the allow-list, and only a name in its
    ``__members__``, never a method, a dunder or an attribute of any other object.
    """
    if not (
        isinstance(owner, type)
        and issubclass(owner, enum.Enum)
        and (owner.__module__, owner.__qualname__) in _ALLOWED_GLOBALS
    ):
        raise UnsafeCheckpointError(
            f".metadata asks for getattr({owner!r}, {name!r}); only a member of an allowed enum may be "
            "looked up this way; refusing to unpickle it (it could run code)"
        )
    if not isinstance(name, str) or name not in owner.__members__:
        raise UnsafeCheckpointError(
            f".metadata asks for getattr({owner.__qualname__}, {name!r}), which is not a member of that enum; "
            "refusing to unpickle it"
        )
    return owner.__members__[name]


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, what: str) -> None:
        super().__init__(file)
        self.what = what

    def find_class(self, module: str, name: str):
        module, name = _MOVED.get((module, name), (module, name))
        if (module, name) in _ALLOWED_GLOBALS:
            return super().find_class(module, name)
        if (module, name) == ("builtins", "getattr"):
            return _enum_member
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise UnsafeCheckpointError(
            f"{self.what} refers to {module}.{name}, which a checkpoint has no reason to contain; "
            "refusing to unpickle it (it could run code)"
        )


def load_allowed_pickle(data: bytes, where: str, what: str) -> object:
    """Unpickle ``data`` (``what`` of the checkpoint at ``where``) with the allow-list above:
    :class:`UnsafeCheckpointError` for a name outside it, :class:`CheckpointCorruptError` for
    bytes that are no pickle."""
    try:
        with paused_gc():
            return _MetadataUnpickler(io.BytesIO(data), what).load()
    except UnsafeCheckpointError:
        raise
    except Exception as exc:
        raise CheckpointCorruptError(f"{where}: {what} cannot be decoded ({exc})") from exc


def load_metadata_bytes(data: bytes, where: str) -> Metadata:
    metadata = load_allowed_pickle(data, where, ".metadata")
    if not isinstance(metadata, Metadata):
        raise CheckpointCorruptError(f"{where}: .metadata holds a {type(metadata).__name__}, not DCP Metadata")
    return metadata
