"""Scenario 5: the disk fills up or permission is denied in the middle of a save.

A clear error; the previous checkpoint intact and loadable; nothing partial committed.
Three real failure paths: the kernel's file-size limit on a local directory (EFBIG), and an
fsspec filesystem that runs out of space (ENOSPC) or permission (EACCES) part-way; each for the
synchronous save and for the async one.
"""
import os

import pytest

import dmuon
import dmuon.dcp as ddcp
from tests.helpers import checkpointers
from tests.helpers.launch import RankFailed, run_ranks
from tests.helpers.setup import max_abs_diff
from tests.helpers.training import build, train


def first_worker(rank, world, url):
    from tests.helpers.quota_fs import register

    register()
    model, opt = build()
    train(model, opt, rank, world, range(1))
    ddcp.save(model, opt, url)
    return dmuon.get_model_state_dict(model)


def failing_worker(rank, world, url, limit, failing_rank, kind):
    import resource
    import signal

    from tests.helpers.quota_fs import register

    register()
    model, opt = build()
    train(model, opt, rank, world, range(3))  # different values than the committed checkpoint
    if rank == failing_rank:
        if limit == "fsize":
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of a killing signal
            resource.setrlimit(resource.RLIMIT_FSIZE, (20_000, 20_000))
        else:
            os.environ[limit[0]] = str(limit[1])
    checkpointers.save(kind, model, opt, url, overwrite=True)


def load_worker(rank, world, url):
    from tests.helpers.quota_fs import register

    register()
    model, opt = build()
    ddcp.load(model, opt, url)
    return dmuon.get_model_state_dict(model)


CASES = {
    "local EFBIG (RLIMIT_FSIZE)": ("local", "fsize", 1, "File too large"),
    "ENOSPC while writing data": ("quota", ("DMUON_QUOTA_BYTES", 30_000), 1, "No space left on device"),
    "ENOSPC writing the manifest": ("quota", ("DMUON_QUOTA_BYTES", 0), 0, "No space left on device"),
    "EACCES creating a data file": ("quota", ("DMUON_QUOTA_FILES", 0), 1, "Permission denied"),
    "EACCES creating the manifest": ("quota", ("DMUON_QUOTA_FILES", 1), 0, "Permission denied"),
}


@pytest.mark.parametrize("kind", checkpointers.KINDS)
@pytest.mark.parametrize("case", list(CASES))
def test_full_or_denied_mid_save_keeps_the_previous_checkpoint(tmp_path, case, kind, reliability_report):
    scheme, limit, failing_rank, message = CASES[case]
    path = tmp_path / "ckpt"
    url = str(path) if scheme == "local" else f"quota://{path}"
    saved = run_ranks(first_worker, 2, url)[0]
    before = set(os.listdir(path))
    commit = (path / ".metadata").read_bytes()
    with pytest.raises(RankFailed, match=message):
        run_ranks(failing_worker, 2, url, limit, failing_rank, kind, grace=1.0)
    assert (path / ".metadata").read_bytes() == commit  # still the old commit ...
    assert before <= set(os.listdir(path))              # ... with every one of its files
    loaded = run_ranks(load_worker, 2, url)[0]
    assert max_abs_diff(loaded, saved) == 0.0           # and it loads bit-exactly
    fresh = tmp_path / "fresh"
    fresh_url = str(fresh) if scheme == "local" else f"quota://{fresh}"
    with pytest.raises(RankFailed, match=message):
        run_ranks(failing_worker, 2, fresh_url, limit, failing_rank, kind, grace=1.0)
    assert not (fresh / ".metadata").exists()           # nothing partial was committed
    reliability_report.setdefault("storage_full_or_denied", {})[f"{case} ({kind})"] = "clear error, previous intact"
