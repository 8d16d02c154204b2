"""A rank that dies during a save or a load: every other rank raises, within seconds, a dmuon
error naming the rank and the phase; nothing is committed; no rank hangs (issue 35, item 5)."""
from __future__ import annotations

import os

import pytest

import dmuon.dcp as ddcp
from tests.helpers import checkpointers, faults
from tests.helpers.launch import RankFailed, run_ranks
from tests.helpers.training import build, train

WORLD = 8


def dying_worker(rank, world, path, op, qualname, victim):
    """The victim is SIGKILLed at ``qualname``; every survivor raises what it raises (the launch
    helper reports each rank's traceback)."""
    import torch.distributed as dist

    model, opt = build()
    train(model, opt, rank, world, range(1))
    if op == "load":
        ddcp.save(model, opt, path)
        dist.barrier()
    if rank == victim:
        faults.on_call(qualname, faults.sigkill)  # (also in an async save's writer thread)
    if op == "load":
        ddcp.load(model, opt, path)
    else:
        checkpointers.save(op, model, opt, path)


CASES = {
    "save-planning": ("DMuonSavePlanner.create_local_plan", 3, "planning", True),
    "save-writing": ("DMuonStorageWriter._write_file", 5, "waiting for the other ranks' writes", True),
    "save-commit-rank0": ("DMuonStorageWriter.commit_bytes", 0, "waiting for the other ranks' writes", True),
    "save-commit-rank0-hosting-the-store": (
        "DMuonStorageWriter.commit_bytes", 0, "waiting for the other ranks' writes", False),
    "load-reading": ("DMuonStorageReader._read_items", 6, "waiting for the other ranks' reads", True),
}
PARAMS = [pytest.param("load" if case.startswith("load") else kind, *CASES[case], id=f"{kind}-{case}")
          for case in CASES for kind in (("sync",) if case.startswith("load") else checkpointers.KINDS)]


@pytest.mark.parametrize("op,qualname,victim,phase,agent_store", PARAMS)
def test_the_others_name_the_rank_that_died_and_the_phase(tmp_path, op, qualname, victim, phase, agent_store):
    """As torchrun runs a job (the store in its agent), and rank 0 hosting the store itself;
    every save case for the synchronous save and for the async one (its writer thread runs
    the rounds over its own process group)."""
    path = str(tmp_path / "ckpt")
    with pytest.raises(RankFailed) as info:  # the victim's death fails the job...
        run_ranks(dying_worker, WORLD, path, op, qualname, victim, timeout=120, grace=60,
                  env={"DMUON_ROLL_CALL_S": "3"}, agent_store=agent_store)
    text = str(info.value)
    assert f"rank {victim}" in text, text
    # ...and every survivor raised the dmuon error (the launch helper lists what each rank raised)
    survivors = [r for r in range(WORLD) if r != victim]
    for rank in survivors:
        assert f"--- rank {rank} ---" in text and "RankStoppedError" in text, text
    assert text.count("RankStoppedError") >= len(survivors), text
    if not agent_store:  # rank 0 hosted the rendezvous store: it went with it
        named = "the job's rendezvous store is unreachable, so the rank hosting it (rank 0"
        assert text.count("the job's rendezvous store is unreachable") >= len(survivors), text
    else:  # exactly the victim, on every survivor (one verdict, whoever failed first)
        named = f"rank {victim} stopped while this rank was {phase}"
        assert text.count(f"rank {victim} stopped while this rank was") >= len(survivors), text
    assert phase in text and named.split(",")[0] in text, text
    if op != "load":
        assert not os.path.exists(os.path.join(path, ".metadata"))  # nothing committed


def clean_worker(rank, world, path):
    import threading

    import torch.distributed as dist

    from dmuon import compat

    model, opt = build()
    store = compat.default_store()
    dist.barrier()
    before = store.num_keys()
    for step in range(3):
        ddcp.save(model, opt, f"{path}/{step}")
        ddcp.load(model, opt, f"{path}/{step}")
    # each operation's answering thread has left the store by the time the operation returns:
    # one still in a store call when the interpreter finalizes aborts the process
    answering = [thread.name for thread in threading.enumerate() if thread.name == "dmuon-roll-call"]
    dist.barrier()
    grown = store.num_keys() - before
    dist.barrier()  # (read before any rank leaves)
    return grown, answering


def test_an_operation_that_ends_well_leaves_no_keys_and_no_thread_behind(tmp_path):
    # the store in an agent, as under torchrun: it outlives every rank
    results = run_ranks(clean_worker, 2, str(tmp_path), timeout=60, agent_store=True)
    assert results[0][0] <= 2, results  # (a barrier's own keys at most)
    assert [answering for _, answering in results] == [[], []]
