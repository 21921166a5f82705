"""benchmarks.fsdp2_dcp's reading of a faulty run's own steps (pure bookkeeping, crafted journals)."""

from __future__ import annotations

import pytest

from benchmarks.fsdp2_dcp import fault_costs

T = 1000.0  # the run's start


def _steps(attempt, first, last, at, step_s=1.0, ranks=2, skew=0.01):
    """Every rank's "step" records of ``attempt`` for steps first..last, step ``first`` ending at ``T + at``."""
    return [{"event": "step", "attempt": attempt, "rank": r, "step": s,
             "time": T + at + (s - first) * step_s + r * skew} for s in range(first, last + 1) for r in range(ranks)]


def _rounds(*starts):
    return {a: {"attempt": a, "step": step, "t": t} for a, (step, t) in enumerate(starts)}


def test_a_fault_costs_the_time_from_the_restored_steps_end_to_the_next_less_a_step():
    # steps 0-9 end at 5..14 s; a kill at 14.6 s; attempt 1 restored step 9 at 15.1 s and ends step 10 at 16.3 s
    recs = _steps(0, 0, 9, 5.0) + _steps(1, 10, 19, 16.3)
    got = fault_costs(recs, _rounds((None, 4.0), (9, 15.1)), T, [{"t": 14.6}])
    assert got["step_s"] == pytest.approx(1.0)
    # step 9 ended at 14.01 (its last rank), step 10 at 16.31: 2.3 s, less one step
    assert got["fault_costs_s"] == [pytest.approx(1.3)]
    assert got["goodput_in_run"] == pytest.approx(1 - 1.3 / (25.31 - 0.0))


def test_a_lost_step_counts_from_the_step_restored_not_the_last_one_begun():
    # the kill came after step 9 ended on one rank only: the job restored step 8 and redid step 9
    recs = _steps(0, 0, 8, 5.0) + [{"event": "step", "attempt": 0, "rank": 0, "step": 9, "time": T + 14.0}]
    recs += _steps(1, 9, 12, 15.8)
    got = fault_costs(recs, _rounds((None, 4.0), (8, 14.9)), T, [{"t": 14.2}])
    assert got["fault_costs_s"] == [pytest.approx(15.81 - 13.01 - 1.0)]


def test_a_fault_before_the_restored_step_ended_again_has_no_cost_and_no_estimate():
    recs = _steps(0, 0, 5, 5.0) + _steps(2, 6, 9, 30.0)  # attempt 1 never ended a step: a second fault came
    got = fault_costs(recs, _rounds((None, 4.0), (5, 12.0), (5, 29.0)), T, [{"t": 10.5}, {"t": 13.0}])
    assert got["fault_costs_s"][0] is None and got["goodput_in_run"] is None
    assert got["fault_costs_s"][1] == pytest.approx(30.01 - 10.01 - 1.0)  # from step 5's end in attempt 0


def test_no_step_records_is_no_estimate():
    assert fault_costs([], {}, T, [{"t": 3.0}]) == {"step_s": None, "fault_costs_s": [], "goodput_in_run": None}
