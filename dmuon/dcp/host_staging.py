"""Accelerator tensors through host memory: a few reusable buffers, copies overlapped with I/O.

A data file's tensors live on the GPU; the file is written from host memory. Copying each one
with ``tensor.cpu()`` allocates pageable memory per tensor and blocks until the copy is done,
so the device-to-host copies and the writes take turns. :class:`HostStaging` instead owns a
fixed number of host buffers (pinned where there is an accelerator) and keeps one copy ahead
of the writer: while item *i* is written from one buffer, item *i+1* is copied into another
on a side stream. Memory is bounded by ``slots * slot_bytes`` (two buffers of 64 MiB by
default); a tensor larger than a buffer is copied on its own, as before, and counted.

Buffers are reused, so the writer must not lend their memory to a file past the item (a
direct-I/O write from the caller's memory); :attr:`Staged.reused` tells it so.

Loads run the other way (:class:`DeviceUploads`): an item's bytes are read and verified into a
free buffer, then copied to the device on a side stream while the next item is read into the
other buffer; a buffer is refilled only once its copy has finished, and an item is committed to
the planner only then. The same two buffers of 64 MiB bound it.

The logic is device-agnostic: ``stage_host_tensors=True`` runs the same slot and look-ahead
bookkeeping for CPU tensors (a plain copy instead of an asynchronous one), which is how the
CPU tests exercise it.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import torch

__all__ = ["SLOTS", "SLOT_BYTES", "DeviceUploads", "HostStaging", "Staged"]

SLOTS = 2
SLOT_BYTES = 64 << 20

K = TypeVar("K")


@dataclass
class Staged:
    """One item's data as the writer gets it: host memory; ``reused`` if it is a staging buffer."""

    data: Any
    reused: bool


class _Ticket:
    def __init__(self, value: Any, slot: torch.Tensor | None = None, event: Any = None) -> None:
        self.value, self.slot, self.event = value, slot, event

    def ready(self) -> Staged:
        if self.event is not None:
            self.event.synchronize()
        return Staged(self.value, self.slot is not None)


class HostStaging(Generic[K]):
    """Reusable host buffers and a side stream; one instance per data file being written."""

    def __init__(self, slots: int = SLOTS, slot_bytes: int = SLOT_BYTES, *, stage_host_tensors: bool = False) -> None:
        if slots < 2:
            raise ValueError("HostStaging needs at least 2 slots: one written, one being filled")
        self.slots = slots
        self.slot_bytes = slot_bytes
        self.stage_host_tensors = stage_host_tensors
        self._free: list[torch.Tensor] = []
        self._allocated = 0
        self._streams: dict[torch.device, Any] = {}
        self.staged = 0  # tensors that went through a slot
        self.oversize = 0  # device tensors larger than a slot, copied on their own

    def items(self, pairs: Iterable[tuple[K, Any]]) -> Iterator[tuple[K, Staged]]:
        """``(key, data)`` -> ``(key, Staged)`` in order, one device-to-host copy ahead."""
        source = iter(pairs)
        ahead: collections.deque[tuple[K, _Ticket]] = collections.deque()

        def launch() -> None:
            nxt = next(source, None)
            if nxt is not None:
                ahead.append((nxt[0], self._begin(nxt[1])))

        launch()
        while ahead:
            key, ticket = ahead.popleft()
            launch()  # the next copy runs while this item is written
            yield key, ticket.ready()
            if ticket.slot is not None:
                self._free.append(ticket.slot)

    def _stages(self, data: Any) -> bool:
        if not isinstance(data, torch.Tensor):
            return False
        return data.device.type != "cpu" or self.stage_host_tensors

    def _slot(self, device: torch.device) -> torch.Tensor:
        if self._free:
            return self._free.pop()
        if self._allocated >= self.slots:  # pragma: no cover - items() returns a slot per item
            raise RuntimeError("HostStaging: every slot is in use")
        self._allocated += 1
        pin = device.type != "cpu" and torch.accelerator.is_available()
        return torch.empty(self.slot_bytes, dtype=torch.uint8, pin_memory=pin)

    def _begin(self, data: Any) -> _Ticket:
        if not self._stages(data):
            return _Ticket(data)
        tensor = data.detach()
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes == 0 or nbytes > self.slot_bytes or not tensor.is_contiguous():
            self.oversize += nbytes > self.slot_bytes and tensor.device.type != "cpu"
            return _Ticket(tensor.contiguous().cpu())
        slot = self._slot(tensor.device)
        host = slot[:nbytes].view(tensor.dtype).view(tensor.shape)
        self.staged += 1
        if tensor.device.type == "cpu":
            host.copy_(tensor)
            return _Ticket(host, slot)
        module = torch.get_device_module(tensor.device.type)
        stream = self._streams.get(tensor.device)
        if stream is None:
            stream = self._streams[tensor.device] = module.Stream(device=tensor.device)
        stream.wait_stream(module.current_stream(tensor.device))  # the tensor's values are final
        with module.stream(stream):
            host.copy_(tensor, non_blocking=True)
            event = module.Event()
            event.record(stream)
        tensor.record_stream(stream)  # the allocator keeps its memory until the copy is done
        return _Ticket(host, slot, event)


class DeviceUploads:
    """Reusable host buffers for a load: read into one, copy it to the device on a side stream,
    read the next item into another meanwhile. One instance per plan being read.

    :meth:`buffer` hands out a host tensor for a target, waiting first for the copy that last
    used that buffer; :meth:`upload` starts the copy and calls ``done`` (the planner's commit)
    once it is complete -- when the buffer is next needed, or at :meth:`finish`. A target that
    does not fit a buffer (or lives on the CPU, unless ``stage_host_tensors``) is not taken
    (:meth:`takes`): the caller copies it on its own, as before.
    """

    def __init__(self, slots: int = SLOTS, slot_bytes: int = SLOT_BYTES, *, stage_host_tensors: bool = False) -> None:
        if slots < 2:
            raise ValueError("DeviceUploads needs at least 2 slots: one being copied, one being filled")
        self.slots, self.slot_bytes, self.stage_host_tensors = slots, slot_bytes, stage_host_tensors
        self._free: list[torch.Tensor] = []
        self._allocated = 0
        self._filling: torch.Tensor | None = None  # the buffer handed out by buffer(), not yet uploaded
        self._pending: collections.deque[tuple[torch.Tensor, Any, Any]] = collections.deque()  # slot, event, done
        self._streams: dict[torch.device, Any] = {}
        self.uploaded = 0  # targets that went through a buffer

    def takes(self, target: torch.Tensor, nbytes: int) -> bool:
        """Does ``target`` go through a buffer (an accelerator tensor, or any with
        ``stage_host_tensors``, that fits one)?"""
        staged = target.device.type != "cpu" or self.stage_host_tensors
        return staged and 0 < nbytes <= self.slot_bytes

    def buffer(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A host tensor of ``shape`` and ``dtype`` in a free buffer (see :meth:`takes`)."""
        if self._filling is not None:  # handed out before, never uploaded (its read failed)
            self._free.append(self._filling)
        if self._free:
            slot = self._free.pop()
        elif self._allocated < self.slots:
            self._allocated += 1
            pin = device.type != "cpu" and torch.accelerator.is_available()
            slot = torch.empty(self.slot_bytes, dtype=torch.uint8, pin_memory=pin)
        else:
            slot = self._complete_oldest()
        self._filling = slot
        return slot[: math.prod(shape) * dtype.itemsize].view(dtype).view(shape)

    def upload(self, host: torch.Tensor, target: torch.Tensor, done: Any) -> None:
        """Copy ``host`` (from :meth:`buffer`) into ``target``; ``done()`` once it has landed."""
        slot, self._filling = self._filling, None
        if slot is None:
            raise RuntimeError("DeviceUploads.upload without a buffer from DeviceUploads.buffer")
        self.uploaded += 1
        if target.device.type == "cpu":
            target.copy_(host)
            self._pending.append((slot, None, done))
            return
        module = torch.get_device_module(target.device.type)
        stream = self._streams.get(target.device)
        if stream is None:
            stream = self._streams[target.device] = module.Stream(device=target.device)
        stream.wait_stream(module.current_stream(target.device))  # nothing still reads the target
        with module.stream(stream):
            target.copy_(host, non_blocking=True)
            event = module.Event()
            event.record(stream)
        target.record_stream(stream)
        self._pending.append((slot, event, done))

    def _complete_oldest(self) -> torch.Tensor:
        slot, event, done = self._pending.popleft()
        if event is not None:
            event.synchronize()
        done()
        return slot

    def finish(self) -> None:
        """Wait for every copy still in flight and commit its item; the buffers stay for reuse."""
        while self._pending:
            self._free.append(self._complete_oldest())
        if self._filling is not None:
            self._free.append(self._filling)
            self._filling = None
