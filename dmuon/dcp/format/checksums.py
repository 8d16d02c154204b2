"""The checksum kinds a manifest can name: how each is computed and how wide its values are.

dmuon writes XXH3-64 (the ``xxhash`` library: about twice CRC-32C's speed on x86 with AVX2 or
ARM with NEON, with SIMD code for both, and a 64-bit value). Checkpoints written before it used
CRC-32C (manifest version 2) and zlib's CRC-32 (version 1); both are still verified.

Every kind offers a one-shot ``of(buffer) -> int`` for whole segments and ``new()`` for a
digest fed in pieces (``update(buffer)``, ``intdigest()``), for a segment that spans writes.
Both take any contiguous buffer (``bytes``, ``bytearray``, ``memoryview``) and release the GIL
while they run, so a background save thread and training can overlap.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import crc32c as _crc32c
import xxhash

__all__ = ["CHECKSUMS", "HOT_SLICE", "WRITE_CHECKSUM", "ChecksumKind", "Digest", "checksum_of"]

# Bytes that a save or a load copies (into the page cache, into a tensor) and then checksums
# right away, while they are still in the CPU's L2 cache: checksumming megabytes after copying
# them goes back to memory for every byte. 256 KiB measured best for reads and buffered writes
# (docs/performance.md).
HOT_SLICE = 256 << 10


class Digest(Protocol):
    def update(self, data, /) -> None: ...

    def intdigest(self) -> int: ...


class _RunningCrc:
    """A CRC fed in pieces, with the digest interface of ``xxhash``'s hashers."""

    __slots__ = ("_step", "_value")

    def __init__(self, step: Callable[..., int]) -> None:
        self._step = step
        self._value = 0

    def update(self, data, /) -> None:
        self._value = self._step(data, self._value)

    def intdigest(self) -> int:
        return self._value


def _crc32(data, running: int = 0) -> int:
    return zlib.crc32(data, running) & 0xFFFFFFFF


@dataclass(frozen=True)
class ChecksumKind:
    name: str  # as the manifest records it
    width: int  # bytes of one value where the manifest packs them (little-endian)
    of: Callable[..., int]
    new: Callable[[], Digest]

    @property
    def struct_code(self) -> str:
        return {4: "I", 8: "Q"}[self.width]


CHECKSUMS: dict[str, ChecksumKind] = {
    kind.name: kind
    for kind in (
        ChecksumKind("crc32", 4, _crc32, lambda: _RunningCrc(_crc32)),
        ChecksumKind("crc32c", 4, _crc32c.crc32c, lambda: _RunningCrc(_crc32c.crc32c)),
        ChecksumKind("xxh3-64", 8, xxhash.xxh3_64_intdigest, xxhash.xxh3_64),
    )
}
WRITE_CHECKSUM = "xxh3-64"


def checksum_of(kind: str, data) -> int:
    return CHECKSUMS[kind].of(data)
