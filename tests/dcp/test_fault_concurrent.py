"""Scenario 6: two jobs save to the same path at once: one wins, the other fails cleanly."""
import threading

import fsspec
import pytest

import dmuon
import dmuon.dcp as ddcp
from tests.helpers import checkpointers
from tests.helpers.launch import RankFailed, run_ranks
from tests.helpers.setup import max_abs_diff
from tests.helpers.training import build, train

TRIALS = 5


def job_worker(rank, world, path, options, seed_steps, kind):
    model, opt = build()
    train(model, opt, rank, world, range(seed_steps))  # the two jobs hold different values
    checkpointers.save(kind, model, opt, path, storage_options=options)
    return dmuon.get_model_state_dict(model)


def load_worker(rank, world, path, options):
    model, opt = build()
    ddcp.load(model, opt, path, storage_options=options)
    return dmuon.get_model_state_dict(model)


def run_two_jobs(path, options, kind):
    results = {}

    def job(name, steps):
        try:
            results[name] = ("ok", run_ranks(job_worker, 2, path, options, steps, kind, timeout=120)[0])
        except RankFailed as exc:
            results[name] = ("failed", str(exc))

    threads = [threading.Thread(target=job, args=(name, steps)) for name, steps in (("a", 1), ("b", 2))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def files_of(path, options):
    fs, root = fsspec.core.url_to_fs(path, **(options or {}))
    return sorted(p.rsplit("/", 1)[-1] for p in fs.ls(root, detail=False))


@pytest.mark.parametrize("backend,kind", [("local", "sync"), ("s3", "sync"), ("rgw", "sync"), ("local", "async")])
def test_two_concurrent_saves_one_wins_no_mixture(checkpoint_location, backend, kind, reliability_report):
    """The loser's error is a CheckpointExistsError on every rank, from the async save's writer
    thread as from the synchronous save."""
    counts = {"trials": 0, "one_winner": 0, "loser_failed_cleanly": 0, "lost_at_commit": 0, "mixed_commits": 0}
    for trial in range(TRIALS):
        path, options = checkpoint_location(backend, f"t{trial}")
        results = run_two_jobs(path, options, kind)
        counts["trials"] += 1
        winners = [n for n, (status, _) in results.items() if status == "ok"]
        losers = [n for n, (status, _) in results.items() if status == "failed"]
        if len(winners) == 1:
            counts["one_winner"] += 1
        if len(losers) == 1 and "CheckpointExistsError" in results[losers[0]][1]:
            counts["loser_failed_cleanly"] += 1
            counts["lost_at_commit"] += "another save committed first" in results[losers[0]][1]
        names = files_of(path, options)
        save_ids = {n.rsplit("_", 1)[1].split(".")[0] for n in names if n.endswith(".distcp")}
        manifests = [n for n in names if n.startswith(".dmuon-manifest-")]
        if len(save_ids) != 1 or len(manifests) != 1:
            counts["mixed_commits"] += 1
        loaded = run_ranks(load_worker, 2, path, options)[0]
        assert winners, results
        assert max_abs_diff(loaded, results[winners[0]][1]) == 0.0
    reliability_report[f"concurrent_writers_{backend}" + ("_async" if kind == "async" else "")] = counts
    assert counts["one_winner"] == TRIALS
    assert counts["loser_failed_cleanly"] == TRIALS
    assert counts["mixed_commits"] == 0
