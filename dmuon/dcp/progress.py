"""A progress bar of bytes, on stderr, shown only when stderr is a terminal.

Exports and verifies run for minutes on large checkpoints; a job log must not fill with bars.
"""

from __future__ import annotations

import sys

from tqdm import tqdm

__all__ = ["byte_progress"]


def byte_progress(total_bytes: int, desc: str) -> tqdm:
    """A bar of ``total_bytes`` (``update(n)`` as bytes pass; a context manager)."""
    return tqdm(
        total=total_bytes,
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        desc=desc,
        disable=not sys.stderr.isatty(),
        file=sys.stderr,
    )
