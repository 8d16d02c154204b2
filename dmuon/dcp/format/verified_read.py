"""Reading a committed checkpoint's data files, every byte checked against the manifest.

:class:`VerifiedReads` reads single items (a ``torch.save`` payload or raw bytes) and checks
each against its checksums before returning it; for a tensor item whose manifest entry has a
block layout (manifest version 2 and later) it reads just a range of the tensor's data straight into the
caller's memory, verifying each checksum block the range touches while it is in the CPU cache
(:meth:`VerifiedReads.read_data_into`), and the zip frame around the data
(:meth:`VerifiedReads.verify_frame`). :meth:`VerifiedReads.verify_files` re-reads whole files.

Checkpoints without a manifest (written by torch's own writer) are read unverified: there is
nothing to check them against.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
from collections.abc import Callable, Mapping
from typing import Any, BinaryIO

import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata

from ..errors import CheckpointCorruptError
from ..storage.base import ReadAheadStream, Store, checked_name
from .checksums import CHECKSUMS, HOT_SLICE, checksum_of
from .file_sums import read_file_sums
from .manifest import V1_CHECKSUM, FileStats, ItemChecksums, Manifest
from .sharding_index import chunk_at
from .torch_file import tensor_from_payload

__all__ = ["VerifiedReads", "verify_stream"]

_VERIFY_BLOCK = 8 << 20


@dataclasses.dataclass
class VerifiedReads:
    """The data files of one committed checkpoint, read verified; counts what it read."""

    store: Store
    metadata: Metadata
    manifest: Manifest | None
    bytes_read: int = 0  # data bytes read so far (checksummed, every one)

    def verify_item(self, name: str, info: Any, data: bytes, fqn: str) -> None:
        if len(data) != info.length:
            raise CheckpointCorruptError(
                f"{self.store.url}/{name}: short read for {fqn} ({len(data)} of {info.length} bytes); "
                "the file is truncated"
            )
        if self.manifest is None:
            return
        item = self.file_items(name).get(info.offset)
        view = memoryview(data)
        if (
            item is None
            or item.length != info.length
            or any(
                checksum_of(self.manifest.checksum, view[start : start + length]) != expected
                for (start, length), expected in zip(item.segments(), item.checksums)
            )
        ):
            self._raise_mismatch(info, fqn)

    def file_items(self, name: str, stream: BinaryIO | None = None) -> Mapping[int, ItemChecksums]:
        """The checksummed items of data file ``name``; from its trailer (manifest version 4),
        read the first time they are asked for, through ``stream`` when given (a reader's
        open stream over the file: no second connection); two threads may both read it."""
        assert self.manifest is not None
        stats = self.manifest.files[name]
        if stats.items is None:
            with contextlib.ExitStack() as stack:
                if stream is None:
                    stream = stack.enter_context(self.store.open_read(checked_name(name), stats.size))
                if isinstance(stream, ReadAheadStream) and stats.sums_at is not None:
                    # (told, a read-ahead stream fetches just the trailer, not blocks around it)
                    stream.will_need(stats.sums_at, stats.size - stats.sums_at)
                stats.items = read_file_sums(stream, name, stats, self.manifest.checksum, self.manifest.save_id)
        return stats.items

    def read_item(self, index: MetadataIndex, stream: BinaryIO | None = None) -> bytes:
        """The verified bytes of one stored item (a ``torch.save`` payload or raw bytes)."""
        info = self.metadata.storage_data[index]
        name = checked_name(info.relative_path)
        with contextlib.ExitStack() as stack:
            if stream is None:
                stream = stack.enter_context(self.store.open_read(name))
            stream.seek(info.offset)
            data = stream.read(info.length)
        self.bytes_read += len(data)
        self.verify_item(name, info, data, index.fqn)
        return data

    def data_blocks(self, index: MetadataIndex) -> ItemChecksums | None:
        """The block layout of a tensor item's bytes, when the manifest has one (version 2 and later)."""
        if self.manifest is None:
            return None
        info = self.metadata.storage_data[index]
        item = self.file_items(info.relative_path).get(info.offset)
        if item is not None and item.length != info.length:
            raise CheckpointCorruptError(
                f"{self.store.url}/{info.relative_path}: {index.fqn} does not match its file's checksums"
            )
        return item if item is not None and item.block > 0 else None

    def verify_frame(
        self, index: MetadataIndex, stream: BinaryIO, item: ItemChecksums, *, head: bool = True, tail: bool = True
    ) -> None:
        """Read and verify a tensor item's bytes around its data (the zip headers before it,
        the central directory after it): a flipped byte anywhere in an item a load touches
        is reported, even where the load itself would not use it. A few hundred bytes.
        ``item``: the item's block layout (:meth:`data_blocks`). ``head``/``tail``: which of
        the two (a load checks the tail after the data, so that it reads the file in order)."""
        info = self.metadata.storage_data[index]
        assert self.manifest is not None
        fd = _local_file_descriptor(stream)
        parts = [(0, item.head, item.checksums[0])] if item.head and head else []
        if item.tail and tail:
            parts.append((item.length - item.tail, item.tail, item.checksums[-1]))
        for start, length, expected in parts:
            buffer = bytearray(length)
            _read_exactly(stream, fd, info.offset + start, memoryview(buffer), index.fqn)
            self.bytes_read += length
            if checksum_of(self.manifest.checksum, buffer) != expected:
                self._raise_mismatch(info, index.fqn)

    def read_data_into(
        self, index: MetadataIndex, stream: BinaryIO, start: int, out: memoryview, item: ItemChecksums
    ) -> None:
        """Bytes ``[start, start + len(out))`` of a tensor item's data, straight into ``out``.

        Reads only the checksum blocks the range touches and verifies each of them: whole
        blocks land in ``out`` directly, the partial ones at either end go through a small
        buffer. ``item``: the item's block layout (:meth:`data_blocks`).
        """
        info = self.metadata.storage_data[index]
        assert self.manifest is not None
        fd = _local_file_descriptor(stream)
        of = CHECKSUMS[self.manifest.checksum].of
        data_start = info.offset + item.head
        data_len = item.length - item.head - item.tail
        stop = start + out.nbytes
        if start < 0 or stop > data_len:
            raise CheckpointCorruptError(f"{index.fqn}: bytes {start}..{stop} requested of {data_len}")
        if stop == start:
            return
        first_checksum = 1 if item.head else 0
        block = item.block

        def whole(k: int) -> bool:  # block k lies entirely inside the range
            return k * block >= start and min((k + 1) * block, data_len) <= stop

        first, last = start // block, (stop - 1) // block
        lo = first if whole(first) else first + 1
        hi = last if whole(last) else last - 1
        if lo <= hi:  # whole blocks: straight into ``out``
            r_start, r_stop = lo * block, min((hi + 1) * block, data_len)
            expected = item.checksums[first_checksum + lo : first_checksum + hi + 1]
            whole_blocks = out[r_start - start : r_stop - start]
            if not _read_checked(stream, fd, data_start + r_start, whole_blocks, block, of, expected, index.fqn):
                self._raise_mismatch(info, index.fqn)
            self.bytes_read += r_stop - r_start
        for k in sorted({first, last} - set(range(lo, hi + 1))):  # blocks the range only partly covers
            b_start, b_stop = k * block, min((k + 1) * block, data_len)
            buffer = bytearray(b_stop - b_start)
            _read_exactly(stream, fd, data_start + b_start, memoryview(buffer), index.fqn)
            self.bytes_read += b_stop - b_start
            if of(buffer) != item.checksums[first_checksum + k]:
                self._raise_mismatch(info, index.fqn)
            lo_byte, hi_byte = max(start, b_start), min(stop, b_stop)
            out[lo_byte - start : hi_byte - start] = memoryview(buffer)[lo_byte - b_start : hi_byte - b_start]

    def _raise_mismatch(self, info: Any, fqn: str) -> None:
        raise CheckpointCorruptError(
            f"checksum mismatch in {self.store.url}/{info.relative_path} in the item at offset "
            f"{info.offset} ({fqn}): the data file is corrupted"
        )

    def read_tensor(self, index: MetadataIndex, stream: BinaryIO | None = None) -> torch.Tensor:
        """One stored chunk as a tensor (a view over the verified bytes where possible)."""
        data = self.read_item(index, stream)
        md = self.metadata.state_dict_metadata.get(index.fqn)
        if isinstance(md, TensorStorageMetadata):
            chunk = chunk_at(md, index.offset or ())
            if chunk is not None:
                return tensor_from_payload(data, tuple(chunk.sizes), md.properties.dtype)
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)

    def verify_files(self, progress: Callable[[int], Any] | None = None) -> list[str]:
        """Re-read every data file in full and compare sizes and checksums with the manifest."""
        if self.manifest is None:
            return [f"{self.store.url}: no checksum manifest; nothing to verify against"]
        problems = []
        for name, stats in sorted(self.manifest.files.items()):
            try:
                with self.store.open_read(checked_name(name)) as stream:
                    problem = verify_stream(
                        stream, name, stats, self.manifest.checksum, progress, self.manifest.save_id
                    )
            except FileNotFoundError:
                problem = "missing"
            except CheckpointCorruptError as exc:  # its trailer
                problem = str(exc)
            if problem:
                problems.append(f"{name}: {problem}")
        return problems


def verify_stream(
    stream: BinaryIO,
    name: str,
    stats: FileStats,
    kind: str,
    progress: Callable[[int], Any] | None = None,
    save_id: str = "",
) -> str | None:
    """What is wrong with data file ``name`` read from ``stream`` (None: nothing). Reads it once,
    checking its size and the checksum of every segment of every item (they tile the file up
    to its trailer, if any), and the whole-file CRC-32 that the oldest manifests carry. A file
    whose checksums are in its trailer (``save_id`` given) needs a seekable ``stream``: the
    trailer is read first."""
    items = stats.items
    covered = stats.size
    if stats.sums_at is not None:
        covered = stats.sums_at
        if items is None:
            items = read_file_sums(stream, name, stats, kind, save_id)
            stream.seek(0)
    segments = []
    end = 0
    for offset, item in sorted((items or {}).items()):
        if offset != end:
            return f"manifest items leave bytes {end}..{offset} uncovered"
        segments += [
            (offset + start, length, expected, offset)
            for (start, length), expected in zip(item.segments(), item.checksums)
        ]
        end = offset + item.length
    if end != covered:
        return f"manifest items cover {end} bytes of {covered}"
    segment_kind, whole_file = CHECKSUMS[kind], CHECKSUMS[V1_CHECKSUM].new()
    digest = segment_kind.new()
    pending = iter(segments)
    current = next(pending, None)
    pos = size = 0
    bad_offsets: list[int] = []
    while chunk := stream.read(_VERIFY_BLOCK):
        view = memoryview(chunk)
        size += len(view)
        if stats.whole_file is not None:
            whole_file.update(view)
        i = 0
        while current is not None:
            offset, length, expected, item_offset = current
            take = min(len(view) - i, offset + length - pos)
            digest.update(view[i : i + take])
            i += take
            pos += take
            if pos < offset + length:
                break  # the segment continues in the next chunk
            if digest.intdigest() != expected and item_offset not in bad_offsets:
                bad_offsets.append(item_offset)
            digest = segment_kind.new()
            current = next(pending, None)
        if progress is not None:
            progress(len(view))
    if size != stats.size:
        return f"{size} bytes, the manifest says {stats.size} (truncated or extended)"
    if bad_offsets or (stats.whole_file is not None and whole_file.intdigest() != stats.whole_file):
        where = f" in the item(s) at byte {', '.join(map(str, bad_offsets[:5]))}" if bad_offsets else ""
        return f"checksum mismatch (corrupted){where}"
    return None


def _read_checked(
    stream: BinaryIO,
    fd: int | None,
    offset: int,
    out: memoryview,
    block: int,
    of: Callable[..., int],
    expected: list[int],
    fqn: str,
) -> bool:
    """Fill ``out`` from ``offset`` on, :data:`HOT_SLICE` at a time, and compare the checksums
    of each slice's ``block``-sized pieces with ``expected`` as soon as the slice lands, while
    it is in the CPU cache; False at the first mismatch (the rest is not read)."""
    step = max(HOT_SLICE // block, 1) * block
    in_slice = range(0, step, block)
    checked = 0  # blocks compared so far
    for at in range(0, out.nbytes, step):
        target = out[at : at + step]
        _read_exactly(stream, fd, offset + at, target, fqn)
        blocks = in_slice if target.nbytes == step else range(0, target.nbytes, block)
        got = [of(target[start : start + block]) for start in blocks]
        if got != expected[checked : checked + len(got)]:
            return False
        checked += len(got)
    return True


def _read_exactly(stream: BinaryIO, fd: int | None, offset: int, out: memoryview, fqn: str) -> None:
    """``out`` filled from ``offset``: positional reads on ``fd`` where the stream has one
    (:func:`_local_file_descriptor`), else a seek and reads."""
    if fd is None:
        stream.seek(offset)
    done = 0
    while done < out.nbytes:
        if fd is None:
            got = stream.readinto(out[done:])  # type: ignore[attr-defined]
        else:  # one positional read instead of a seek and a read, thousands of times per load
            got = os.preadv(fd, [out[done:]], offset + done)
        if not got:
            raise CheckpointCorruptError(f"short read for {fqn}: the data file is truncated")
        done += got


def _local_file_descriptor(stream: BinaryIO) -> int | None:
    """The descriptor of a local file opened by ``open()``, which positional reads may use
    without disturbing the stream (they do not move its position); None for other streams."""
    raw = getattr(stream, "raw", stream)
    return raw.fileno() if isinstance(raw, io.FileIO) and isinstance(stream, (io.BufferedReader, io.FileIO)) else None
