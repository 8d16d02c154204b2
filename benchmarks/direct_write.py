"""What writing tensors from their own memory saves: ``DirectFile.write`` (copied through the
staging buffers) against ``DirectFile.write_borrowed`` (lined up, handed to the device as is).

    python benchmarks/direct_write.py [--dir /tmp] [--mib 256] [--tensor-mib 4] [--procs 1 2]
                                      [--repeats 8]

Each process writes ``--mib`` of fp32 tensors (``--tensor-mib`` each) to its own file under
``--dir`` (an ext4 or xfs directory: direct I/O), framed as dmuon's writer frames them: a few
hundred bytes of header before each tensor and a tail after it; for the borrowed method the
header is padded so the tensor lines up with its address, as the writer pads a zip record.
Every tensor's bytes are checksummed (XXH3-64, 16 KiB blocks) while they are written, as in a
save. The two methods alternate, the first one swapping every repeat; ``--procs 2`` runs two
such processes at once (two ranks sharing one disk). Printed per method: min and median of
wall time (slowest process) and of CPU seconds (user + sys, all threads, summed over
processes), and the bytes written in place. Files are removed as soon as they are measured.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import tempfile
import time

from harness import cpu_seconds

METHODS = ("copy", "borrowed")
HEAD, TAIL, BLOCK = 300, 200, 16 << 10


def _write_file(path: str, tensors: list, method: str) -> int:
    import xxhash

    from dmuon.dcp.format.tensor_bytes import tensor_memory
    from dmuon.dcp.storage.direct_io import DIRECT_IO_ALIGN, DirectFile

    of = xxhash.xxh3_64_intdigest
    f = DirectFile(path)
    try:
        position = 0
        for tensor in tensors:
            pad = (tensor.data_ptr() - position - HEAD) % DIRECT_IO_ALIGN if method == "borrowed" else 0
            f.write(b"h" * (HEAD + pad))
            view = tensor_memory(tensor)
            (f.write_borrowed if method == "borrowed" else f.write)(view)
            [of(view[offset : offset + BLOCK]) for offset in range(0, view.nbytes, BLOCK)]
            f.write(b"t" * TAIL)
            position += HEAD + pad + view.nbytes + TAIL
        f.flush()
        os.fsync(f.fileno())
        return f.in_place_bytes
    finally:
        f.close()
        os.remove(path)


def _process(index: int, args, barrier, results) -> None:
    import torch

    torch.manual_seed(index)
    tensors = [torch.randn(args.tensor_mib << 18) for _ in range(args.mib // args.tensor_mib)]
    samples: dict[str, list] = {method: [] for method in METHODS}
    for repeat in range(-1, args.repeats):  # one unrecorded warm-up round
        order = METHODS if repeat % 2 == 0 else METHODS[::-1]
        for method in order:
            barrier.wait()
            t0, c0 = time.perf_counter(), cpu_seconds()
            in_place = _write_file(os.path.join(args.dir, f"direct-write-{os.getpid()}"), tensors, method)
            sample = (time.perf_counter() - t0, cpu_seconds() - c0, in_place)
            if repeat >= 0:
                samples[method].append(sample)
    results.put((index, samples))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="an ext4/xfs directory (default: the temp dir)")
    parser.add_argument("--mib", type=int, default=256, help="MiB written per process (default 256)")
    parser.add_argument("--tensor-mib", type=int, default=4, help="MiB per tensor (default 4)")
    parser.add_argument("--procs", type=int, nargs="+", default=[1, 2], help="processes writing at once")
    parser.add_argument("--repeats", type=int, default=8, help="measured repeats per method (default 8)")
    args = parser.parse_args()

    from dmuon.dcp.storage.local import DIRECT_IO_FILESYSTEMS, filesystem_type

    kind = filesystem_type(args.dir)
    if kind not in DIRECT_IO_FILESYSTEMS:
        wanted = sorted(DIRECT_IO_FILESYSTEMS)
        raise SystemExit(f"{args.dir} is {kind or 'of unknown type'}: direct I/O needs one of {wanted}")
    print(f"{args.dir} ({kind}); {args.mib} MiB per process in {args.tensor_mib} MiB tensors; {args.repeats} repeats")
    context = multiprocessing.get_context("spawn")
    for procs in args.procs:
        barrier, results = context.Barrier(procs), context.Queue()
        workers = [context.Process(target=_process, args=(i, args, barrier, results)) for i in range(procs)]
        for worker in workers:
            worker.start()
        per_process = dict(results.get() for _ in workers)
        for worker in workers:
            worker.join()
        print(f"\n{procs} process(es)             wall s (min / median)   CPU-s (min / median)   in place")
        for method in METHODS:
            runs = list(zip(*(per_process[i][method] for i in range(procs))))
            walls = [max(s[0] for s in run) for run in runs]
            cpus = [sum(s[1] for s in run) for run in runs]
            in_place = sum(s[2] for s in runs[0]) / (procs * args.mib << 20)
            print(f"  {method:<22} {min(walls):8.3f} / {statistics.median(walls):.3f}"
                  f"        {min(cpus):8.3f} / {statistics.median(cpus):.3f}      {in_place:6.1%}")


if __name__ == "__main__":
    main()
