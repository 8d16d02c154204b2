"""What fresh memory pages cost on this machine: the noise source behind ``save_load.py``.

    python benchmarks/page_first_touch.py [--dir DIR] [--mib 256] [--touch-gib 4] [--idle 20]

On some virtual machines the guest returns freed pages to the host, and getting one back is
slow. Then any operation that needs new pages (page cache for a buffered write or a cold
read, fresh tensors) costs more or less CPU depending on what ran just before it. This
script shows whether that happens here, in one process:

1. buffered writes + fsync of ``--mib`` MiB, back to back (CPU seconds each);
2. touching ``--touch-gib`` GiB of fresh anonymous memory (wall seconds), then freeing it,
   three times, each followed by three more writes;
3. ``--idle`` seconds asleep, then three more writes.

On a machine that keeps its pages, every write costs about the same and step 2 is fast
(well under a second per GiB). The file is removed after every write.
"""

from __future__ import annotations

import argparse
import mmap
import os
import tempfile
import time

from harness import cpu_seconds
from raw_io import Source, write_plain  # the raw baseline's plain write + fsync

PAGE = mmap.PAGESIZE


def buffered_write_cpu(path: str, nbytes: int, source: Source) -> float:
    """CPU seconds of one buffered write + fsync of ``nbytes`` to a new file, written as
    ``raw_io.py``'s plain raw method writes them; the file is removed after."""
    start = cpu_seconds()
    try:
        write_plain(path, nbytes, source)
        return cpu_seconds() - start
    finally:
        os.remove(path)


def touch_fresh_memory(nbytes: int) -> float:
    """Wall seconds to write one byte into every page of ``nbytes`` of new anonymous memory."""
    start = time.perf_counter()
    region = mmap.mmap(-1, nbytes)
    view = memoryview(region)
    for offset in range(0, nbytes, PAGE):
        view[offset] = 1
    view.release()
    region.close()
    return time.perf_counter() - start


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="where to write (default: the temp dir)")
    parser.add_argument("--mib", type=int, default=256, help="bytes per write, in MiB (default 256)")
    parser.add_argument("--touch-gib", type=int, default=4, help="fresh memory to touch, in GiB (default 4)")
    parser.add_argument("--idle", type=float, default=20, help="seconds asleep before the last writes (default 20)")
    args = parser.parse_args(argv)

    source = Source()
    path = os.path.join(args.dir, f"dmuon-first-touch-{os.getpid()}.bin")

    def writes(n: int) -> str:
        return ", ".join(f"{buffered_write_cpu(path, args.mib << 20, source):.3f}" for _ in range(n))

    print(f"buffered write + fsync of {args.mib} MiB to {args.dir}, CPU seconds each")
    print(f"  back to back:                 {writes(6)}")
    for _ in range(3):
        touched = touch_fresh_memory(args.touch_gib << 30)
        print(f"  touched {args.touch_gib} GiB fresh in {touched:5.1f} s, then: {writes(3)}")
    time.sleep(args.idle)
    print(f"  after {args.idle:.0f} s idle:             {writes(3)}")


if __name__ == "__main__":
    main()
