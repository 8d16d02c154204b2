"""What a store is: the interface every storage backend offers, and the names it accepts.

A *store* is a flat directory of named files with the few operations a checkpoint needs (list,
stream a file in or out, put a small file atomically, delete). Everything dmuon reads or writes
goes through one, export output included, so a new backend (Azure, HDFS, a test store that
injects faults) is one class that satisfies :class:`Store`, registered with
``registry.register_store``. ``tests/dcp/storage/test_store_conformance.py`` is the suite a
backend must pass.

A store knows nothing of DCP, models or the checkpoint format: the names it is given are
opaque to it, except that they must stay inside it (:func:`checked_name`).
"""

from __future__ import annotations

import builtins
import os
import re
from contextlib import AbstractContextManager
from typing import BinaryIO, Protocol, runtime_checkable

from ..errors import UnsafeCheckpointError
from .retry import RetryPolicy

__all__ = ["BorrowingStream", "ReadAheadStream", "Store", "checked_name", "temp_name", "temp_target"]

_TEMP_SUFFIX = ".tmp-"
_TEMP_FILE = re.compile(r"^(.+)\.tmp-[0-9a-f]+$")


@runtime_checkable
class Store(Protocol):
    """One directory (or object-store prefix) of named files.

    Names are single path components (:func:`checked_name`); a store never creates, lists or
    removes anything outside its own directory, except :meth:`remove_tree`, which removes it.
    """

    url: str
    """Where the store is, as a user would write it (a path or ``scheme://...``): error
    messages and the metadata of a save name it."""

    retry: RetryPolicy
    """How often a whole multi-request operation on this store is tried (``retry.retrying``)."""

    def makedirs(self) -> None:
        """Create the directory if it is missing (a no-op where directories are implicit)."""
        ...

    def is_dir(self) -> bool:
        """Does the directory exist (on object stores: does anything live under the prefix)?"""
        ...

    def list(self) -> dict[str, int]:
        """The files directly inside, with their sizes in bytes; ``{}`` for a missing directory.
        Fresh on every call: never a cached listing (a commit reads its own writes)."""
        ...

    def list_dirs(self) -> builtins.list[str]:
        """The names of the directories directly inside (never the directory itself)."""
        ...

    def open_write(self, name: str) -> AbstractContextManager[BinaryIO]:
        """A stream that becomes the file when the block exits cleanly; removed otherwise.

        The file appears whole or not at all: a reader never sees half a file under ``name``.
        The stream may be a :class:`BorrowingStream`."""
        ...

    def open_read(self, name: str, size: int | None = None) -> BinaryIO:
        """A seekable binary stream over the file; ``FileNotFoundError`` if there is none.
        Reads are ranged: ``seek`` then ``read``/``readinto`` fetch only those bytes (and
        whatever read-ahead the backend keeps). ``size``: the file's size, where the caller
        knows it (a checkpoint's manifest does): an object store then need not ask for it,
        a request per file and rank."""
        ...

    def read(self, name: str) -> bytes:
        """The whole file; ``FileNotFoundError`` if there is none."""
        ...

    def put(self, name: str, data: bytes, *, exclusive: bool = False) -> None:
        """Write a small file atomically: it appears whole or not at all.

        ``exclusive`` is a create-if-absent (the commit of a save): ``FileExistsError`` if
        another writer created the file first, while a retry of one's own acknowledged write
        succeeds."""
        ...

    def delete(self, name: str) -> None:
        """Remove the file; a missing one is not an error."""
        ...

    def modified(self, name: str) -> float:
        """When the file was last written, as a POSIX timestamp (garbage collection of
        leftovers goes by it)."""
        ...

    def child(self, name: str) -> Store:
        """The store of the directory ``name`` inside this one, with the same settings."""
        ...

    def remove_tree(self) -> None:
        """Remove the directory and everything below it; a missing one is not an error."""
        ...


@runtime_checkable
class BorrowingStream(Protocol):
    """What ``open_write`` may return beyond ``write``: a stream that writes large buffers
    straight from the caller's memory, with no copy (direct I/O from the tensor itself).

    A writer that knows a buffer's address can lay out its file so that the buffer starts at a
    position congruent to that address modulo :attr:`memory_alignment`; then
    :meth:`write_borrowed` hands the aligned middle of the buffer to the device as it is.
    """

    memory_alignment: int  # a buffer whose address == file position (mod this) is written in place
    borrow_min_bytes: int  # smaller buffers are copied as usual: not worth padding the file for

    def write_borrowed(self, data, /) -> int:
        """``write``, except that the stream may go on reading ``data`` after it returns: the
        caller leaves those bytes unchanged until ``flush()`` (or closing) returns."""
        ...


@runtime_checkable
class ReadAheadStream(Protocol):
    """What ``open_read`` may return beyond reads: a stream told which bytes will be read next.

    A reader that knows its next byte ranges says so, a window ahead of where it reads; the
    backend starts fetching them (a local file: the kernel reads them into the page cache in
    the background), so the device or the network works while the reader checksums and copies
    what it already has, instead of waiting at every read.
    """

    def will_need(self, offset: int, length: int, /) -> None:
        """``length`` bytes from ``offset`` will be read soon; start fetching them, never wait."""
        ...


def checked_name(name: str) -> str:
    """A file name inside the store: no separators, no '..', nothing absolute."""
    if (
        not isinstance(name, str)
        or not name
        or name in (".", "..")
        or "/" in name
        or "\\" in name
        or "\x00" in name
        or os.path.isabs(name)
    ):
        raise UnsafeCheckpointError(f"storage path {name!r} leaves the checkpoint directory; refused")
    return name


def temp_name(name: str, token: str) -> str:
    """Where a store writes ``name`` before moving it into place (``token``: random hex).

    The checkpoint format recognises these names (``format.layout.is_dmuon_file``) so that
    garbage collection can remove what a crashed put left behind."""
    return f"{name}{_TEMP_SUFFIX}{token}"


def temp_target(name: str) -> str | None:
    """The file that the temporary file ``name`` (:func:`temp_name`) was to become, or None
    if ``name`` is not one."""
    match = _TEMP_FILE.match(name)
    return match.group(1) if match else None
