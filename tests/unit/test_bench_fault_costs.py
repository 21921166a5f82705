"""benchmarks.fsdp2_dcp's reading of a faulty run's own steps (pure bookkeeping, crafted journals)."""

from __future__ import annotations

import pytest

from benchmarks.fsdp2_dcp import fault_costs, window_costs

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


def test_an_in_process_node_replacement_is_read_over_a_window_of_steps():
    """The journal's attempt stays 0 (a membership change); the replacement's ranks start with new pids.
    fault_costs reads nothing; window_costs reads the delay of the steps after the kill, slow ones included."""
    starts = [{"event": "start", "attempt": 0, "rank": r, "world_size": 2, "step": None, "pid": 10 + r,
               "time": T + 4.0} for r in range(2)]
    new = [{"event": "start", "attempt": 0, "rank": 1, "world_size": 2, "step": 9, "pid": 20, "time": T + 20.0}]
    steps = _steps(0, 0, 9, 5.0)  # steps 0-9 end at 5..14 s
    steps = [dict(r, pid=10 + r["rank"]) for r in steps]
    after = [dict(r, pid=10 if r["rank"] == 0 else 20) for r in _steps(0, 10, 60, 22.0)]
    after = [dict(r, time=r["time"] + 0.8) if r["step"] >= 11 else r for r in after]  # step 11 took 1.8 s
    recs = starts + steps + new + after
    rounds = {0: {"attempt": 0, "step": None, "t": 4.0}}
    assert fault_costs(recs, rounds, T, [{"t": 14.5}])["fault_costs_s"] == [None]
    got = window_costs(recs, T, [{"t": 14.5}])
    # step 9 ended at 14.01, step 10 at 22.01 (7 s late), step 11 0.8 s later than a step: 7.8 s
    assert got["fault_costs_window_s"] == [pytest.approx(7.8, abs=0.02)]
    assert got["goodput_in_run_window"] == pytest.approx(1 - 7.8 / (72.81 - 0.0), abs=1e-3)
    shrunk = [dict(r, world_size=1) if r["event"] == "start" and r["pid"] == 20 else r for r in recs]
    assert window_costs(shrunk, T, [{"t": 14.5}])["fault_costs_window_s"] == [None]  # steps renumbered
    assert window_costs([], T, [{"t": 1.0}]) == {"fault_costs_window_s": [None], "goodput_in_run_window": None}
