"""The launch helper itself: a native crash reruns the job once, loudly; nothing else does."""
import os
from pathlib import Path

import pytest

from tests.helpers.launch import NativeCrash, RankFailed, run_ranks


def _attempt(marker_dir: str, rank: int) -> int:
    """Count this rank's attempts in files (the ranks are fresh processes each time)."""
    attempts = len(list(Path(marker_dir).glob(f"rank{rank}-*"))) + 1
    Path(marker_dir, f"rank{rank}-{attempts}").touch()
    return attempts


def abort_worker(rank, world, marker_dir, crashes):
    attempt = _attempt(marker_dir, rank)
    if rank == 1 and attempt <= crashes:
        os.abort()
    return attempt


def raise_worker(rank, world, marker_dir):
    _attempt(marker_dir, rank)
    raise ValueError("an ordinary failure")


def test_one_native_crash_reruns_the_job_with_a_warning(tmp_path):
    with pytest.warns(UserWarning, match="native crash") as record:
        attempts = run_ranks(abort_worker, 2, str(tmp_path), 1)
    assert attempts == [2, 2]
    assert "Fatal Python error: Aborted" in str(record[0].message)


def test_a_second_native_crash_fails(tmp_path):
    with pytest.warns(UserWarning, match="native crash"), pytest.raises(NativeCrash, match="Aborted"):
        run_ranks(abort_worker, 2, str(tmp_path), 2)


def test_an_ordinary_failure_is_not_rerun(tmp_path):
    with pytest.raises(RankFailed, match="an ordinary failure") as info:
        run_ranks(raise_worker, 2, str(tmp_path))
    assert not isinstance(info.value, NativeCrash)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank0-1", "rank1-1"]
