"""What the scale simulator puts in place of the bytes: writers whose write returns what a real
write of the plan would (each item's file, offset and length; dmuon's file stats and trailer
size), readers that read nothing; everything else of them (planning, naming, the commit of
``.metadata`` and the manifest into ``scale_sim_store.SimStore``) is the real class's.

:class:`DmuonWriter` and :class:`DmuonReader` stand for dmuon's ``DMuonStorageWriter`` and
``DMuonStorageReader``, :class:`TorchWriter` and :class:`TorchReader` for torch's
``FileSystemWriter`` and ``FileSystemReader``. What a write returns mirrors ``writer.py`` and
torch's ``FileSystemWriter`` (:func:`dmuon_results`, :func:`torch_results`).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadPlan, SavePlan, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from dmuon import compat
from dmuon.dcp.cooperative import share_of
from dmuon.dcp.format.checksums import WRITE_CHECKSUM
from dmuon.dcp.format.file_sums import encode_file_sums
from dmuon.dcp.format.manifest import FileStats, ItemChecksums, block_size_for
from dmuon.dcp.reader import DMuonStorageReader
from dmuon.dcp.writer import FILE_STATS_KEY, DMuonStorageWriter, write_order

# bytes around a tensor's data in a data file (torch.save framing); and a pickled object's size
TENSOR_HEAD, TENSOR_TAIL, OBJECT_BYTES = 128, 30, 400


# ---------------------------------------------------------------------------------------------
# what a rank's write would return
# ---------------------------------------------------------------------------------------------
def _item_bytes(item) -> int:
    if item.type == WriteItemType.BYTE_IO:
        return OBJECT_BYTES
    sizes = item.tensor_data.chunk.sizes
    return int(torch.Size(sizes).numel()) * item.tensor_data.properties.dtype.itemsize


def dmuon_results(rank: int, plan: SavePlan) -> list[WriteResult]:
    """What ``DMuonStorageWriter.write_data`` returns for ``plan`` (manifest version 4): one
    result per item (its file, offset, length) and one ``FILE_STATS_KEY`` result with the
    file's ``FileStats(size, None, sums_at=...)``; the items' checksums go into the file's
    trailer (``format/file_sums.py``, built here with random 64-bit values for its size), not
    to the coordinator."""
    rng = random.Random(rank)
    name = plan.storage_data["file"]
    results, checksums, offset = [], {}, 0
    items = sorted(plan.items, key=write_order)
    for item in items:
        data = _item_bytes(item)
        if item.type == WriteItemType.BYTE_IO:
            stats = ItemChecksums.whole(data, rng.getrandbits(64))
        else:
            block = block_size_for(data)
            count = 2 + -(-data // block)
            stats = ItemChecksums(TENSOR_HEAD + data + TENSOR_TAIL, TENSOR_HEAD, block, TENSOR_TAIL,
                                  [rng.getrandbits(64) for _ in range(count)])
        checksums[offset] = stats
        results.append(WriteResult(index=item.index, size_in_bytes=stats.length,
                                   storage_data=compat.StorageInfo(name, offset, stats.length)))
        offset += stats.length
    if plan.items:
        trailer = encode_file_sums(plan.storage_data["save_id"], name, WRITE_CHECKSUM, checksums)
        results.append(WriteResult(index=MetadataIndex(f"{FILE_STATS_KEY}{name}"), size_in_bytes=0,
                                   storage_data=(name, FileStats(offset + len(trailer), None, sums_at=offset))))
    return results


def torch_results(plan: SavePlan) -> list[WriteResult]:
    """What torch's ``FileSystemWriter.write_data`` returns: one file per rank (its default)."""
    name = f"{plan.storage_data.prefix}0.distcp"
    results, offset = [], 0
    for item in plan.items:
        length = _item_bytes(item) + (0 if item.type == WriteItemType.BYTE_IO else 1100)
        results.append(WriteResult(index=item.index, size_in_bytes=length,
                                   storage_data=compat.StorageInfo(name, offset, length)))
        offset += length
    return results




def _done(value: Any) -> Future:
    future: Future = Future()
    future.set_result(value)
    return future


class DmuonWriter(DMuonStorageWriter):
    """dmuon's writer, its write replaced by the results it would return."""

    def write_data(self, plan: SavePlan, planner: Any) -> Future:
        self.save_id = plan.storage_data["save_id"]
        return _done(dmuon_results(self.rank, plan) if plan.items else [])


def files_of(plan: LoadPlan, storage_data: Any) -> int:
    """How many data files this rank reads for ``plan`` (the items it does not receive from
    another rank in a cooperative load): on object storage, a rank's load makes a few
    requests per file it reads (the file's checksum trailer, its items' ranges)."""
    share = share_of(plan)
    received = share.receives if share is not None else {}
    return len({storage_data[item.storage_index].relative_path
                for position, item in enumerate(plan.items) if position not in received})


class DmuonReader(DMuonStorageReader):
    """dmuon's reader, reading nothing. Where the plan gives this rank a part in a cooperative
    load, the one round that adds before its point-to-point exchange (every rank's reads agreed:
    ``cooperative.read_shared``) is made over the load's transport, or its replica group's; the exchange moves tensor
    bytes between pairs of ranks, not coordination, and is not simulated. ``files_read``: each
    rank's count of the data files its plan reads, appended."""

    def __init__(self, *args: Any, files_read: list[int], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.files_read = files_read

    def read_data(self, plan: LoadPlan, planner: Any) -> Future:
        self.files_read.append(files_of(plan, self.storage_data))
        share = share_of(plan)
        if share is not None:
            transport = share.replicas or self.transport  # (a replica group's, as the real reader)
            assert transport is not None
            transport.settle(None, "reading (cooperative load: nothing was exchanged)")
        return _done(None)


class TorchWriter(FileSystemWriter):
    """torch's ``FileSystemWriter``, its write replaced by the results it would return."""

    def write_data(self, plan: SavePlan, planner: Any) -> Future:
        return _done(torch_results(plan))


class TorchReader(FileSystemReader):
    """torch's ``FileSystemReader``, reading no data. Every rank reads and unpickles
    ``.metadata`` itself, as torch's does: here the first rank does, and the others share its
    copy (``shared``, one per load), each charged the seconds it took (``charge``): what it
    costs each of them, without N copies of it in this process's memory."""

    def __init__(self, path: str, shared: dict, charge: Callable[[float], None], files_read: list[int]) -> None:
        super().__init__(path)
        self.shared, self.charge, self.files_read = shared, charge, files_read

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        if "metadata" in self.shared:
            self.charge(self.shared["seconds"])
            return self.shared["metadata"]
        began = time.process_time()
        self.shared["metadata"] = super().read_metadata(*args, **kwargs)
        self.shared["seconds"] = time.process_time() - began
        return self.shared["metadata"]

    def read_data(self, plan: LoadPlan, planner: Any) -> Future:
        self.files_read.append(files_of(plan, self.storage_data))
        return _done(None)
