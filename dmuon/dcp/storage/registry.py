"""Which store serves a path or URL: the registry of backends by URL scheme.

Built in: plain paths and ``file://`` are local directories (``local.LocalStore``), and every
other scheme goes to fsspec (``fsspec_store.FsspecStore``: S3, GCS, Azure, ``memory://``...).
:func:`register_store` puts a backend of one's own in front of them for a scheme.

Paths and URLs are understood here and nowhere else in dmuon: the layers above hand a location
to :func:`open_store` and work with the :class:`~.base.Store` it returns.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from types import MappingProxyType

from .base import Store
from .fsspec_store import open_fsspec_store
from .local import open_local_store

__all__ = [
    "StoreFactory",
    "absolute",
    "file_or_directory",
    "is_remote",
    "open_store",
    "register_store",
    "split_location",
    "store_kind",
    "unregister_store",
]

StoreFactory = Callable[[str, "dict | None", "bool | None"], Store]
"""``factory(url, storage_options, sync_files) -> Store``. ``sync_files``: make each write
durable before it counts (fsync); ``None`` leaves it to the backend."""

_BUILT_IN: Mapping[str, StoreFactory] = MappingProxyType({"": open_local_store, "file": open_local_store})
_ANY_OTHER_SCHEME: StoreFactory = open_fsspec_store

_FACTORIES: dict[str, StoreFactory] = {}  # registered by users, in front of the built-in ones


def register_store(scheme: str, factory: StoreFactory) -> None:
    """Make ``open_store`` build ``scheme://...`` URLs with ``factory`` (replaces any earlier one)."""
    _FACTORIES[scheme] = factory


def unregister_store(scheme: str) -> None:
    """Undo :func:`register_store` for ``scheme``: the built-in backend serves it again."""
    _FACTORIES.pop(scheme, None)


def _scheme(location: str) -> str:
    return location.split("://", 1)[0] if "://" in location else ""


def is_remote(location: str | os.PathLike) -> bool:
    """Is ``location`` a URL of another scheme than ``file://`` (not a local path)?"""
    text = os.fspath(location)
    return "://" in text and not text.startswith("file://")


def open_store(
    location: str | os.PathLike, storage_options: dict | None = None, sync_files: bool | None = None
) -> Store:
    """The store for a local path or URL: a registered factory for its scheme, else a local
    directory (plain paths, ``file://``) or fsspec (any other scheme)."""
    text = os.fspath(location)
    scheme = _scheme(text)
    factory = _FACTORIES.get(scheme) or _BUILT_IN.get(scheme, _ANY_OTHER_SCHEME)
    return factory(text, storage_options, sync_files)


def split_location(location: str | os.PathLike) -> tuple[str, str]:
    """(the directory, the file name) of a file's path or URL; a relative local path is made
    absolute first."""
    text = os.fspath(location).rstrip("/")
    if _scheme(text):
        head, _, name = text.rpartition("/")
        return head, name
    return os.path.split(os.path.abspath(text))


def absolute(location: str | os.PathLike) -> str:
    """A local path made absolute (so that processes started elsewhere find it); a URL as it
    is. Either without a trailing ``/``, ready for ``f"{location}/{name}"``."""
    text = os.fspath(location).rstrip("/")
    return text if _scheme(text) else os.path.abspath(text or "/")


def root_location(location: str | os.PathLike) -> str:
    """A directory or URL given as a root, without a trailing ``/``: ready for
    ``f"{root}/{name}"`` (a relative local path stays relative, as the caller gave it)."""
    return os.fspath(location).rstrip("/")


def local_path(location: str | os.PathLike) -> str:
    """A local location (a path, or a ``file://`` URL) as an absolute path; a URL of any other
    scheme is refused (:class:`ValueError`)."""
    text = os.fspath(location)
    if is_remote(text):
        raise ValueError(f"{text} is not a local path")
    return os.path.abspath(text[len("file://") :] if text.startswith("file://") else text)


def file_or_directory(location: str | os.PathLike, suffix: str) -> tuple[str, str | None]:
    """(its directory, its file name) when ``location`` names a file ending in ``suffix``;
    (``location``, None) when it names a directory. A trailing ``/`` is dropped first."""
    text = os.fspath(location).rstrip("/")
    if text.endswith(suffix):
        return split_location(text)
    return text, None


# schemes that name the same filesystem (s3fs, gcsfs) count as one kind of store
_SCHEME_ALIASES = {"s3a": "s3", "gcs": "gs"}


def store_kind(location: str | os.PathLike) -> str:
    """``""`` for a local path (``file://`` included), else the URL's scheme, aliases folded:
    two locations of one kind can take the same storage options."""
    text = os.fspath(location)
    if not is_remote(text):
        return ""
    scheme = _scheme(text).lower()
    return _SCHEME_ALIASES.get(scheme, scheme)
