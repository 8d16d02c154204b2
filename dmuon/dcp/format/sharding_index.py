"""The sharding index: a checkpoint's ``Metadata`` in a size that does not grow with the ranks.

``.metadata`` lists every stored chunk with its byte range: under FSDP2 1-D each tensor has
one chunk per rank, so a load that reads it on one rank and sends it to all (``open_once``)
moves keys x N entries to each of N ranks, and every rank plans over all of them. A training
checkpoint is regular, and the index, written by the coordinator into the manifest at commit
(``manifest.py``, field ``index``), says the same thing by rules:

* per key, its entry as in ``.metadata`` without its chunks, and the chunks either as a rule
  (*cut along dim 0 every R rows into C chunks, chunk j in data file F + j*: an FSDP2 shard,
  or a dedicated weight as one chunk) or listed (HSDP's few chunks per key, anything else),
  each with the data file that holds it;
* the data files, by rank (their names are ``layout.data_file_name`` of one save id), each
  with its *class*: the files whose items lie at the same offsets and lengths, key for key
  (every shard rank of an FSDP2 checkpoint but the first and the last), share one list of
  items.

What it costs is per key and per class, plus a few bytes per file: at 16,384 ranks about what
it costs at 1,024. :func:`decode_index` rebuilds a ``Metadata`` whose rule chunks
(:class:`RegularChunks`) and storage entries (:class:`IndexedStorage`) are computed when asked
for; :func:`narrowed` keeps, per key, the chunks a rank's tensors overlap, so that a rank plans
over its own reads, not the world's. A save whose metadata fits none of this (two chunks of a
key in one file, a storage entry of another kind) writes no index, and its loads read
``.metadata`` as before; ``.metadata`` is written either way, for torch's own reader.

The index is a pickle of builtins and DCP's metadata classes, read with the same allow-list as
``.metadata`` (``safe_metadata.py``), and compressed; the manifest's checksum covers it.
"""

from __future__ import annotations

import dataclasses
import pickle
import zlib
from array import array
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, cast

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)

from ... import compat
from ..errors import CheckpointCorruptError
from .layout import RankFileNames, data_file_name, rank_of_data_file, save_id_of_data_file
from .planner_mappings import joined_mappings, split_mappings
from .safe_metadata import load_allowed_pickle

__all__ = ["INDEX_FORMAT", "IndexedStorage", "RegularChunks", "chunk_at", "decode_index", "encode_index", "narrowed"]

INDEX_FORMAT = "dmuon-index/1"

_RULE, _LISTED, _BYTES = 0, 1, 2  # how a key's chunks are described


class RegularChunks(Sequence[ChunkStorageMetadata]):
    """A tensor of ``size`` cut along dim 0 every ``rows`` rows into ``count`` chunks (the last
    one possibly short; an index keeps no empty chunk), computed when asked for: iterating
    gives every chunk, as a list would; :meth:`position` and :meth:`overlapping` answer
    without iterating."""

    def __init__(self, size: Sequence[int], rows: int, count: int) -> None:
        self.size, self.rows, self.n_chunks = tuple(size), rows, count

    def __len__(self) -> int:
        return self.n_chunks

    def __getitem__(self, j):
        if isinstance(j, slice):
            return [self[k] for k in range(*j.indices(self.n_chunks))]
        if j < 0:
            j += self.n_chunks
        if not 0 <= j < self.n_chunks:
            raise IndexError(j)
        start = min(j * self.rows, self.size[0])
        rows = max(0, min(self.rows, self.size[0] - start))
        return ChunkStorageMetadata(
            offsets=torch.Size((start,) + (0,) * (len(self.size) - 1)), sizes=torch.Size((rows,) + self.size[1:])
        )

    def position(self, offsets: Sequence[int]) -> int | None:
        """The number of the chunk that starts at ``offsets`` (None: none does)."""
        offsets = tuple(offsets)
        if len(offsets) != len(self.size) or any(offsets[1:]) or self.rows <= 0:
            return None
        j = offsets[0] // self.rows
        return j if j < self.n_chunks and j * self.rows == offsets[0] else None

    def overlapping(self, offsets: Sequence[int], sizes: Sequence[int]) -> range:
        """The chunks that share at least one element with the box at ``offsets`` of ``sizes``."""
        if not sizes or any(s <= 0 for s in sizes) or self.rows <= 0:
            return range(0)
        first, last = offsets[0] // self.rows, (offsets[0] + sizes[0] - 1) // self.rows
        return range(min(first, self.n_chunks), min(last + 1, self.n_chunks))


def chunk_at(md: TensorStorageMetadata, offsets: Sequence[int]) -> ChunkStorageMetadata | None:
    """The chunk of ``md`` that starts at ``offsets``, without a walk over a rule's chunks."""
    if isinstance(md.chunks, RegularChunks):
        j = md.chunks.position(offsets)
        return None if j is None else md.chunks[j]
    offsets = tuple(offsets)
    return next((c for c in md.chunks if tuple(c.offsets) == offsets), None)


class IndexedStorage(Mapping[MetadataIndex, Any]):
    """``Metadata.storage_data`` of an indexed checkpoint: a chunk's file from its key's rule
    or list, its offset and length from its file's class."""

    def __init__(self, names: Sequence[str], specs: list[tuple], entries: dict[str, Any], classes, file_class) -> None:
        self.names, self._specs, self._entries = names, specs, entries
        self._keys = {fqn: k for k, fqn in enumerate(entries)}
        self._classes = classes  # per class: its items' keys, gaps and lengths (``_class_items``)
        self._file_class = file_class
        self._class_items: dict[int, dict[int, tuple[int, int]]] = {}
        self._listed: dict[int, dict[tuple, int]] = {}

    def _file_of(self, index: MetadataIndex) -> tuple[int, int] | None:
        k = self._keys.get(index.fqn)
        if k is None:
            return None
        spec, md = self._specs[k], self._entries[index.fqn]
        if spec[0] == _BYTES:
            return (k, spec[1]) if index.offset is None else None
        if index.offset is None:
            return None
        if spec[0] == _RULE:
            j = md.chunks.position(index.offset)
            return None if j is None else (k, spec[3] + j)
        listed = self._listed.get(k)
        if listed is None:
            listed = self._listed[k] = {tuple(c.offsets): j for j, c in enumerate(md.chunks)}
        j = listed.get(tuple(index.offset))
        return None if j is None else (k, spec[1][j])

    def __getitem__(self, index: MetadataIndex) -> Any:
        found = self._file_of(index)
        if found is None:
            raise KeyError(index)
        k, f = found
        cls = self._file_class[f]
        items = self._class_items.get(cls)
        if items is None:
            items = self._class_items[cls] = {key: (o, n) for key, o, n in _class_items(self._classes[cls])}
        place = items.get(k)
        if place is None:
            raise KeyError(index)
        return compat.StorageInfo(self.names[f], place[0], place[1])

    def __iter__(self) -> Iterator[MetadataIndex]:
        for fqn, md in self._entries.items():
            if isinstance(md, TensorStorageMetadata):
                for chunk in md.chunks:
                    yield MetadataIndex(fqn, chunk.offsets)
            else:
                yield MetadataIndex(fqn)

    def __len__(self) -> int:
        return sum(len(md.chunks) if isinstance(md, TensorStorageMetadata) else 1 for md in self._entries.values())

    def item_ends(self) -> dict[str, int]:
        """Per data file, where its last item ends (a file shorter than that is damaged)."""
        ends = [max((o + n for _, o, n in _class_items(columns)), default=0) for columns in self._classes]
        return {name: ends[cls] for name, cls in zip(self.names, self._file_class)}


def _class_items(columns: tuple[bytes, bytes, bytes]) -> Iterator[tuple[int, int, int]]:
    """A class's items (key number, offset, length) from its columns: the keys, the gap before
    each item (from the end of the one before: a frame header, mostly alike) and the lengths."""
    end = 0
    for key, gap, length in zip(*(array("q", column) for column in columns)):
        if gap < 0 or length < 0:
            raise CheckpointCorruptError("the sharding index places an item at a negative gap or length")
        yield key, end + gap, length
        end += gap + length


def _class_columns(items: tuple[tuple[int, int, int], ...]) -> tuple[bytes, bytes, bytes]:
    """What :func:`_class_items` reads back: items sorted by offset, as keys, gaps and lengths."""
    keys, gaps, lengths, end = array("q"), array("q"), array("q"), 0
    for key, offset, length in items:
        if offset < end:
            raise ValueError("overlapping items")
        keys.append(key)
        gaps.append(offset - end)
        lengths.append(length)
        end = offset + length
    return keys.tobytes(), gaps.tobytes(), lengths.tobytes()


def _rule_of(md: TensorStorageMetadata, file_numbers: list[int]) -> tuple | None:
    """The rule that gives ``md``'s chunks and their files, if one does."""
    size, chunks = tuple(md.size), md.chunks
    if not size or not chunks or any(f != file_numbers[0] + j for j, f in enumerate(file_numbers)):
        return None
    rows = chunks[0].sizes[0] if len(chunks) > 1 else max(size[0], 1)
    if rows <= 0:
        return None
    rule = RegularChunks(size, rows, len(chunks))
    if any(tuple(c.offsets) != tuple(r.offsets) or tuple(c.sizes) != tuple(r.sizes) for c, r in zip(chunks, rule)):
        return None
    return (_RULE, rows, len(chunks), file_numbers[0])


def _file_table(names: set[str]) -> tuple[list[str], tuple] | None:
    """The data files in rank order, and how the index writes their names."""
    ranks: dict[str, int] = {}
    for name in names:
        rank = rank_of_data_file(name)
        if rank is None:
            return None
        ranks[name] = rank
    ordered = sorted(names, key=ranks.__getitem__)
    save_ids = {save_id_of_data_file(name) for name in ordered}
    save_id = save_ids.pop() if len(save_ids) == 1 else None
    if save_id is not None and all(data_file_name(ranks[name], save_id) == name for name in ordered):
        return ordered, ("ranks", save_id, array("q", (ranks[name] for name in ordered)).tobytes())
    return ordered, ("names", ordered)


def encode_index(metadata: Metadata) -> bytes | None:
    """The index of ``metadata`` (its ``storage_data`` filled in), or None where it does not
    fit (module docstring)."""
    storage = metadata.storage_data
    if not isinstance(storage, dict) or not storage:
        return None
    if any(type(info) is not compat.StorageInfo or info.transform_descriptors is not None for info in storage.values()):
        return None
    table = _file_table({info.relative_path for info in storage.values()})
    if table is None:
        return None
    names, name_form = table
    number = {name: f for f, name in enumerate(names)}
    places = {
        (index.fqn, None if index.offset is None else tuple(index.offset)): info for index, info in storage.items()
    }
    per_file: list[list[tuple[int, int, int]]] = [[] for _ in names]
    entries: dict[str, Any] = {}
    specs: list[tuple] = []
    properties: list[Any] = []
    for k, (fqn, md) in enumerate(metadata.state_dict_metadata.items()):
        if isinstance(md, BytesStorageMetadata):
            located = [places.pop((fqn, None), None)]
        elif isinstance(md, TensorStorageMetadata):
            # an empty chunk holds nothing to read (torch may give several the same offsets)
            empty = [c for c in md.chunks if 0 in tuple(c.sizes)]
            for c in empty:
                places.pop((fqn, tuple(c.offsets)), None)
            if empty:
                md = dataclasses.replace(md, chunks=[c for c in md.chunks if 0 not in tuple(c.sizes)])
            located = [places.pop((fqn, tuple(c.offsets)), None) for c in md.chunks]
        else:
            return None
        if any(info is None for info in located):
            return None
        located = cast(list[Any], located)
        files = [number[info.relative_path] for info in located]
        if len(set(files)) != len(files):
            return None  # two chunks of one key in one file: a class could not tell them apart
        for f, info in zip(files, located):
            per_file[f].append((k, info.offset, info.length))
        if isinstance(md, BytesStorageMetadata):
            specs.append((_BYTES, files[0]))
            entries[fqn] = md
            continue
        rule = _rule_of(md, files)
        specs.append(rule if rule is not None else (_LISTED, files))
        shared = next((p for p in properties if p == md.properties), None)  # pickled once
        if shared is None:
            properties.append(shared := md.properties)
        entries[fqn] = dataclasses.replace(md, properties=shared, chunks=[] if rule is not None else list(md.chunks))
    if places:
        return None  # storage no key claims
    classes: dict[tuple, int] = {}
    file_class = array("q")
    for items in per_file:
        items.sort(key=lambda item: item[1])
        file_class.append(classes.setdefault(tuple(items), len(classes)))
    try:
        columns = [_class_columns(items) for items in classes]
    except ValueError:
        return None  # items that overlap in a file
    mappings, planner_rest = split_mappings(metadata)
    skeleton = Metadata(state_dict_metadata=entries, planner_data=None, storage_data=None, storage_meta=None)
    skeleton.version = metadata.version
    body = (INDEX_FORMAT, skeleton, specs, name_form, columns, file_class.tobytes(), mappings, planner_rest)
    return zlib.compress(pickle.dumps(body, protocol=pickle.HIGHEST_PROTOCOL), 6)


def decode_index(data: bytes, where: str) -> Metadata:
    """The ``Metadata`` the index describes, its chunks and storage computed when asked for;
    :class:`CheckpointCorruptError` if the index is not one."""
    try:
        body: Any = load_allowed_pickle(zlib.decompress(data), where, "the sharding index")
        tag, skeleton, specs, name_form, columns, file_class_bytes, mappings, planner_rest = body
        if tag != INDEX_FORMAT or not isinstance(skeleton, Metadata):
            raise ValueError(tag)
        names: Sequence[str]
        if name_form[0] == "ranks":
            names = RankFileNames(name_form[1], array("q", name_form[2]))
        elif name_form[0] == "names":
            names = list(name_form[1])
        else:
            raise ValueError(name_form[0])
        file_class = array("q", file_class_bytes)
        entries = skeleton.state_dict_metadata
        if (
            len(file_class) != len(names)
            or len(specs) != len(entries)
            or any(not 0 <= c < len(columns) for c in file_class)
        ):
            raise ValueError("tables of different lengths")
        for (fqn, md), spec in zip(entries.items(), specs):
            if spec[0] != _BYTES and not isinstance(md, TensorStorageMetadata):
                raise ValueError(fqn)
            md = cast(TensorStorageMetadata, md)
            if spec[0] == _RULE:
                _, rows, count, first = spec
                if not 0 <= first <= first + count <= len(names):
                    raise ValueError(fqn)
                md.chunks = RegularChunks(md.size, rows, count)  # type: ignore[assignment]
            elif spec[0] == _LISTED:
                if len(spec[1]) != len(md.chunks) or any(not 0 <= f < len(names) for f in spec[1]):
                    raise ValueError(fqn)
            elif spec[0] != _BYTES or not 0 <= spec[1] < len(names):
                raise ValueError(fqn)
        skeleton.planner_data = joined_mappings(list(entries), mappings, planner_rest)
    except CheckpointCorruptError:
        raise
    except (zlib.error, ValueError, TypeError, IndexError, AttributeError) as exc:
        raise CheckpointCorruptError(f"{where}: the sharding index in the manifest cannot be decoded ({exc})") from exc
    skeleton.storage_data = IndexedStorage(names, specs, entries, columns, file_class)
    return skeleton


def _local_boxes(value: Any) -> list[tuple[tuple, tuple]]:
    """The boxes of a tensor's global shape that a state-dict value holds here (a DTensor its
    local shards, a tensor all of itself), as torch's planner finds them."""
    if hasattr(value, "__create_chunk_list__"):
        return [(tuple(c.offsets), tuple(c.sizes)) for c in value.__create_chunk_list__()]
    if isinstance(value, torch.Tensor):
        return [((0,) * value.dim(), tuple(value.shape))]
    return []


def narrowed(metadata: Metadata, state: Mapping[str, Any]) -> Metadata:
    """``metadata`` with each rule's chunks cut to those ``state``'s values overlap: what one
    rank plans over (the same plan as over every chunk; a key ``state`` lacks keeps none)."""
    entries = {}
    for fqn, md in metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata) and isinstance(md.chunks, RegularChunks):
            wanted: set[int] = set()
            for offsets, sizes in _local_boxes(state.get(fqn)):
                wanted.update(md.chunks.overlapping(offsets, sizes))
            md = dataclasses.replace(md, chunks=[md.chunks[j] for j in sorted(wanted)])
        entries[fqn] = md
    return dataclasses.replace(metadata, state_dict_metadata=entries)
