"""``DMuonStorageWriter``: DCP's storage writer over any store, with checksums and a safe commit.

Each rank streams its items into one data file, computing a checksum per item as the bytes go
out (items tile the file, so every byte is checksummed once, with no second read), and ends the
file with those checksums (its trailer, ``format/file_sums.py``): they never travel to another
rank. Tensors are
written in ``torch.save``'s format by ``torch_file.py``, straight from their memory. The
coordinator then commits (``commit.py``): manifest, then ``.metadata``. Knows nothing of models.
"""

from __future__ import annotations

import dataclasses
import io
import os
import pickle
import secrets
from typing import Any, BinaryIO

import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from .. import compat
from ..topology import current_rank
from .commit import commit, files_of_committed_saves
from .errors import CheckpointExistsError
from .format.checksums import CHECKSUMS, HOT_SLICE, WRITE_CHECKSUM, checksum_of
from .format.file_sums import encode_file_sums
from .format.layout import MAX_KEY_PREFIXES, METADATA, data_file_name
from .format.manifest import FileStats, ItemChecksums, Manifest, block_size_for
from .format.sharding_index import encode_index
from .format.tensor_bytes import SLICE
from .format.torch_file import TensorFrames, write_tensor_payload
from .format.torch_zip import Placement
from .host_staging import HostStaging
from .rank_failure import Phases
from .save_planner import read_by_every_rank
from .storage.base import BorrowingStream, Store
from .storage.local import LocalStore
from .storage.registry import open_store
from .storage.retry import retrying

__all__ = ["FILE_STATS_KEY", "DMuonStorageWriter", "new_save_id", "plan_storage_data", "split_write_results"]

#: The key of the write result that carries a data file's size and trailer offset to the
#: coordinator (not a state-dict key: the prefix cannot come out of DCP's flattening).
FILE_STATS_KEY = "__dmuon_file_stats__"


def new_save_id() -> str:
    """A save's random id: 16 hex digits of 62 random bits (a first save's files are named with
    it; the number fits the signed 64-bit integer a save's all-reduce carries it in)."""
    return f"{secrets.randbits(62):016x}"


def plan_storage_data(rank: int, save_id: str, key_prefixes: int = 0, file: str | None = None) -> dict[str, str]:
    """What a rank's final save plan tells this writer: the save, and the rank's data file
    (``file``: a name the rank wrote before, which a steady save keeps; else one of this save's
    id)."""
    return {"save_id": save_id, "file": file or data_file_name(rank, save_id, key_prefixes)}


def split_write_results(results) -> tuple[dict[MetadataIndex, Any], dict[str, FileStats]]:
    """Write results as the commit needs them: where each item lies, and each data file."""
    storage_data: dict[MetadataIndex, Any] = {}
    files: dict[str, FileStats] = {}
    for result in results:
        if result.index.fqn.startswith(FILE_STATS_KEY):
            name, stats = result.storage_data
            files[name] = stats
        else:
            storage_data[result.index] = result.storage_data
    return storage_data, files


def write_order(item: WriteItem) -> int:
    """Where an item goes in its file: objects first, then the small whole tensors, then the
    rest in plan order. The first two are what every rank reads at a load
    (``save_planner.read_by_every_rank``; dmuon's planner has one rank write them all):
    together at the head of the file, they are one ranged read on object storage, not one
    per item."""
    if item.type == WriteItemType.BYTE_IO:
        return 0
    return 1 if read_by_every_rank(item) else 2


class _ChecksummingStream:
    """Forwards writes, counting bytes and checksumming them in segments (``cut()`` ends one).

    Over a :class:`~.storage.base.BorrowingStream` (direct I/O to a local disk), tensor bytes are
    handed over without a copy: ``placement`` says where to put a tensor so that its bytes in
    the file line up with its memory, and ``write_blocks`` lends them.
    """

    def __init__(self, raw: BinaryIO, kind: str) -> None:
        self.raw = raw
        self.kind = CHECKSUMS[kind]
        self.pos = 0
        self._digest = self.kind.new()
        self._segment_start = 0
        self.checksums: list[int] = []  # of the non-empty segments cut so far
        self._borrowing = raw if isinstance(raw, BorrowingStream) else None
        self._lend = self._borrowing.write_borrowed if self._borrowing is not None else raw.write

    def placement(self, tensor: torch.Tensor) -> Placement | None:
        """Where, relative to the current position, the bytes of ``tensor`` should start so
        the stream can write them from its memory; None where it cannot or it is not worth it."""
        raw = self._borrowing
        if raw is None or tensor.numel() * tensor.element_size() < raw.borrow_min_bytes:
            return None
        modulus = raw.memory_alignment
        return modulus, (tensor.data_ptr() - self.pos) % modulus

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        self.raw.write(view)
        self._digest.update(view)
        self.pos += view.nbytes
        return view.nbytes

    def write_blocks(self, view: memoryview, block: int, lend: bool = True) -> None:
        """Write ``view`` with one segment (checksum) per ``block`` bytes of it: the checksum
        granularity a partial read needs. A stream that copies (page cache, upload buffers)
        gets slices of :data:`HOT_SLICE`, each checksummed right after its copy, from the CPU
        cache; a borrowing one gets large slices it can write in place, unless ``lend`` is
        False (the memory is reused right after this call: a staging buffer)."""
        self.cut()
        borrowing = self._borrowing is not None and lend
        step = max((SLICE if borrowing else HOT_SLICE) // block, 1) * block
        write = self._lend if borrowing else self.raw.write
        of = self.kind.of
        for start in range(0, view.nbytes, step):
            piece = view[start : start + step]
            write(piece)  # (a device may start on it while it is checksummed)
            self.checksums += [of(piece[offset : offset + block]) for offset in range(0, piece.nbytes, block)]
            self.pos += piece.nbytes
        self._segment_start = self.pos

    def cut(self) -> None:
        if self.pos > self._segment_start:
            self.checksums.append(self._digest.intdigest())
            self._digest = self.kind.new()
        self._segment_start = self.pos

    def flush(self) -> None:
        self.raw.flush()

    def tell(self) -> int:
        return self.pos


def _write_item(stream: _ChecksummingStream, data, frames: TensorFrames, lend: bool = True) -> ItemChecksums:
    """One item at the stream's position; its segments' checksums, as the manifest keeps them.
    ``frames``: the zip framing already built for the tensors of this file. ``lend=False``:
    the tensor's memory is reused after this call, so it is never written from in place."""
    start, first = stream.tell(), len(stream.checksums)
    if isinstance(data, io.BytesIO):
        stream.write(data.getbuffer())
        stream.cut()
        return ItemChecksums(stream.tell() - start, stream.tell() - start, 0, 0, stream.checksums[first:])
    tensor = _cpu_contiguous(data)
    block = block_size_for(tensor.numel() * tensor.element_size())
    marks: list[int] = []

    def write_data(view: memoryview) -> None:
        stream.cut()
        marks.append(stream.tell())
        stream.write_blocks(view, block, lend)
        marks.append(stream.tell())

    place = stream.placement(tensor) if lend else None
    write_tensor_payload(stream, tensor, write_data=write_data, frames=frames, place=place)
    stream.cut()
    end = stream.tell()
    return ItemChecksums(end - start, marks[0] - start, block, end - marks[-1], stream.checksums[first:])


def _cpu_contiguous(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's values in CPU memory, contiguous (no copy when it already is)."""
    tensor = tensor.detach()
    if tensor.device.type != "cpu":
        tensor = tensor.cpu()
    return tensor.contiguous()


class DMuonStorageWriter(StorageWriter):
    """DCP storage writer for local paths and fsspec URLs with checksums and a safe commit.

    ``overwrite=False`` refuses a path that holds a committed checkpoint; ``True`` replaces it
    atomically at commit. ``key_prefixes``: spread the data files' names over that many
    leading hex prefixes (object storage at many writers; ``format.layout.data_file_name``).
    ``sync_files`` defaults to fsync on local disks, never on object stores. ``in_background``:
    the save runs behind training (an async save), so a local path writes the way that costs
    training the least CPU (``storage/write_path.py``). Accelerator
    tensors reach the file through :class:`~.host_staging.HostStaging`
    (a few reusable pinned buffers, each copy overlapped with the write of the item before).
    """

    #: Run CPU tensors through the staging buffers too (tests of the accelerator path on CPU).
    stage_host_tensors = False

    def __init__(
        self,
        checkpoint_id: str | os.PathLike | None = None,
        *,
        storage_options: dict | None = None,
        overwrite: bool = False,
        sync_files: bool | None = None,
        key_prefixes: int = 0,
        in_background: bool = False,
    ) -> None:
        super().__init__()
        self.in_background = in_background
        if not 0 <= key_prefixes <= MAX_KEY_PREFIXES:
            raise ValueError(f"key_prefixes must be between 0 (off) and {MAX_KEY_PREFIXES}, got {key_prefixes}")
        self.key_prefixes = key_prefixes
        compat.require_all("StorageInfo", "CURRENT_DCP_VERSION", "rebuild_tensor", "storage_type_names")
        self.storage_options = storage_options
        self.overwrite = overwrite
        self.sync_files = sync_files
        self.store: Store | None = None
        self.save_id: str | None = None
        self.phases: Phases | None = None  # told where this rank is (rank_failure.py)
        if checkpoint_id is not None:
            self.reset(checkpoint_id)

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id is not None:
            self.checkpoint_id = checkpoint_id
            self.store = open_store(checkpoint_id, self.storage_options, self.sync_files)
            if isinstance(self.store, LocalStore):
                self.store.in_background = self.in_background
        self.save_id = None

    def _store(self) -> Store:
        if self.store is None:
            raise ValueError("DMuonStorageWriter needs a checkpoint_id")
        return self.store

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        store = self._store()
        self.is_coordinator = is_coordinator
        self.rank = kwargs.get("rank", current_rank())
        self._replaced: set[str] = set()
        self.existing: set[str] = set()  # (coordinator) the directory's files before this save
        if is_coordinator:
            store.makedirs()
            files = store.list()
            self.existing = set(files)
            self._replaced = files_of_committed_saves(store, files)
            if not self.overwrite and METADATA in files:
                raise CheckpointExistsError(
                    f"{store.url} already holds a committed checkpoint; pass overwrite=True to "
                    "replace it (the old one stays readable until the new one commits)"
                )

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        save_id = new_save_id()
        return [
            dataclasses.replace(plan, storage_data=plan_storage_data(rank, save_id, self.key_prefixes))
            for rank, plan in enumerate(plans)
        ]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        info = plan.storage_data
        self.save_id = info["save_id"]
        if self.phases is not None:
            self.phases.enter("writing its data file")
        results: list[WriteResult] = []
        if plan.items:
            name = info["file"]
            store = self._store()
            with torch.no_grad():  # (as in the reader: resolving a DTensor shard needs no autograd)
                results = retrying(
                    store, f"writing {name}", lambda: self._write_file(name, plan.items, planner), writing=True
                )
        if self.phases is not None:
            self.phases.enter("waiting for the other ranks' writes and the commit (its own bytes were written)")
        future: Future = Future()
        future.set_result(results)
        return future

    def _write_file(self, name: str, items, planner: SavePlanner) -> list[WriteResult]:
        """One rank's data file, start to end (so a failed attempt can simply be redone)."""
        results = []
        checksums: dict[int, ItemChecksums] = {}
        frames = TensorFrames()
        items = sorted(items, key=write_order)
        staging: HostStaging = HostStaging(stage_host_tensors=self.stage_host_tensors)
        with self._store().open_write(name) as raw:
            stream = _ChecksummingStream(raw, WRITE_CHECKSUM)
            for item, staged in staging.items((item, planner.resolve_data(item)) for item in items):
                offset = stream.tell()
                checksums[offset] = _write_item(stream, staged.data, frames, lend=not staged.reused)
                length = checksums[offset].length
                results.append(
                    WriteResult(
                        index=item.index, size_in_bytes=length, storage_data=compat.StorageInfo(name, offset, length)
                    )
                )
            sums_at = stream.tell()  # the checksums stay with the file (file_sums.py)
            stream.write(encode_file_sums(self._save_id(), name, WRITE_CHECKSUM, checksums))
        results.append(
            WriteResult(
                index=MetadataIndex(f"{FILE_STATS_KEY}{name}"),
                size_in_bytes=0,
                storage_data=(name, FileStats(stream.tell(), None, sums_at=sums_at)),
            )
        )
        return results

    def _save_id(self) -> str:
        if self.save_id is None:
            raise RuntimeError("write_data before the save's plan named it")
        return self.save_id

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        storage_data, files = split_write_results(r for rank_results in results for r in rank_results)
        self.commit_save(metadata, storage_data, files)

    def commit_save(
        self, metadata: Metadata, storage_data: dict, files: dict[str, FileStats]
    ) -> tuple[bytes, bytes | None]:
        """Coordinator: write the manifest and ``.metadata`` of this save, whose items lie
        where ``storage_data`` says, in ``files`` (``commit.py``); the ``.metadata`` bytes and
        the sharding index."""
        metadata.version = compat.CURRENT_DCP_VERSION  # what torch's own writers record
        metadata.storage_data = storage_data
        # no URL and no save id (the manifest has it): the bytes stay those of every later save
        # of this layout (plan_cache.Committed); torch's readers fill in a StorageMeta of their own
        metadata.storage_meta = None
        metadata_bytes = pickle.dumps(metadata, protocol=pickle.HIGHEST_PROTOCOL)
        index = encode_index(metadata)
        self.commit_bytes(metadata_bytes, files, index)
        return metadata_bytes, index

    def commit_bytes(self, metadata_bytes: bytes, files: dict[str, FileStats], index: bytes | None = None) -> None:
        """Coordinator: :meth:`commit_save` of a ``.metadata`` already pickled (and its
        sharding index)."""
        if self.phases is not None:
            self.phases.enter("committing")
        checksum = checksum_of(WRITE_CHECKSUM, metadata_bytes)
        manifest = Manifest(self._commit_id(), WRITE_CHECKSUM, len(metadata_bytes), checksum, files, index=index)
        commit(self._store(), manifest, metadata_bytes, overwrite=self.overwrite, replaced=self._replaced)

    def _commit_id(self) -> str:
        if self.save_id is None:  # (a coordinator that wrote nothing and was told nothing)
            self.save_id = new_save_id()
        return self.save_id

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=str(self.store.url) if self.store else None)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return isinstance(checkpoint_id, (str, os.PathLike))
