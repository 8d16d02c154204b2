"""The compact form in which one rank sends a checkpoint's ``Metadata`` to the others.

A load opens the checkpoint's small files on one rank and sends what it found to every rank
(``operation.open_once``). Most of ``.metadata`` is one entry per stored chunk: each tensor of
an FSDP2 checkpoint of N ranks has N chunks, each with its offsets, sizes and storage range,
so what every rank receives grows with N. Pickled (even compressed) each chunk costs about 14
bytes on the wire: class references, ``torch.Size`` wrappers and absolute file offsets that
differ every time. Here the chunks travel as columns of integers instead -- offsets, sizes,
and each storage range as its distance from the end of the previous range in the same file
(zero or a frame header in files written front to back) -- which compress to about a sixth
(an 8-rank checkpoint of 909 keys and 4,059 chunks: 57.4 KB sent as 10.0 KB). The flatten mappings in
``planner_data`` travel as the lengths of the key's dot-separated parts where they are exactly
those parts.

The receiving side rebuilds a ``Metadata`` equal to the one decoded on the sending rank
(``tests/dcp/test_metadata_wire.py`` checks it entry by entry on the checkpoints the tests
write). What the columns do not describe -- an entry of another kind, a range with transform
descriptors, a chunk with no storage -- travels as it is, pickled, beside them.
"""

from __future__ import annotations

import pickle
import zlib
from array import array
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)

from .. import compat
from .format.planner_mappings import joined_mappings, split_mappings

__all__ = ["WIRE_FORMAT", "decode_metadata", "encode_metadata"]

WIRE_FORMAT = "dmuon-metadata-wire/1"

_NO_STORAGE = -1  # a chunk whose storage entry travels with the others (or has none)


def encode_metadata(metadata: Metadata) -> bytes:
    """``metadata`` as sent by ``open_once`` (compressed; :func:`decode_metadata` undoes it)."""
    storage = metadata.storage_data if isinstance(metadata.storage_data, dict) else {}
    storage_info = compat.StorageInfo
    # each storage entry by its place; the key itself is kept for its ``index`` hint, which a
    # MetadataIndex does not compare
    places = {(key.fqn, key.offset): (key, info) for key, info in storage.items()}
    files: dict[str, int] = {}
    ends: dict[int, int] = {}  # file -> end of the last range written to the columns
    entries: list[Any] = []  # per key: a properties number (a tensor), else the entry itself
    properties: list[Any] = []
    shapes, chunks, ranges = array("q"), array("q"), array("q")
    for fqn, entry in metadata.state_dict_metadata.items():
        if not isinstance(entry, TensorStorageMetadata):
            entries.append(entry)
            continue
        if entry.properties not in properties:
            properties.append(entry.properties)
        entries.append(properties.index(entry.properties))
        shapes.extend((len(entry.size), *entry.size, len(entry.chunks)))
        for chunk in entry.chunks:
            chunks.extend(chunk.offsets)
            chunks.extend(chunk.sizes)
            place = (fqn, chunk.offsets)
            key, info = places.get(place, (None, None))
            if type(info) is not storage_info or info.transform_descriptors is not None:
                ranges.extend((_NO_STORAGE, 0, 0, 0))
                continue
            del places[place]
            file = files.setdefault(info.relative_path, len(files))
            hint = key.index
            ranges.extend((file, info.offset - ends.get(file, 0), info.length, -1 if hint is None else hint))
            ends[file] = info.offset + info.length
    others = dict(places.values())
    mappings, planner_rest = split_mappings(metadata)
    body = (
        WIRE_FORMAT,
        list(metadata.state_dict_metadata),
        entries,
        properties,
        list(files),
        shapes.tobytes(),
        chunks.tobytes(),
        ranges.tobytes(),
        others,
        mappings,
        planner_rest,
        metadata.storage_meta,
        metadata.version,
        metadata.storage_data is None,
    )
    return zlib.compress(pickle.dumps(body, protocol=pickle.HIGHEST_PROTOCOL), 6)


def decode_metadata(data: bytes) -> Metadata:
    """The ``Metadata`` that :func:`encode_metadata` was given."""
    (
        wire_format,
        keys,
        entries,
        properties,
        files,
        shapes_bytes,
        chunks_bytes,
        ranges_bytes,
        others,
        mappings,
        planner_rest,
        storage_meta,
        version,
        no_storage,
    ) = pickle.loads(zlib.decompress(data))
    if wire_format != WIRE_FORMAT:  # pragma: no cover - one release sends and receives
        raise ValueError(f"metadata sent as {wire_format!r}, expected {WIRE_FORMAT!r}")
    shapes, chunks, ranges = (_ints(raw) for raw in (shapes_bytes, chunks_bytes, ranges_bytes))
    state: dict[str, Any] = {}
    storage: dict[MetadataIndex, Any] = {}
    ends: dict[int, int] = {}
    at_shape = at_chunk = at_range = 0
    for fqn, entry in zip(keys, entries):
        if not isinstance(entry, int):
            state[fqn] = entry
            continue
        ndim = shapes[at_shape]
        size = torch.Size(shapes[at_shape + 1 : at_shape + 1 + ndim])
        count = shapes[at_shape + 1 + ndim]
        at_shape += ndim + 2
        stored = []
        for _ in range(count):
            offsets = torch.Size(chunks[at_chunk : at_chunk + ndim])
            stored.append(
                ChunkStorageMetadata(offsets=offsets, sizes=torch.Size(chunks[at_chunk + ndim : at_chunk + 2 * ndim]))
            )
            at_chunk += 2 * ndim
            file, gap, length, hint = ranges[at_range : at_range + 4]
            at_range += 4
            if file == _NO_STORAGE:
                continue
            offset = ends.get(file, 0) + gap
            ends[file] = offset + length
            index = MetadataIndex(fqn, offsets, None if hint < 0 else hint)
            storage[index] = compat.StorageInfo(relative_path=files[file], offset=offset, length=length)
        state[fqn] = TensorStorageMetadata(properties=properties[entry], size=size, chunks=stored)
    storage.update(others)
    return Metadata(
        state_dict_metadata=state,
        planner_data=joined_mappings(keys, mappings, planner_rest),
        storage_data=None if no_storage else storage,
        storage_meta=storage_meta,
        version=version,
    )


def _ints(raw: bytes) -> list[int]:
    values = array("q")
    values.frombytes(raw)
    return values.tolist()
