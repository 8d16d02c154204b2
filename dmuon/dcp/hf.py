"""HuggingFace safetensors interop: load pretrained weights into a dmuon model.

Each rank reads only the bytes it holds: owners their whole dedicated matrices, FSDP2 ranks
their row range (safetensors stores tensors row-major, so a row range is one byte range).
Works on local paths and fsspec URLs; the file's header is read once per file. The file format
itself is ``format.safetensors_file``'s.
"""

from __future__ import annotations

import os

from torch import nn

from ..state_dict import StateDictError, check_fits, write_full_state
from .errors import CheckpointMismatchError
from .format.layout import HF_INDEX_FILE, HF_SINGLE_FILE, METADATA
from .format.safetensors_file import TensorLocation, hf_model_files, read_header, read_rows
from .storage.base import Store
from .storage.registry import file_or_directory, open_store

__all__ = ["is_safetensors_checkpoint", "load_safetensors", "safetensors_index"]

_SUFFIX = ".safetensors"


def _directory_and_file(checkpoint_id: str | os.PathLike) -> tuple[str, str | None]:
    """(directory, file name) for a ``.safetensors`` file; (directory, None) for a directory."""
    return file_or_directory(checkpoint_id, _SUFFIX)


def is_safetensors_checkpoint(checkpoint_id: str | os.PathLike, storage_options: dict | None = None) -> bool:
    """A ``.safetensors`` file, or a directory of HuggingFace weights (and no DCP checkpoint)."""
    directory, name = _directory_and_file(checkpoint_id)
    if name is not None:
        return True
    files = open_store(directory, storage_options).list()
    return METADATA not in files and (HF_SINGLE_FILE in files or HF_INDEX_FILE in files)


def safetensors_index(
    checkpoint_id: str | os.PathLike, storage_options: dict | None = None
) -> tuple[Store, dict[str, TensorLocation]]:
    """(store, {key: TensorLocation}) for a file, a directory with one file, or a sharded one."""
    directory, name = _directory_and_file(checkpoint_id)
    store = open_store(directory, storage_options)
    locations: dict[str, TensorLocation] = {}
    for file in hf_model_files(store) if name is None else [name]:
        locations.update(read_header(store, file))
    return store, locations


def load_safetensors(
    model: nn.Module, checkpoint_id: str | os.PathLike, *, storage_options: dict | None = None, strict: bool = True
) -> None:
    """Collective in spirit (every rank calls it) but communication-free: each reads its part.

    Keys, shapes: checked for every key before anything is written. Dtypes may differ (bf16
    weights into fp32 masters are cast). A tied weight may be stored under any one of its
    names (``save_pretrained`` leaves ``lm_head.weight`` out when embeddings are tied): see
    :func:`dmuon.state_dict.tied_sources`.
    """
    store, locations = safetensors_index(checkpoint_id, storage_options)
    try:
        check_fits(
            model,
            {k: loc.shape for k, loc in locations.items()},
            strict=strict,
            what=f"load of {os.fspath(checkpoint_id)}",
        )
    except StateDictError as exc:
        raise CheckpointMismatchError(str(exc)) from None
    write_full_state(model, locations.keys(), lambda key, rows: read_rows(store, locations[key], rows))
