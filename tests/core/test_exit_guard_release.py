"""The exit guard at ``destroy_process_group()``: what dmuon holds of the job's groups is let go
once they are destroyed, and the guard is installed by the first public name used."""
import subprocess
import sys

from dmuon import exit_guard


class HoldsAGroup:
    """A tracked owner with a group of its own, as an AsyncCheckpointer or the tiers keep."""

    def __init__(self):
        self.group = object()  # stands for its gloo group
        self.released = 0

    def pending_description(self):
        return None

    def finish_pending(self):
        return None

    def release_process_groups(self):
        self.group = None
        self.released += 1


def test_an_owner_lets_its_groups_go_when_the_job_destroys_its_groups():
    destroyed = []
    destroy = exit_guard._guarded_destroy(lambda group=None: destroyed.append(group))
    owner = HoldsAGroup()
    exit_guard.track(owner)
    subgroup = object()
    destroy(subgroup)  # one group of the job: the owner's own is still alive
    assert destroyed == [subgroup] and owner.released == 0 and owner.group is not None
    destroy()  # the whole job: torch's own runs first, then the owner lets its group go
    assert destroyed == [subgroup, None] and owner.released == 1 and owner.group is None


_FIRST_USE = """
import torch.distributed as dist
import dmuon, dmuon.dcp
patched = lambda: getattr(dist.destroy_process_group, "_dmuon_exit_guard", False)
before = patched()
dmuon.dcp.CheckpointError
print(before, patched())
"""


def test_the_first_public_name_used_installs_the_guard():
    res = subprocess.run([sys.executable, "-c", _FIRST_USE], capture_output=True, text=True, timeout=120)
    assert res.stdout.split() == ["False", "True"], res.stderr
