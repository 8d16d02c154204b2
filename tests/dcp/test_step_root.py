"""Step directories under one store (dmuon/dcp/step_root.py): naming, listing, retention."""
from __future__ import annotations

import os

import pytest

from dmuon.dcp.format.layout import METADATA
from dmuon.dcp.step_root import StepRoot
from dmuon.dcp.storage.local import LocalStore


def make(root, committed=(), leftovers=()):
    for step in committed:
        os.makedirs(root / f"step-{step}")
        (root / f"step-{step}" / METADATA).write_bytes(b"x")
        (root / f"step-{step}" / "__0_a.distcp").write_bytes(b"data")
    for step in leftovers:
        os.makedirs(root / f"step-{step}")
        (root / f"step-{step}" / "__0_b.distcp").write_bytes(b"data")
    (root / "notes").mkdir()  # not a step: never touched
    return StepRoot(LocalStore(str(root)))


def test_lists_committed_steps_only(tmp_path):
    root = make(tmp_path, committed=(3, 1, 2), leftovers=(4,))
    assert root.committed() == [1, 2, 3]
    assert sorted(root.dirs()) == [1, 2, 3, 4]


@pytest.mark.parametrize("kwargs,left", [
    ({"keep": 2}, [2, 3]),  # the crash's newer leftover goes too
    ({"keep": 2, "writing": 4}, [3, 4]),  # the step being written counts as one of the kept
    ({"keep": 1, "newer_leftovers": False}, [3, 4]),  # a replica may be arriving: newer ones stay
    ({"keep": 1, "upto": 2}, [2, 3, 4]),  # nothing after upto is looked at
])
def test_retention(tmp_path, kwargs, left):
    root = make(tmp_path, committed=(1, 2, 3), leftovers=(4,))
    root.retain(**kwargs)
    assert sorted(root.dirs()) == left
    assert (tmp_path / "notes").is_dir()


def test_the_newest_committed_step_is_never_removed(tmp_path):
    root = make(tmp_path, committed=(1, 2))
    root.retain(1, writing=5)  # keep=1 with a save in flight: that save, and the newest committed
    assert root.committed() == [2]


def test_remove_uncommits_first_and_clear_leftovers_keeps_a_commit(tmp_path):
    root = make(tmp_path, committed=(1,), leftovers=(2,))
    root.clear_leftovers(1)
    assert root.committed() == [1]
    root.clear_leftovers(2)
    assert sorted(root.dirs()) == [1]
    root.remove(1)
    assert root.dirs() == {}
