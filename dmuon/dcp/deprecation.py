"""Names that changed: the old ones keep working for one release, with a warning naming the new.

Kept in one place so that the list of what will go is read in one file, and so that each
shim warns the same way (``DeprecationWarning``, pointing at the caller's line).
"""

from __future__ import annotations

import importlib
import warnings
from typing import Any

__all__ = ["moved_name", "renamed", "renamed_argument"]

_RELEASE = "dmuon 0.2"


def renamed(old: str, new: str, stacklevel: int = 3) -> None:
    """Warn that ``old`` is now ``new``."""
    warnings.warn(f"{old} is deprecated and goes in {_RELEASE}: use {new}", DeprecationWarning, stacklevel=stacklevel)


def renamed_argument(owner: str, old: str, old_value: Any, new: str, new_value: Any) -> Any:
    """The value of argument ``new``, taken from ``old`` (with a warning) when only that was given."""
    if old_value is None:
        return new_value
    renamed(f"{owner}({old}=...)", f"{owner}({new}=...)", stacklevel=4)
    return old_value


def moved_name(module: str, name: str, table: dict[str, tuple[str, str]]) -> Any:
    """For a module's ``__getattr__``: ``name`` from where ``table`` says it went, with a warning;
    ``table``: old name -> (module path, its name there)."""
    if name not in table:
        raise AttributeError(f"module {module!r} has no attribute {name!r}")
    where, new = table[name]
    renamed(f"{module}.{name}", f"{where}.{new}")
    return getattr(importlib.import_module(where), new)
