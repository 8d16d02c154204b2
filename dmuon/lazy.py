"""Public names of a package, imported when first used.

``import dmuon`` and ``import dmuon.dcp`` import nothing heavy: each public name (``dmuon.Muon``,
``from dmuon.dcp import save``) is imported from the module a table names the first time it is
asked for, and kept. So ``dmuon-ckpt --help`` and ``python -m dmuon.dcp --help`` answer without
importing torch (about 2 s), and a module of ``format/`` or ``storage/`` that raises a
``dmuon.dcp.errors`` error does not pull in the whole backend above it.

Every public name is a torch-facing object: the first one loaded installs the exit guard
(:mod:`dmuon.exit_guard`), as ``import dmuon`` used to; dmuon's own background saves install it
too when they start. ``tests/test_layout.py`` reads the tables from the source, so that what a
package imports on first use obeys the same layering rules as what it imports at once.
"""

from __future__ import annotations

import importlib
import importlib.util
import types
from typing import Any

__all__ = ["EXIT_GUARD", "keep_public_over_submodules", "load", "public_dir"]

#: the module whose ``install()`` the first public name loaded calls
EXIT_GUARD = "dmuon.exit_guard"


def load(package: dict[str, Any], name: str, table: dict[str, str]) -> Any:
    """For a package's ``__getattr__``: ``name`` imported from the module ``table`` names for it,
    else the submodule ``name`` (either kept in the package's namespace ``package``)."""
    package_name = package["__name__"]
    if name in table:
        value = getattr(importlib.import_module(table[name]), name)
        importlib.import_module(EXIT_GUARD).install()
    elif not name.startswith("__") and importlib.util.find_spec(f"{package_name}.{name}") is not None:
        value = importlib.import_module(f"{package_name}.{name}")
    else:
        raise AttributeError(f"module {package_name!r} has no attribute {name!r}")
    package[name] = value
    return value


def public_dir(package: dict[str, Any], table: dict[str, str]) -> list[str]:
    """For a package's ``__dir__``: what is loaded already and every public name."""
    return sorted(set(package) | set(table))


class _PublicOverSubmodules(types.ModuleType):
    """A package some of whose public names live in a submodule of the same name."""

    _shadowed: frozenset[str] = frozenset()

    def __setattr__(self, name: str, value: Any) -> None:
        if name in self._shadowed and isinstance(value, types.ModuleType):
            return  # the import system naming the submodule: the public name stays (or loads)
        super().__setattr__(name, value)


def keep_public_over_submodules(package: types.ModuleType, table: dict[str, str]) -> None:
    """A public name imported from a submodule of the same name (``dmuon.dcp.export``, the
    function, from ``dmuon.dcp.export``, the module) stays the public object: the import system
    sets the package's attribute to the submodule once it is imported, which an eager
    ``from .export import export`` used to undo and a lazy name cannot."""
    shadowed = frozenset(name for name, module in table.items() if module == f"{package.__name__}.{name}")
    package.__class__ = type(_PublicOverSubmodules.__name__, (_PublicOverSubmodules,), {"_shadowed": shadowed})
