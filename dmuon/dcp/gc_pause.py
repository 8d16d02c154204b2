"""Python's cyclic garbage collector paused around checkpoint work that builds many objects.

Unpickling DCP metadata and plans creates hundreds of thousands of small containers; each
thousand or so triggers a collection that walks every tracked object of the process (a whole
training job's worth), and none of it is garbage yet. Measured here on a 19 MB ``.metadata``:
2.5-4.3 s of CPU with the collector running, 0.57 s with it paused. Pausing changes when
cycles are freed, never what is freed; the collector's previous state is restored afterwards.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

__all__ = ["paused_gc"]


@contextlib.contextmanager
def paused_gc() -> Iterator[None]:
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
