"""Byte ranges of local files sent from one rank to another over a gloo process group.

Nodes do not share disks, so a node's checkpoint files reach another node through the job's
own network: point-to-point messages on a gloo group (CPU tensors, whatever the training
backend). Both sides know the ranges beforehand (from the checkpoint's manifest), cut them
into the same chunks and exchange them in order; a rank may send one stream and receive
another at the same time (every rank of a ring does).

Failures never desynchronise the two sides: a sender that cannot read goes on sending zeros
and says so in a final status message; a receiver that cannot write goes on receiving and
discards. Both report what went wrong; the bytes are checked against the manifest's checksums
by whoever uses them, so a zero-filled chunk can never pass for data.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..format.tensor_bytes import tensor_memory

__all__ = ["DEFAULT_CHUNK_BYTES", "Incoming", "Outgoing", "exchange", "merge_ranges"]

#: Bytes per point-to-point message: large enough that gloo runs at wire speed, small enough
#: that two buffers per rank stay a negligible share of host memory.
DEFAULT_CHUNK_BYTES = 8 << 20


def merge_ranges(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """``(offset, length)`` ranges sorted, with overlapping and touching ones joined."""
    out: list[list[int]] = []
    for offset, length in sorted(r for r in ranges if r[1] > 0):
        if out and offset <= out[-1][0] + out[-1][1]:
            out[-1][1] = max(out[-1][1], offset + length - out[-1][0])
        else:
            out.append([offset, length])
    return [(o, n) for o, n in out]


def _chunks(ranges: list[tuple[int, int]], chunk_bytes: int) -> list[tuple[int, int]]:
    return [
        (offset + start, min(chunk_bytes, length - start))
        for offset, length in ranges
        for start in range(0, length, chunk_bytes)
    ]


@dataclass
class Outgoing:
    """Ranges of the local file ``path`` for rank ``peer``."""

    peer: int
    path: str
    ranges: list[tuple[int, int]]
    error: str | None = field(default=None, init=False)


@dataclass
class Incoming:
    """Ranges from rank ``peer``, written at the same offsets into ``path`` (created if
    missing, and made ``size`` bytes long: ranges not received stay holes)."""

    peer: int
    path: str
    ranges: list[tuple[int, int]]
    size: int
    error: str | None = field(default=None, init=False)
    bytes_received: int = field(default=0, init=False)


def exchange(
    group: dist.ProcessGroup | None,
    send: Outgoing | None = None,
    recv: Incoming | None = None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> None:
    """Send ``send`` and receive ``recv`` at once (either may be None); the peers call this
    with the mirror image. Problems land in ``send.error`` / ``recv.error``; never raises for
    an I/O error, so the peers stay in step."""
    out_chunks = _chunks(send.ranges, chunk_bytes) if send else []
    in_chunks = _chunks(recv.ranges, chunk_bytes) if recv else []
    out_buf = torch.empty(chunk_bytes if out_chunks else 0, dtype=torch.uint8)
    in_buf = torch.empty(chunk_bytes if in_chunks else 0, dtype=torch.uint8)
    with contextlib.ExitStack() as stack:
        source = _open_source(send, stack) if send else None
        target = _open_target(recv, stack) if recv else None
        for i in range(max(len(out_chunks), len(in_chunks))):
            works = []
            if i < len(out_chunks):
                assert send is not None
                offset, length = out_chunks[i]
                piece = out_buf[:length]
                _fill(send, source, offset, piece)
                works.append(dist.isend(piece, send.peer, group=group))
            if i < len(in_chunks):
                assert recv is not None
                in_piece = in_buf[: in_chunks[i][1]]
                works.append(dist.irecv(in_piece, recv.peer, group=group))
            for work in works:
                if work is not None:
                    work.wait()
            if i < len(in_chunks):
                assert recv is not None
                _store(recv, target, in_chunks[i][0], in_piece)
        _exchange_status(group, send, recv)


def _open_source(send: Outgoing, stack: contextlib.ExitStack) -> int | None:
    try:
        fd = os.open(send.path, os.O_RDONLY)
    except OSError as exc:
        send.error = f"cannot read {send.path}: {exc}"
        return None
    stack.callback(os.close, fd)
    return fd


def _open_target(recv: Incoming, stack: contextlib.ExitStack) -> int | None:
    try:
        fd = os.open(recv.path, os.O_WRONLY | os.O_CREAT, 0o644)
        stack.callback(os.close, fd)
        os.ftruncate(fd, recv.size)
    except OSError as exc:
        recv.error = f"cannot write {recv.path}: {exc}"
        return None
    return fd


def _fill(send: Outgoing, fd: int | None, offset: int, piece: torch.Tensor) -> None:
    view = tensor_memory(piece)
    if fd is not None and send.error is None:
        try:
            done = 0
            while done < view.nbytes:
                got = os.preadv(fd, [view[done:]], offset + done)
                if not got:
                    raise OSError(f"{send.path} ends before byte {offset + view.nbytes}")
                done += got
            return
        except OSError as exc:
            send.error = f"reading {send.path}: {exc}"
    piece.zero_()  # keep the peer in step; the status message says these bytes are void


def _store(recv: Incoming, fd: int | None, offset: int, piece: torch.Tensor) -> None:
    if fd is None or recv.error is not None:
        return
    view = tensor_memory(piece)
    try:
        done = 0
        while done < view.nbytes:
            done += os.pwrite(fd, view[done:], offset + done)
        recv.bytes_received += view.nbytes
    except OSError as exc:
        recv.error = f"writing {recv.path}: {exc}"


def _exchange_status(group, send: Outgoing | None, recv: Incoming | None) -> None:
    """One message each way after the data: did the sender read every byte it sent?"""
    works = []
    mine = torch.tensor([0 if send is None or send.error is None else 1], dtype=torch.int64)
    theirs = torch.zeros(1, dtype=torch.int64)
    if send is not None:
        works.append(dist.isend(mine, send.peer, group=group))
    if recv is not None:
        works.append(dist.irecv(theirs, recv.peer, group=group))
    for work in works:
        if work is not None:
            work.wait()
    if recv is not None and int(theirs.item()) and recv.error is None:
        recv.error = f"rank {recv.peer} could not read what it sent for {os.path.basename(recv.path)}"
