"""The raw storage limit (benchmarks/raw_io.py) writes and reads exactly the bytes asked for, in
every way it measures, and save_load.py's ``raw-best`` is each repeat's fastest raw method, so
that CI keeps the limit honest while the benchmarks change."""

from __future__ import annotations

import os
import sys

import pytest

BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
sys.path.insert(0, BENCHMARKS)

import raw_io  # noqa: E402
import save_load  # noqa: E402

SIZE = (3 << 20) + 12345  # several calls, and an unaligned tail for O_DIRECT


@pytest.mark.parametrize("method", raw_io.WRITES)
def test_each_write_writes_exactly_the_bytes(tmp_path, method):
    source = raw_io.Source()
    path = str(tmp_path / f"{method}.bin")
    try:
        raw_io.write(method, path, SIZE, source)
    except OSError as error:  # a filesystem without O_DIRECT (tmpfs)
        if method != "direct":
            raise
        pytest.skip(f"no O_DIRECT here: {error}")
    assert os.path.getsize(path) == SIZE
    with open(path, "rb") as f:
        data = f.read()
    block = bytes(source.view[: raw_io.BIG_BLOCK])
    assert data == (block * (SIZE // len(block) + 1))[:SIZE] or method == "threads"
    if method == "threads":  # each window starts over from the source's first byte
        window = raw_io.WINDOW
        expected = b"".join(block[: min(window, SIZE - s)] for s in range(0, SIZE, window))
        assert data == expected


@pytest.mark.parametrize("method", raw_io.READS)
def test_each_read_reads_every_byte_cold(tmp_path, method):
    source = raw_io.Source()
    path = str(tmp_path / "file.bin")
    raw_io.write_plain(path, SIZE, source)
    raw_io.drop(path)
    assert raw_io.read(method, path, source) == SIZE


def test_raw_best_is_each_repeats_fastest_raw_method():
    def sample(wall):
        return {"wall_s": wall, "cpu_s": 0.1}

    walls = {"raw-plain": [0.5, 0.2], "raw-behind": [0.3, 0.4], "raw-threads": [0.6, 0.6], "raw-direct": [0.4, 0.3]}
    per_rank = [{"samples": {m: {"save": [sample(w) for w in ws]} for m, ws in walls.items()}}]
    best = save_load.merge(per_rank)["raw-best"]["save"]
    assert [s["wall_s"] for s in best] == [0.3, 0.2]
    assert [s["method"] for s in best] == ["raw-behind", "raw-plain"]
