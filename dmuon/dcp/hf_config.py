"""The model's HuggingFace config beside an export, so that ``from_pretrained(OUT)`` needs nothing else.

A folder of safetensors alone is not a model to transformers: without ``config.json``,
``AutoModel*.from_pretrained`` fails, and a model class's ``from_pretrained`` silently builds its
default config (a 7B Llama) and tries to fill it. The weights carry no architecture, so the
config has to come from the user (the folder the pretrained model came from, or the config
they built the model with); dmuon copies it and its generation config and makes its dtype
say what the export wrote. transformers 5 loads with ``dtype="auto"`` by default, which takes
the config's dtype: a float32 config over bfloat16 weights would load them as float32.
"""

from __future__ import annotations

import collections
import json
import os
import warnings
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from .format.layout import HF_CONFIG_FILE, HF_GENERATION_CONFIG_FILE
from .storage.base import Store
from .storage.registry import file_or_directory, open_store

__all__ = [
    "DTYPE_FIELDS",
    "HFConfig",
    "MissingConfigWarning",
    "export_dtype",
    "missing_config_note",
    "read_hf_config",
    "warn_missing_config",
    "with_dtype",
    "write_hf_config",
]

#: The config fields that name the weights' dtype: transformers 5 writes ``dtype``, earlier
#: releases ``torch_dtype`` (and 5 still reads it). Every one present is set; ``dtype`` when
#: neither is.
DTYPE_FIELDS = ("dtype", "torch_dtype")
_JSON_SUFFIX = ".json"


class MissingConfigWarning(UserWarning):
    """An export without a config: ``from_pretrained`` cannot open the folder as it is."""


def missing_config_note(output: str, option: str = "config=") -> str:
    """The sentence an export without a config prints (``option``: how the caller passes one)."""
    return (
        f"{output} has the weights but no {HF_CONFIG_FILE}: transformers' from_pretrained will need "
        f"one; pass the model's HuggingFace config with {option}PATH (its {HF_CONFIG_FILE}, or the "
        f"folder holding it, e.g. the pretrained model's) and it is copied beside the weights, "
        f"with {HF_GENERATION_CONFIG_FILE} if present and the dtype set to the exported one"
    )


def warn_missing_config(output: str) -> None:
    warnings.warn(missing_config_note(output), MissingConfigWarning, stacklevel=3)


@dataclass
class HFConfig:
    """A config read and checked before the export writes anything."""

    source: str  # where the config was read from, for messages
    document: dict  # config.json, parsed
    generation: bytes | None  # generation_config.json as it was, if it was there


def _parse(data: bytes, where: str) -> dict:
    try:
        document = json.loads(data)
    except ValueError as exc:
        raise ValueError(f"{where} is not valid JSON ({exc}): expected a HuggingFace {HF_CONFIG_FILE}") from None
    if not isinstance(document, dict):
        raise ValueError(f"{where} holds a JSON {type(document).__name__}, not a HuggingFace config (an object)")
    return document


def read_hf_config(location: str | os.PathLike, storage_options: dict | None = None) -> HFConfig:
    """The config at ``location``: a ``.json`` file, or a folder holding ``config.json``.

    ``generation_config.json`` beside it is taken too when it is there. A local path or a URL
    (opened with ``storage_options``). Raises ``FileNotFoundError`` or ``ValueError`` naming
    the file, so an export can stop before it writes a byte.
    """
    directory, given = file_or_directory(location, _JSON_SUFFIX)
    name = given or HF_CONFIG_FILE
    store = open_store(directory, storage_options)
    where = f"{store.url}/{name}"
    files = store.list() if store.is_dir() else {}
    if name not in files:
        hint = "" if given else f" (a folder given as the config must hold {HF_CONFIG_FILE})"
        raise FileNotFoundError(f"no HuggingFace config at {where}{hint}")
    document = _parse(store.read(name), where)
    generation = store.read(HF_GENERATION_CONFIG_FILE) if HF_GENERATION_CONFIG_FILE in files else None
    return HFConfig(where, document, generation)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def export_dtype(dtypes_and_sizes: Iterable[tuple[torch.dtype, int]]) -> torch.dtype | None:
    """The floating dtype that holds most of the exported bytes (the one a config names), or
    None when nothing floating is exported."""
    size: collections.Counter[torch.dtype] = collections.Counter()
    for dtype, nbytes in dtypes_and_sizes:
        if dtype.is_floating_point:
            size[dtype] += nbytes
    return size.most_common(1)[0][0] if size else None


def with_dtype(document: dict, dtype: torch.dtype) -> dict:
    """A copy of a config whose dtype fields (:data:`DTYPE_FIELDS`) name ``dtype``.

    Sub-configs (nested objects with a ``model_type``, as composite models have) that carry a
    dtype field are set too; a per-module map of dtypes has each entry set.
    """
    name = _dtype_name(dtype)
    out = dict(document)
    fields = [f for f in DTYPE_FIELDS if f in out] or [DTYPE_FIELDS[0]]
    for field in fields:
        value = out.get(field)
        out[field] = {k: name for k in value} if isinstance(value, dict) else name
    for key, value in out.items():
        if isinstance(value, dict) and "model_type" in value and any(f in value for f in DTYPE_FIELDS):
            out[key] = with_dtype(value, dtype)
    return out


def write_hf_config(store: Store, config: HFConfig, dtype: torch.dtype | None) -> list[str]:
    """Write the config (its dtype set to ``dtype`` unless None) and the generation config into
    ``store``; returns their URLs. Called after the weights: a folder with a config then has
    all its weights, never the reverse."""
    document = config.document if dtype is None else with_dtype(config.document, dtype)
    store.put(HF_CONFIG_FILE, (json.dumps(document, indent=2, sort_keys=True) + "\n").encode())
    written = [f"{store.url}/{HF_CONFIG_FILE}"]
    if config.generation is not None:
        store.put(HF_GENERATION_CONFIG_FILE, config.generation)
        written.append(f"{store.url}/{HF_GENERATION_CONFIG_FILE}")
    return written
