"""Offline export of a dmuon checkpoint, one tensor at a time.

Peak memory is about the largest tensor plus the output buffer, whatever the model size:
each tensor is assembled from its stored chunks, cast, written and dropped before the next.
Both output writers know every key, shape and dtype up front (from the checkpoint metadata),
so they can lay out their headers before the first byte of data:

* safetensors: the 8-byte header length and JSON header, then the tensors' bytes;
* torch: the zip archive ``torch.save`` writes, with ``data.pkl`` pickled from shape-only
  stand-ins and each storage record written as its tensor arrives.
"""

from __future__ import annotations

import collections
import json
import math
import os
import pickle
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

from ..compat import open_zipfile_writer, rebuild_tensor, storage_alignment, storage_type_names
from .checkpoint import CheckpointListing, open_checkpoint
from .hf import SAFETENSORS_DTYPES
from .store import is_remote

MODEL_PREFIX = "model."

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
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()


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
                region = out
                for dim, (offset, size) in enumerate(zip(chunk.offsets, chunk.sizes)):
                    region = region.narrow(dim, offset, size)
                region.copy_(piece)
                del piece
    return out


# ---------------------------------------------------------------------------------------------
# output writers
# ---------------------------------------------------------------------------------------------
def _open_output(path: str, storage_options: dict | None):
    if is_remote(path):
        import fsspec

        return fsspec.open(path, "wb", **(storage_options or {})).open()
    os.makedirs(os.path.dirname(os.path.abspath(path)) or ".", exist_ok=True)
    return open(path, "wb")


def _tensor_bytes(tensor: torch.Tensor) -> memoryview:
    flat = tensor.contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(b"")  # type: ignore[arg-type]


def write_safetensors(
    path: str,
    entries: list[ExportEntry],
    tensors: Iterator[torch.Tensor],
    storage_options: dict | None,
    metadata: dict | None = None,
) -> None:
    header: dict = {"__metadata__": {"format": "pt", **(metadata or {})}}
    offset = 0
    for entry in entries:
        if entry.dtype not in SAFETENSORS_DTYPES:
            raise ValueError(f"{entry.key}: dtype {entry.dtype} has no safetensors equivalent")
        header[entry.key] = {
            "dtype": SAFETENSORS_DTYPES[entry.dtype],
            "shape": list(entry.shape),
            "data_offsets": [offset, offset + entry.nbytes],
        }
        offset += entry.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # data starts 8-byte aligned
    with _open_output(path, storage_options) as out:
        out.write(len(raw).to_bytes(8, "little"))
        out.write(raw)
        for _entry, tensor in zip(entries, tensors):
            out.write(_tensor_bytes(tensor))
            del tensor  # before the next one is read (see _write_torch_records)


class _StorageStub:
    def __init__(self, key: str, dtype: torch.dtype, numel: int) -> None:
        self.key, self.dtype, self.numel = key, dtype, numel


class _TensorStub:
    """Pickles exactly like a contiguous CPU tensor whose storage is ``storage``."""

    def __init__(self, storage: _StorageStub, shape: tuple[int, ...]) -> None:
        self.storage, self.shape = storage, shape

    def __reduce_ex__(self, protocol):
        stride = []
        step = 1
        for size in reversed(self.shape):
            stride.append(step)
            step *= max(size, 1)
        return (
            rebuild_tensor,
            (self.storage, 0, torch.Size(self.shape), tuple(reversed(stride)), False, collections.OrderedDict()),
        )


class _StubPickler(pickle.Pickler):
    def persistent_id(self, obj):
        if isinstance(obj, _StorageStub):
            storage_type = getattr(torch, storage_type_names()[obj.dtype])
            return ("storage", storage_type, obj.key, "cpu", obj.numel)
        return None


def write_torch_file(
    path: str, entries: list[ExportEntry], tensors: Iterator[torch.Tensor], storage_options: dict | None
) -> None:
    """A file ``torch.load(path, weights_only=True)`` reads as ``{key: tensor}``."""
    storages: dict[str, _StorageStub] = {}
    stubs = {}
    for entry in entries:
        if entry.source not in storages:
            storages[entry.source] = _StorageStub(str(len(storages)), entry.dtype, math.prod(entry.shape))
        stubs[entry.key] = _TensorStub(storages[entry.source], entry.shape)
    import io

    buffer = io.BytesIO()
    _StubPickler(buffer, protocol=2).dump(stubs)
    pickled = buffer.getvalue()
    if is_remote(path):
        with _open_output(path, storage_options) as out:
            _write_torch_records(out, pickled, storages, entries, tensors)
    else:
        # torch's writer given a path writes straight to the file; given a Python stream it
        # keeps far more in flight (a third of the model, measured)
        os.makedirs(os.path.dirname(os.path.abspath(path)) or ".", exist_ok=True)
        _write_torch_records(path, pickled, storages, entries, tensors)


def _write_torch_records(
    target, pickled: bytes, storages: dict, entries: list[ExportEntry], tensors: Iterator[torch.Tensor]
) -> None:
    with open_zipfile_writer(target) as writer:
        writer.write_record("data.pkl", pickled, len(pickled))
        writer.write_record(".format_version", "1", 1)
        alignment = str(storage_alignment())
        writer.write_record(".storage_alignment", alignment, len(alignment))
        writer.write_record("byteorder", sys.byteorder, len(sys.byteorder))
        written = set()
        for entry, tensor in zip(entries, tensors):
            stub = storages[entry.source]
            if stub.key in written:
                continue
            data = tensor.contiguous()
            writer.write_record(f"data/{stub.key}", data.untyped_storage(), data.untyped_storage().nbytes())
            written.add(stub.key)
            # Let go before the next tensor is read: allocating it while this one lives
            # fragments the heap, and RSS then climbs by a tensor per tensor.
            del tensor, data


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
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        pass


def _progress(total_bytes: int, desc: str):
    from tqdm import tqdm

    return tqdm(
        total=total_bytes,
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        desc=desc,
        disable=not sys.stderr.isatty(),
        file=sys.stderr,
    )


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


def _join(base: str, name: str) -> str:
    return f"{base.rstrip('/')}/{name}" if is_remote(base) else os.path.join(base, name)


def export(
    checkpoint_id: str | os.PathLike,
    output: str | os.PathLike,
    *,
    format: str = "safetensors",
    dtype: torch.dtype | str | None = None,
    max_shard_size: int | str = "5GB",
    storage_options: dict | None = None,
    output_storage_options: dict | None = None,
) -> list[str]:
    """Turn a dmuon checkpoint into HuggingFace safetensors or one flat ``.pt``; returns the files.

    ``output`` is a directory for safetensors (``model.safetensors``, or shards plus
    ``model.safetensors.index.json`` beyond ``max_shard_size``) and a file path for
    ``format="torch"``. Keys lose the ``model.`` prefix: they are the unwrapped model's
    ``state_dict()`` keys. ``dtype`` casts floating tensors. Local paths or fsspec URLs.
    """
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype.replace("torch.", ""), None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"unknown dtype {dtype!r}")
    output = os.fspath(output)
    out_options = output_storage_options if output_storage_options is not None else storage_options
    listing = open_checkpoint(checkpoint_id, storage_options)
    entries = model_entries(listing, dtype)
    total = sum(e.nbytes for e in entries)
    if format == "torch":
        with _progress(total, "export .pt") as bar:
            write_torch_file(output, entries, _stream(listing, entries, bar), out_options)
        return [output]
    if format != "safetensors":
        raise ValueError(f"format must be 'safetensors' or 'torch', got {format!r}")
    shards = _shards(entries, parse_size(max_shard_size))
    files = []
    with _progress(total, "export safetensors") as bar:
        if len(shards) == 1:
            name = "model.safetensors"
            write_safetensors(_join(output, name), entries, _stream(listing, entries, bar), out_options)
            return [_join(output, name)]
        weight_map = {}
        for i, shard in enumerate(shards, start=1):
            name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            write_safetensors(_join(output, name), shard, _stream(listing, shard, bar), out_options)
            weight_map.update({e.key: name for e in shard})
            files.append(_join(output, name))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    index_path = _join(output, "model.safetensors.index.json")
    with _open_output(index_path, out_options) as out:
        out.write(json.dumps(index, indent=2).encode())
    return files + [index_path]
