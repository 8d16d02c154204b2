"""DCP storage writer and reader over any store: checksums, the commit protocol, safe reading.

One writer and one reader for every backend (stores in ``stores.py``, manifest and safe
metadata decoding in ``integrity.py``). This module knows nothing of models.

Commit protocol of a save with id ``S``:

1. every rank writes its data file ``__<rank>_<S>.distcp`` (new names: an existing checkpoint
   at the same path is not touched), computing a CRC32 per file and per item as bytes go out;
2. the coordinator writes the manifest ``.dmuon-manifest-<S>.json`` (sizes and CRCs of every
   data file and item, and of the ``.metadata`` bytes about to be written, self-checksummed);
3. the coordinator writes ``.metadata`` last: the one commit marker. Without ``overwrite`` this
   is exclusive (a concurrent committed save makes it fail); with ``overwrite`` it replaces the
   old one atomically, so a reader always sees the old or the new checkpoint, never a mixture;
4. files of other saves at that path (older data files, manifests) are deleted.

Loading verifies the ``.metadata`` bytes against the manifest before unpickling them with an
allow-listed unpickler, rejects storage paths that leave the checkpoint, checks every item's
size and CRC as it is read, and loads non-tensor entries with ``weights_only=True``.
"""
from __future__ import annotations

import contextlib
import dataclasses
import io
import logging
import math
import os
import pickle
import re
import struct
import sys
import time
import uuid
import warnings
import zipfile
import zlib
from collections import defaultdict
from typing import Any, BinaryIO

import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION, _StorageInfo
from torch.distributed.checkpoint.metadata import (
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    SavePlan,
    SavePlanner,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from ..topology import current_rank
from .errors import (
    CheckpointCorruptError,
    CheckpointExistsError,
    CheckpointIncompleteError,
    CheckpointNotFoundError,
)
from .format import RESERVED_KEY
from .integrity import _crc, decode_manifest, encode_manifest, load_metadata_bytes, manifest_name
from .stores import (
    METADATA,
    Store,
    checked_name,
    open_store,
    retrying,
)

log = logging.getLogger(__name__)

_DATA_FILE = re.compile(r"^__\d+_[0-9A-Za-z]+\.distcp$")
_MANIFEST_FILE = re.compile(r"^\.dmuon-manifest-[0-9a-f]+\.json$")
_TMP_FILE = re.compile(r"^\.(metadata|dmuon-manifest-[0-9a-f]+\.json)\.tmp-[0-9a-f]+$")
_FILE_STATS = "__dmuon_file_stats__"
STALE_AFTER_S = 3600.0  # files of a failed save older than this are collected by the next commit

# ---------------------------------------------------------------------------------------------
# the writer
# ---------------------------------------------------------------------------------------------
class _ChecksummingStream:
    """Forwards writes, counting bytes and keeping the CRC of the current item.

    Items tile the file end to end, so their CRCs cover every byte: one CRC pass per byte,
    not two (a whole-file CRC on top cost as much again, ~0.1x of a save's time here).
    """

    def __init__(self, raw: BinaryIO) -> None:
        self.raw = raw
        self.pos = 0
        self.item_crc = 0

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        self.raw.write(view)
        self.item_crc = zlib.crc32(view, self.item_crc)
        self.pos += view.nbytes
        return view.nbytes

    def flush(self) -> None:
        self.raw.flush()

    def tell(self) -> int:
        return self.pos


def _cpu_compact(tensor: torch.Tensor) -> torch.Tensor:
    """What torch.save should see: on CPU, contiguous, not a view into a larger storage."""
    tensor = tensor.detach()
    if tensor.device.type != "cpu":
        tensor = tensor.cpu()
    if not tensor.is_contiguous() or tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size():
        tensor = tensor.contiguous().clone()
    return tensor


class DMuonStorageWriter(StorageWriter):
    """DCP storage writer for local paths and fsspec URLs with checksums and a safe commit."""

    def __init__(
        self,
        checkpoint_id: str | os.PathLike | None = None,
        *,
        storage_options: dict | None = None,
        overwrite: bool = False,
        sync_files: bool | None = None,
    ) -> None:
        super().__init__()
        self.storage_options = storage_options
        self.overwrite = overwrite
        self.sync_files = sync_files
        self.store: Store | None = None
        if checkpoint_id is not None:
            self.reset(checkpoint_id)

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id is not None:
            self.checkpoint_id = checkpoint_id
            self.store = open_store(checkpoint_id, self.storage_options, self.sync_files)
        self.save_id = None

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if self.store is None:
            raise ValueError("DMuonStorageWriter needs a checkpoint_id")
        self.is_coordinator = is_coordinator
        self.rank = kwargs.get("rank", current_rank())
        self._replaced: set[str] = set()
        if is_coordinator:
            self.store.makedirs()
            files = self.store.list()
            self._replaced = self._files_of_committed_saves(files)
            if not self.overwrite and METADATA in files:
                raise CheckpointExistsError(
                    f"{self.store.url} already holds a committed checkpoint; pass overwrite=True to "
                    "replace it (the old one stays readable until the new one commits)"
                )

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        save_id = uuid.uuid4().hex[:16]
        return [
            dataclasses.replace(plan, storage_data={"save_id": save_id, "file": f"__{rank}_{save_id}.distcp"})
            for rank, plan in enumerate(plans)
        ]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        info = plan.storage_data
        self.save_id = info["save_id"]
        results: list[WriteResult] = []
        if plan.items:
            name = info["file"]
            results = retrying(self.store, f"writing {name}", lambda: self._write_file(name, plan.items, planner),
                               writing=True)
        future: Future = Future()
        future.set_result(results)
        return future

    def _write_file(self, name: str, items, planner: SavePlanner) -> list[WriteResult]:
        """One rank's data file, start to end (so a failed attempt can simply be redone)."""
        results = []
        items_crc: dict[str, list[int]] = {}
        # bytes first (small), then tensors in plan order
        items = sorted(items, key=lambda item: item.type != WriteItemType.BYTE_IO)
        with self.store.open_write(name) as raw:
            stream = _ChecksummingStream(raw)
            for item in items:
                data = planner.resolve_data(item)
                offset = stream.tell()
                stream.item_crc = 0
                if item.type == WriteItemType.BYTE_IO:
                    stream.write(data.getbuffer())
                else:
                    torch.save(_cpu_compact(data), stream)
                length = stream.tell() - offset
                items_crc[str(offset)] = [length, stream.item_crc & 0xFFFFFFFF]
                results.append(WriteResult(index=item.index, size_in_bytes=length,
                                           storage_data=_StorageInfo(name, offset, length)))
        stats = {"size": stream.tell(), "items": items_crc}
        results.append(WriteResult(index=MetadataIndex(f"{_FILE_STATS}{name}"), size_in_bytes=0,
                                   storage_data={"file": name, **stats}))
        return results

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        files: dict[str, dict] = {}
        storage_data = {}
        for rank_results in results:
            for result in rank_results:
                if result.index.fqn.startswith(_FILE_STATS):
                    stats = dict(result.storage_data)
                    files[stats.pop("file")] = stats
                else:
                    storage_data[result.index] = result.storage_data
        save_id = self.save_id or uuid.uuid4().hex[:16]
        metadata.version = CURRENT_DCP_VERSION  # what torch's own writers record
        metadata.storage_data = storage_data
        metadata.storage_meta = StorageMeta(checkpoint_id=str(self.store.url), save_id=save_id)
        metadata_bytes = pickle.dumps(metadata, protocol=pickle.HIGHEST_PROTOCOL)
        manifest = encode_manifest(save_id, files, metadata_bytes)
        retrying(self.store, "writing the manifest", lambda: self.store.put(manifest_name(save_id), manifest),
                 writing=True)
        try:
            retrying(self.store, "committing .metadata",
                     lambda: self.store.put(METADATA, metadata_bytes, exclusive=not self.overwrite), writing=True)
        except FileExistsError as exc:
            for name in list(files) + [manifest_name(save_id)]:
                self.store.delete(name)
            raise CheckpointExistsError(
                f"{self.store.url}: another save committed first; this save's files were removed"
            ) from exc
        self._collect_garbage(keep=set(files) | {manifest_name(save_id), METADATA})

    def _files_of_committed_saves(self, files: dict[str, int]) -> set[str]:
        """Files that manifests present before this save list: what a commit here replaces."""
        out: set[str] = set()
        for name in files:
            if _MANIFEST_FILE.match(name):
                try:
                    body = decode_manifest(name, self.store.read(name))
                except (CheckpointCorruptError, OSError):
                    continue
                out.add(name)
                out.update(body["files"])
        return out

    def _collect_garbage(self, keep: set[str]) -> None:
        """Delete what this commit replaced, and leftovers of saves that died over an hour ago.

        Never a recent file of another save: a concurrent save to this path may still be
        writing it, and deleting it would break that save's commit.
        """
        for name in self.store.list():
            if name in keep:
                continue
            if not (_DATA_FILE.match(name) or _MANIFEST_FILE.match(name) or _TMP_FILE.match(name)):
                continue  # not ours: never touch a user's file
            if name not in self._replaced and not self._older_than(name, STALE_AFTER_S):
                continue
            try:
                self.store.delete(name)
            except OSError as exc:  # garbage left behind is harmless; say so and go on
                log.warning("could not remove stale checkpoint file %s: %s", name, exc)

    def _older_than(self, name: str, seconds: float) -> bool:
        try:
            return time.time() - self.store.modified(name) > seconds
        except (OSError, NotImplementedError, AttributeError):
            return False

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=str(self.store.url) if self.store else None)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return isinstance(checkpoint_id, (str, os.PathLike))


# ---------------------------------------------------------------------------------------------
# the reader
# ---------------------------------------------------------------------------------------------
def _single_record_offset(data: bytes, nbytes: int) -> int | None:
    """Offset of the tensor bytes inside a ``torch.save`` payload holding exactly one storage
    of ``nbytes`` little-endian bytes, stored uncompressed; None for anything else."""
    if sys.byteorder != "little":
        return None
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            infos = archive.infolist()
            records = [i for i in infos if "/data/" in i.filename and not i.filename.endswith("/")]
            byteorder = [i for i in infos if i.filename.endswith("/byteorder")]
            if len(records) != 1 or records[0].compress_type != zipfile.ZIP_STORED:
                return None
            if byteorder and archive.read(byteorder[0]) != b"little":
                return None
            info = records[0]
    except (zipfile.BadZipFile, ValueError, KeyError):
        return None
    if info.file_size != nbytes:
        return None
    header = info.header_offset
    if header + 30 > len(data) or data[header:header + 4] != b"PK\x03\x04":
        return None
    name_len, extra_len = struct.unpack_from("<HH", data, header + 26)
    start = header + 30 + name_len + extra_len
    return start if start + nbytes <= len(data) else None


@dataclasses.dataclass
class CheckpointListing:
    """A committed checkpoint: its files, verified metadata and manifest; reads verified items."""

    store: Store
    files: dict[str, int]
    metadata: Metadata
    manifest: dict | None
    manifest_file: str | None

    def verify_item(self, name: str, info: _StorageInfo, data: bytes, fqn: str) -> None:
        if len(data) != info.length:
            raise CheckpointCorruptError(
                f"{self.store.url}/{name}: short read for {fqn} ({len(data)} of {info.length} bytes); "
                "the file is truncated"
            )
        if self.manifest is None:
            return
        expected = self.manifest["files"][name]["items"].get(str(info.offset))
        if expected is None or expected[1] != _crc(data):
            raise CheckpointCorruptError(
                f"checksum mismatch in {self.store.url}/{name} at offset {info.offset} ({fqn}): "
                "the data file is corrupted"
            )

    def read_item(self, index: MetadataIndex, stream: BinaryIO | None = None) -> bytes:
        """The verified bytes of one stored item (a ``torch.save`` payload or raw bytes)."""
        info = self.metadata.storage_data[index]
        name = checked_name(info.relative_path)
        with contextlib.ExitStack() as stack:
            if stream is None:
                stream = stack.enter_context(self.store.open_read(name))
            stream.seek(info.offset)
            data = stream.read(info.length)
        self.verify_item(name, info, data, index.fqn)
        return data

    def read_tensor(self, index: MetadataIndex, stream: BinaryIO | None = None) -> torch.Tensor:
        """One stored chunk as a tensor: a view over the verified bytes where the payload is
        the plain one-storage ``torch.save`` record dmuon writes, else ``torch.load``."""
        data = self.read_item(index, stream)
        view = self._view_of_record(index, data)
        if view is not None:
            return view
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)

    def _view_of_record(self, index: MetadataIndex, data: bytes) -> torch.Tensor | None:
        md = self.metadata.state_dict_metadata.get(index.fqn)
        if not isinstance(md, TensorStorageMetadata):
            return None
        offsets = tuple(index.offset or ())
        chunk = next((c for c in md.chunks if tuple(c.offsets) == offsets), None)
        if chunk is None:
            return None
        dtype = md.properties.dtype
        numel = math.prod(chunk.sizes)
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        start = _single_record_offset(data, nbytes)
        if start is None:
            return None
        if numel == 0:
            return torch.empty(tuple(chunk.sizes), dtype=dtype)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # read-only bytes: the view is only ever copied from
            flat = torch.frombuffer(data, dtype=dtype, count=numel, offset=start)
        return flat.view(tuple(chunk.sizes))

    def planner_info(self) -> dict:
        return (self.metadata.planner_data or {}).get(RESERVED_KEY, {})

    def verify_files(self, progress=None) -> list[str]:
        """Re-read every data file in full and compare sizes and CRCs with the manifest."""
        if self.manifest is None:
            return [f"{self.store.url}: no checksum manifest; nothing to verify against"]
        problems = []
        for name, stats in sorted(self.manifest["files"].items()):
            try:
                with self.store.open_read(checked_name(name)) as stream:
                    problem = _verify_stream(stream, stats, progress)
            except FileNotFoundError:
                problem = "missing"
            if problem:
                problems.append(f"{name}: {problem}")
        return problems


def _verify_stream(stream: BinaryIO, stats: dict, progress=None) -> str | None:
    """Read a data file once, checking its size and the CRC of every item (they tile the file).

    Manifests written before items alone covered the file also carry a whole-file ``crc32``;
    it is checked when present.
    """
    items = sorted((int(offset), length, crc) for offset, (length, crc) in stats["items"].items())
    end = 0
    for offset, length, _ in items:
        if offset != end:
            return f"manifest items leave bytes {end}..{offset} uncovered"
        end = offset + length
    if end != stats["size"]:
        return f"manifest items cover {end} bytes of {stats['size']}"
    pending = iter(items)
    current = next(pending, None)
    pos = crc = whole = size = 0
    bad_offsets = []
    while chunk := stream.read(8 << 20):
        view = memoryview(chunk)
        size += len(view)
        if "crc32" in stats:
            whole = zlib.crc32(view, whole)
        i = 0
        while current is not None:
            offset, length, expected = current
            take = min(len(view) - i, offset + length - pos)
            crc = zlib.crc32(view[i:i + take], crc)
            i += take
            pos += take
            if pos < offset + length:
                break  # the item continues in the next chunk
            if crc & 0xFFFFFFFF != expected:
                bad_offsets.append(offset)
            crc = 0
            current = next(pending, None)
        if progress is not None:
            progress(len(view))
    if size != stats["size"]:
        return f"{size} bytes, the manifest says {stats['size']} (truncated or extended)"
    if bad_offsets or ("crc32" in stats and whole & 0xFFFFFFFF != stats["crc32"]):
        where = f" in the item(s) at byte {', '.join(map(str, bad_offsets[:5]))}" if bad_offsets else ""
        return f"checksum mismatch (corrupted){where}"
    return None


def _problem_free_storage(listing_files: dict[str, int], metadata: Metadata, manifest: dict | None, where: str):
    """Every referenced file exists, is named safely, and holds the referenced byte ranges."""
    for index, info in metadata.storage_data.items():
        if not isinstance(info, _StorageInfo):
            raise CheckpointCorruptError(f"{where}: storage entry for {index.fqn} is not a file range")
        name = checked_name(info.relative_path)
        size = listing_files.get(name)
        if size is None:
            raise CheckpointCorruptError(f"{where}: data file {name} (holding {index.fqn}) is missing")
        if info.offset < 0 or info.length < 0 or info.offset + info.length > size:
            raise CheckpointCorruptError(
                f"{where}: {index.fqn} claims bytes {info.offset}..{info.offset + info.length} of {name}, "
                f"which has {size} bytes"
            )
        if manifest is not None:
            stats = manifest["files"].get(name)
            if stats is None:
                raise CheckpointCorruptError(f"{where}: data file {name} is not in the checksum manifest")
            if stats["size"] != size:
                raise CheckpointCorruptError(
                    f"{where}: data file {name} has {size} bytes, the manifest says {stats['size']} (truncated?)"
                )
            if stats["items"].get(str(info.offset), [None])[0] != info.length:
                raise CheckpointCorruptError(f"{where}: {index.fqn} in {name} does not match the manifest")


def open_checkpoint(checkpoint_id: str | os.PathLike, storage_options: dict | None = None,
                    store: Store | None = None) -> CheckpointListing:
    """List, verify and decode a checkpoint's metadata (no data file is read)."""
    store = store or open_store(checkpoint_id, storage_options)
    files = store.list()
    where = store.url
    if METADATA not in files:
        if not files and not store.is_dir():
            raise CheckpointNotFoundError(f"no checkpoint at {where}")
        raise CheckpointIncompleteError(
            f"{where} is incomplete: it has no .metadata (the save that wrote it did not finish); "
            "refusing to load it"
        )
    metadata_bytes = store.read(METADATA)
    manifests = sorted(name for name in files if _MANIFEST_FILE.match(name))
    manifest = manifest_file = None
    corrupt_manifest = None
    for name in manifests:
        try:
            body = decode_manifest(name, store.read(name))
        except CheckpointCorruptError as exc:
            corrupt_manifest = exc
            continue
        if body["metadata"] == {"size": len(metadata_bytes), "crc32": _crc(metadata_bytes)}:
            manifest, manifest_file = body, name
            break
    if manifests and manifest is None:
        if corrupt_manifest is not None and len(manifests) == 1:
            raise corrupt_manifest
        raise CheckpointCorruptError(
            f"{where}: .metadata does not match its checksum manifest ({', '.join(manifests)}): "
            ".metadata is corrupted"
        )
    if not manifests:
        log.warning("%s has no dmuon checksum manifest (not written by dmuon?): loading unverified", where)
    metadata = load_metadata_bytes(metadata_bytes, where)
    _problem_free_storage(files, metadata, manifest, where)
    return CheckpointListing(store, files, metadata, manifest, manifest_file)


class DMuonStorageReader(StorageReader):
    """DCP storage reader for local paths and fsspec URLs; verifies as it reads."""

    def __init__(self, checkpoint_id: str | os.PathLike | None = None, *,
                 storage_options: dict | None = None, listing: CheckpointListing | None = None) -> None:
        """``listing``: an already opened and verified checkpoint, to skip reading it again."""
        super().__init__()
        self.storage_options = storage_options
        self.listing = listing
        if checkpoint_id is not None:
            self.checkpoint_id = checkpoint_id

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id is not None and checkpoint_id != getattr(self, "checkpoint_id", None):
            self.checkpoint_id = checkpoint_id
            self.listing = None

    def read_metadata(self) -> Metadata:
        # No **kwargs on purpose: torch then never falls back to per-rank metadata files.
        if self.listing is None:
            self.listing = open_checkpoint(self.checkpoint_id, self.storage_options)
        return self.listing.metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if self.listing is None:
            self.read_metadata()
        self.storage_data = metadata.storage_data

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        per_file: dict[str, dict[MetadataIndex, list]] = defaultdict(lambda: defaultdict(list))
        for req in plan.items:
            info: _StorageInfo = self.storage_data[req.storage_index]
            per_file[info.relative_path][req.storage_index].append(req)
        store = self.listing.store
        for name, by_index in per_file.items():
            ordered = sorted(by_index.items(), key=lambda kv: self.storage_data[kv[0]].offset)

            def read_file(name=name, ordered=ordered):  # redelivering an item is harmless
                with store.open_read(checked_name(name)) as stream:
                    for index, reqs in ordered:
                        self._deliver(planner, reqs, index, stream)

            retrying(store, f"reading {name}", read_file)
        future: Future = Future()
        future.set_result(None)
        return future

    def _deliver(self, planner: LoadPlanner, reqs: list, index: MetadataIndex, stream: BinaryIO) -> None:
        if reqs[0].type == LoadItemType.BYTE_IO:
            data = self.listing.read_item(index, stream)
            for req in reqs:
                planner.load_bytes(req, io.BytesIO(data))
            return
        saved = self.listing.read_tensor(index, stream)
        for req in reqs:
            piece = narrow_tensor_by_index(saved, req.storage_offsets, req.lengths)
            target = planner.resolve_tensor(req).detach()
            if target.size() != piece.size():
                raise CheckpointCorruptError(
                    f"{req.storage_index.fqn}: stored chunk has shape {tuple(piece.size())}, "
                    f"expected {tuple(target.size())}"
                )
            target.copy_(piece)
            planner.commit_tensor(req, target)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return isinstance(checkpoint_id, (str, os.PathLike))
