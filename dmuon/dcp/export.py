"""Offline export of a dmuon checkpoint, one tensor at a time.

Peak memory is about the largest tensor plus the output buffer, whatever the model size:
each tensor is assembled from its stored chunks, cast, written and dropped before the next.
Both output writers know every key, shape and dtype up front (from the checkpoint metadata),
so they can lay out their headers before the first byte of data:

* safetensors (``format.safetensors_file``): the header, then the tensors' bytes;
* torch: the zip archive ``torch.save`` writes, with ``data.pkl`` pickled from shape-only
  stand-ins and each storage record written as its tensor arrives (``format.torch_file``).
"""

from __future__ import annotations

import collections
import ctypes
import json
import math
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

from .checkpoint import CheckpointListing, open_checkpoint
from .format.layout import HF_INDEX_FILE, HF_SINGLE_FILE, MODEL_PREFIX, hf_shard_name
from .format.safetensors_file import write_safetensors
from .format.tensor_bytes import tensor_memory
from .format.torch_file import pickled_tensors, write_postamble, write_preamble
from .format.torch_zip import TorchFileWriter
from .hf_config import HFConfig, export_dtype, read_hf_config, warn_missing_config, write_hf_config
from .progress import byte_progress
from .reader import narrow_to
from .storage.base import Store
from .storage.registry import open_store, split_location, store_kind

__all__ = [
    "ExportEntry",
    "export",
    "model_entries",
    "parse_size",
    "read_full",
    "release_freed_memory_promptly",
    "resolve_output_options",
    "write_torch_file",
]

_SIZE_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}


def parse_size(size: int | str) -> int:
    """``"5GB"`` -> 5 * 10**9 (HuggingFace's convention), ``"2GiB"`` -> 2 * 2**30, ints as bytes."""
    if isinstance(size, int):
        return size
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(size))
    if not match or match.group(2).upper() not in _SIZE_UNITS:
        raise ValueError(f"cannot parse size {size!r} (use e.g. 500MB, 5GB, 2GiB or bytes)")
    return int(float(match.group(1)) * _SIZE_UNITS[match.group(2).upper()])


@dataclass
class ExportEntry:
    key: str  # output key (FQN without the "model." prefix)
    source: str  # checkpoint key it is read from (an alias shares its source)
    shape: tuple[int, ...]
    dtype: torch.dtype  # output dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def model_entries(listing: CheckpointListing, dtype: torch.dtype | None = None) -> list[ExportEntry]:
    """The model's tensors in the order they were saved; tied aliases included."""
    metadata = listing.metadata
    stored = metadata.state_dict_metadata
    # the flatten mapping keeps the saving rank's state-dict order; the metadata's own order
    # follows the ranks' write plans
    order = [k for k in (metadata.planner_data or {}) if k in stored] or list(stored)
    entries = []
    for fqn in order:
        md = stored[fqn]
        if fqn.startswith(MODEL_PREFIX) and isinstance(md, TensorStorageMetadata):
            out_dtype = dtype if (dtype is not None and md.properties.dtype.is_floating_point) else md.properties.dtype
            entries.append(ExportEntry(fqn[len(MODEL_PREFIX) :], fqn, tuple(md.size), out_dtype))
    by_source = {e.source: e for e in entries}
    for alias, canonical in listing.planner_info().get("aliases", {}).items():
        base = by_source.get(MODEL_PREFIX + canonical)
        if base is not None and alias != canonical:
            entries.append(ExportEntry(alias, base.source, base.shape, base.dtype))
    if not entries:
        raise ValueError(f"{listing.store.url} holds no model tensors (no 'model.*' keys)")
    return entries


def read_full(
    listing: CheckpointListing, source: str, dtype: torch.dtype, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Assemble one tensor from all its stored chunks, cast chunk by chunk into ``dtype``.

    ``out``, when it has the right shape and dtype, is filled instead of a new allocation.
    """
    md = listing.metadata.state_dict_metadata[source]
    if not isinstance(md, TensorStorageMetadata):
        raise ValueError(f"{source} is not a tensor in {listing.store.url}")
    if out is None or tuple(out.shape) != tuple(md.size) or out.dtype != dtype:
        out = torch.empty(tuple(md.size), dtype=dtype)
    by_file: dict[str, list] = collections.defaultdict(list)
    for chunk in md.chunks:
        index = MetadataIndex(source, tuple(chunk.offsets))
        by_file[listing.metadata.storage_data[index].relative_path].append((index, chunk))
    for name, chunks in by_file.items():
        with listing.store.open_read(name) as stream:
            for index, chunk in chunks:
                piece = listing.read_tensor(index, stream)
                narrow_to(out, chunk.offsets, chunk.sizes).copy_(piece)
                del piece
    return out


# ---------------------------------------------------------------------------------------------
# output writers
# ---------------------------------------------------------------------------------------------
def write_torch_file(store: Store, name: str, entries: list[ExportEntry], tensors: Iterator[torch.Tensor]) -> None:
    """A file ``torch.load(path, weights_only=True)`` reads as ``{key: tensor}``; tied
    aliases share one storage, as in ``torch.save(model.state_dict())``."""
    keys: dict[str, str] = {}
    layout = {}
    for entry in entries:
        key = keys.setdefault(entry.source, str(len(keys)))
        layout[entry.key] = (key, entry.dtype, entry.shape)
    with store.open_write(name) as out:
        writer = TorchFileWriter(out)
        write_preamble(writer, pickled_tensors(layout))
        written = set()
        for entry, tensor in zip(entries, tensors):
            key = keys[entry.source]
            if key not in written:
                view = tensor_memory(tensor.contiguous())
                writer.write_record(f"data/{key}", view, align=True)
                written.add(key)
                del view
            del tensor  # before the next one is read: see write_safetensors
        write_postamble(writer)


# ---------------------------------------------------------------------------------------------
# export
# ---------------------------------------------------------------------------------------------
def release_freed_memory_promptly() -> None:
    """Fix glibc's mmap threshold at 1 MiB for this process.

    By default glibc raises the threshold each time a large block is freed, after which
    tensor-sized blocks come from the heap and freed ones are not returned: reading and
    dropping one tensor after another then grows RSS by about a tensor per tensor. With a
    fixed threshold every block of 1 MiB or more is its own mapping, returned on free, and
    export's memory stays at what is live. Process-wide, so :func:`export` never calls it:
    the ``dmuon-ckpt`` CLI does, in its own process; call it yourself in a process that only
    exports. No effect outside glibc.
    """
    try:
        ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        pass


def _stream(listing: CheckpointListing, entries: list[ExportEntry], bar) -> Iterator[torch.Tensor]:
    """Each entry's tensor, one at a time. The writers consume a tensor fully before asking
    for the next, so its buffer is refilled for the next tensor of the same shape and dtype
    (a model is mostly such runs): no allocation, no page faults."""
    last_source: str | None = None
    last: torch.Tensor | None = None
    for entry in entries:
        if last is None or entry.source != last_source:
            recycled, last = last, None
            last = read_full(listing, entry.source, entry.dtype, out=recycled)
            del recycled
            last_source = entry.source
        bar.update(entry.nbytes)
        yield last


def _layout(entries: list[ExportEntry]) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    return [(entry.key, entry.dtype, entry.shape) for entry in entries]


def _shards(entries: list[ExportEntry], max_bytes: int) -> list[list[ExportEntry]]:
    shards: list[list[ExportEntry]] = [[]]
    size = 0
    for entry in entries:
        if shards[-1] and size + entry.nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(entry)
        size += entry.nbytes
    return shards


def resolve_output_options(
    checkpoint_id: str | os.PathLike,
    output: str | os.PathLike,
    storage_options: dict | None,
    output_storage_options: dict | None,
) -> dict | None:
    """The storage options :func:`export` opens ``output`` with.

    ``output_storage_options`` when given (``{}`` included: nothing but the environment's
    defaults); otherwise the checkpoint's ``storage_options`` if the output is on the same
    kind of store (same scheme, or both local), since it then most likely lives on the same
    service under the same account; otherwise none. A source's options never reach a store of
    another kind: S3 credentials are not GCS options, and a local path takes none of them.
    """
    if output_storage_options is not None:
        return output_storage_options
    if store_kind(os.fspath(checkpoint_id)) == store_kind(os.fspath(output)):
        return storage_options
    return None


def export(
    checkpoint_id: str | os.PathLike,
    output: str | os.PathLike,
    *,
    format: str = "safetensors",
    dtype: torch.dtype | str | None = None,
    max_shard_size: int | str = "5GB",
    storage_options: dict | None = None,
    output_storage_options: dict | None = None,
    config: str | os.PathLike | None = None,
) -> list[str]:
    """Turn a dmuon checkpoint into HuggingFace safetensors or one flat ``.pt``; returns the files.

    ``config``: the model's HuggingFace ``config.json``, or a folder holding one (the
    pretrained model's folder). It is copied beside the weights (with the
    ``generation_config.json`` next to it, if any), its dtype field set to the exported
    dtype, so that ``from_pretrained(output)`` needs no other argument; it is read and checked
    before anything is written, opened with the checkpoint's ``storage_options`` when it is on
    the same kind of store. A safetensors export without it warns
    (:class:`dmuon.dcp.hf_config.MissingConfigWarning`) that ``from_pretrained`` will need one.

    ``output`` is a directory for safetensors (``model.safetensors``, or shards plus
    ``model.safetensors.index.json`` beyond ``max_shard_size``) and a file path for
    ``format="torch"``. Keys lose the ``model.`` prefix: they are the unwrapped model's
    ``state_dict()`` keys. ``dtype`` casts floating tensors. Local paths or fsspec URLs.

    ``storage_options`` open the checkpoint. The output is opened with
    ``output_storage_options`` when given; without them it reuses ``storage_options`` only if
    it is on the same kind of store as the checkpoint (both ``s3://``, both ``gs://``, both
    local), taken to be the same service and account; an output of another kind (a local
    directory for an ``s3://`` checkpoint) gets no options of the source's. Pass
    ``output_storage_options={}`` to open a same-kind output with the environment's defaults
    only. Either side may instead take its credentials and endpoint from the environment, as
    s3fs and gcsfs do (``AWS_ACCESS_KEY_ID``, ``AWS_ENDPOINT_URL``, ``~/.aws/config``,
    ``GOOGLE_APPLICATION_CREDENTIALS``, ``STORAGE_EMULATOR_HOST``, ...).
    """
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype.replace("torch.", ""), None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"unknown dtype {dtype!r}")
    output = os.fspath(output)
    if format not in ("safetensors", "torch"):
        raise ValueError(f"format must be 'safetensors' or 'torch', got {format!r}")
    out_options = resolve_output_options(checkpoint_id, output, storage_options, output_storage_options)
    hf_config = None
    if config is not None:
        hf_config = read_hf_config(config, resolve_output_options(checkpoint_id, config, storage_options, None))
    listing = open_checkpoint(checkpoint_id, storage_options)
    entries = model_entries(listing, dtype)
    if format == "torch":
        directory, name = split_location(output)
        store = open_store(directory, out_options)
        store.makedirs()
        with byte_progress(sum(e.nbytes for e in entries), "export .pt") as bar:
            write_torch_file(store, name, entries, _stream(listing, entries, bar))
        return [f"{store.url}/{name}"] + _config_files(store, hf_config, entries)
    store = open_store(output, out_options)
    files = _write_safetensors(store, listing, entries, parse_size(max_shard_size))
    if hf_config is None:
        warn_missing_config(store.url)
    return files + _config_files(store, hf_config, entries)


def _config_files(store: Store, hf_config: HFConfig | None, entries: list[ExportEntry]) -> list[str]:
    """The config beside the weights (after them), its dtype the one most exported bytes have."""
    if hf_config is None:
        return []
    return write_hf_config(store, hf_config, export_dtype((e.dtype, e.nbytes) for e in entries))


def _write_safetensors(
    store: Store, listing: CheckpointListing, entries: list[ExportEntry], max_bytes: int
) -> list[str]:
    """``model.safetensors``, or shards and their index beyond ``max_bytes``; the files' URLs."""
    total = sum(e.nbytes for e in entries)
    store.makedirs()
    shards = _shards(entries, max_bytes)
    with byte_progress(total, "export safetensors") as bar:
        if len(shards) == 1:
            write_safetensors(store, HF_SINGLE_FILE, _layout(entries), _stream(listing, entries, bar))
            return [f"{store.url}/{HF_SINGLE_FILE}"]
        weight_map = {}
        for i, shard in enumerate(shards, start=1):
            name = hf_shard_name(i, len(shards))
            write_safetensors(store, name, _layout(shard), _stream(listing, shard, bar))
            weight_map.update({e.key: name for e in shard})
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    store.put(HF_INDEX_FILE, json.dumps(index, indent=2).encode())
    names = sorted(set(weight_map.values())) + [HF_INDEX_FILE]
    return [f"{store.url}/{name}" for name in names]
