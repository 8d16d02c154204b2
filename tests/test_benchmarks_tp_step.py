"""The tensor-parallel optimizer-step benchmark (benchmarks/tp_step.py) at its quick size: what
it reports that no noise can move. dmuon orthogonalises each matrix once in the job, its step
takes the same collectives (two) at 1 block and at 4, and its weights after the steps are the
gather-everywhere baseline's within 1e-5. Timings are printed by the benchmark, never asserted."""

from __future__ import annotations

import os
import sys

BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
sys.path.insert(0, BENCHMARKS)

import tp_step  # noqa: E402


def test_quick_run_structure():
    reports = tp_step.run(tp_step.QUICK, [1, 4], repeats=1, warmup=2)
    assert [r["matrices_in_model"] for r in reports] == [8, 29]
    calls = []
    for rep in reports:
        ours, theirs = rep["table"]["dmuon"], rep["table"]["gather-everywhere"]
        assert ours["ns_per_job"] == 1.0 and theirs["ns_per_job"] == 4.0  # 4 ranks each do every matrix
        assert ours["same_collectives_on_every_rank"]
        assert ours["collectives_per_step"] <= 8, ours["collectives_by_name"]
        calls.append(ours["collectives_by_name"])
        # the baseline's all-gathers grow with the matrices: the counter sees DTensor's collectives
        assert theirs["collectives_per_step"] >= rep["matrices_in_model"]
        assert max(rep["largest_relative_difference_from_dmuon"].values()) <= 1e-5
        assert rep["targets"]["ns_per_job_1x"] and rep["targets"]["collectives_le_8"]
        assert rep["targets"]["weights_agree_1e-5"]
    assert calls[0] == calls[1]  # whatever the number of matrices
