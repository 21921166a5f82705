"""The straggler decision (elaunch.agent.stragglers) as tables, on a simulated synchronous job.

The simulation: each step ends with a collective that releases every rank when the last one
arrives; each rank's own work (after the collective, before its ``progress()`` call, and before
the next collective) is drawn per step. At each sample instant every rank stamps its first
call after the instant, as ``ProgressFiles.ask_stamps`` / ``stamps`` do.
"""

from __future__ import annotations

import random

import pytest

from elaunch.agent.stragglers import (
    SAMPLES_PER_WINDOW,
    Sample,
    StragglerState,
    doc_of,
    judge,
    samples_from_doc,
    window_lateness,
)
from elaunch.features.stragglers import DEFAULT_FACTOR, DEFAULT_WINDOWS

WINDOW = 10.0
PERIOD = WINDOW / SAMPLES_PER_WINDOW
T0 = 1_800_000_000.0  # a wall-clock time, as the stamps carry


def simulate(ranks: int, seconds: float, work, seed: int = 0, pre: float = 0.0):
    """Call times per rank: ``work(rank, t, rng)`` seconds after each collective; ``pre`` before the next.

    Returns rank -> list of call times (index = step).
    """
    rng = random.Random(seed)
    calls = {r: [] for r in range(ranks)}
    released = T0
    while released < T0 + seconds:
        done = {r: released + work(r, released - T0, rng) for r in range(ranks)}
        for r, t in done.items():
            calls[r].append(t)
        released = max(done.values()) + pre + 0.002  # the collective: the last arrival, plus its own time
    return calls


def stamps(calls, window: int, step_offset: dict[int, int] | None = None):
    """Rank -> the window's samples, as the watch takes them: asked at every instant, a request is answered
    by the rank's next call and tagged with the last instant before that call (a pending request is asked
    again, and the call answers the newer one)."""
    out = {}
    lo, hi = window * SAMPLES_PER_WINDOW, (window + 1) * SAMPLES_PER_WINDOW
    for r, times in calls.items():
        rows, prev = [], float("-inf")
        for k, t in enumerate(times):
            last_instant = int((t - T0) // PERIOD)
            if T0 + last_instant * PERIOD > prev and lo <= last_instant < hi:  # an instant passed since the last call
                rows.append(Sample(last_instant, k + (step_offset or {}).get(r, 0), t))
            prev = t
        out[r] = rows
    return out


def run(calls, windows: int, **kw):
    """The named set after each window."""
    state, named = StragglerState(), []
    for w in range(windows):
        state = judge(state, window_lateness(stamps(calls, w, kw.get("step_offset"))))
        named.append(sorted(state.named))
    return named


def jitter(base: float):
    return lambda r, t, rng: base * rng.uniform(0.8, 1.2)


def slow(rank: int, factor: float, base: float = 0.2, after: float = 0.0, until: float = 1e9, spread: float = 0.0):
    def work(r, t, rng):
        w = base * (rng.uniform(1 - spread, 1 + spread) if spread else 1.0)
        return w * factor if r == rank and after <= t < until else w
    return work


@pytest.mark.parametrize("ranks", [2, 3, 8])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_jitter_of_20_percent_names_nobody(ranks, seed):
    calls = simulate(ranks, 12 * WINDOW, jitter(0.2), seed)
    assert run(calls, 12) == [[]] * 12


@pytest.mark.parametrize("ranks, rank, factor, expected", [
    # a steady 2x from the start: named after DEFAULT_WINDOWS windows, and stays named
    (3, 2, 2.0, [[], [2], [2], [2]]),
    (8, 5, 2.0, [[], [5], [5], [5]]),
    (2, 0, 2.0, [[], [0], [0], [0]]),  # two ranks: the late one, not its partner
    (3, 1, 1.5, [[], [1], [1], [1]]),  # its own work 1.5x: late by a third of a step
    (3, 1, 1.2, [[], [], [], []]),  # 1.2x steadily: late by a sixth of a step, under the factor
])
def test_a_steady_slow_rank_is_named_after_windows_in_a_row(ranks, rank, factor, expected):
    assert DEFAULT_WINDOWS == 2 and DEFAULT_FACTOR == 0.25
    calls = simulate(ranks, 4 * WINDOW, slow(rank, factor, spread=0.2))
    assert run(calls, 4) == expected


def test_slowed_mid_window_is_named_within_three_windows():
    calls = simulate(3, 6 * WINDOW, slow(2, 2.0, after=2.5 * WINDOW, spread=0.2))
    named = run(calls, 6)
    assert named[:2] == [[], []] and named[4] == [2]  # the slowdown began in window 2: named by window 4's end


def test_one_slow_window_names_nobody_and_a_recovered_rank_is_cleared():
    one = simulate(3, 4 * WINDOW, slow(0, 3.0, after=WINDOW, until=2 * WINDOW))
    assert run(one, 4) == [[], [], [], []]
    recovered = simulate(3, 5 * WINDOW, slow(0, 3.0, until=2 * WINDOW))
    assert run(recovered, 5) == [[], [0], [], [], []]


def test_work_before_the_collective_is_invisible():
    """The documented limit: a rank slow only before the collective leaves no trace in when anyone reports."""
    def work(r, t, rng):
        return 0.05  # the same work after the collective on every rank
    calls = simulate(3, 3 * WINDOW, work, pre=0.2)  # (pre: the slow rank's extra work makes everyone wait)
    assert run(calls, 3) == [[], [], []]


def test_steps_numbered_apart_are_skipped_and_too_few_samples_are_not_judged():
    calls = simulate(3, 3 * WINDOW, slow(2, 3.0))
    assert run(calls, 3, step_offset={2: 1000}) == [[], [], []]  # rank 2 numbers its steps 1000 ahead
    late = window_lateness({r: s[:2] for r, s in stamps(calls, 0).items()})
    assert late.lateness == {} and late.step_time is not None


def test_no_steps_no_verdict():
    still = {r: [Sample(i, 7, T0 + r * 0.01) for i in range(20)] for r in range(3)}
    assert window_lateness(still).step_time is None
    kept = StragglerState({1: 3}, frozenset({1}))  # no new step (a pause, the job's end): no evidence either way
    assert judge(kept, window_lateness(still)) == kept


def test_lateness_values_and_the_exchanged_document_round_trip():
    calls = simulate(3, WINDOW, slow(1, 2.0))
    samples = stamps(calls, 0)
    late = window_lateness(samples)
    assert late.step_time == pytest.approx(0.402, abs=0.01)
    assert late.lateness[1] == pytest.approx(0.5, abs=0.03)
    assert -0.3 < late.lateness[0] < 0 and -0.3 < late.lateness[2] < 0  # the others: median of the slow and a fast one
    base = T0
    doc = doc_of(samples, base)
    back = samples_from_doc(doc, base)
    assert window_lateness(back).lateness == pytest.approx(late.lateness, abs=1e-4)
    assert samples_from_doc({"ranks": {"x": [[1, 2, 3]], "4": "bad"}}, base) == {}
    assert samples_from_doc({"nothing": 1}, base) == {}


def test_settings_from_rdzv_conf():
    from elaunch.features.stragglers import StragglerSettings

    assert StragglerSettings.from_conf({}) == StragglerSettings(10.0, 0.25, 2, False)
    got = StragglerSettings.from_conf({"straggler_window": "3", "straggler_factor": "0.5", "straggler_windows": "3",
                                       "straggler_exclude": "1", "other": "x"})
    assert got == StragglerSettings(3.0, 0.5, 3, True) and got.on
    assert not StragglerSettings.from_conf({"straggler_window": "0"}).on


@pytest.mark.parametrize("key, value, message", [
    ("straggler_window", "-1", "--rdzv-conf straggler_window=-1: must be a number >= 0"),
    ("straggler_window", "ten", "--rdzv-conf straggler_window=ten: must be a number >= 0"),
    ("straggler_factor", "0", "--rdzv-conf straggler_factor=0: must be a number > 0"),
    ("straggler_factor", "nan", "--rdzv-conf straggler_factor=nan: must be a number > 0"),
    ("straggler_windows", "0", "--rdzv-conf straggler_windows=0: must be an integer >= 1"),
    ("straggler_windows", "1.5", "--rdzv-conf straggler_windows=1.5: must be an integer >= 1"),
    ("straggler_exclude", "yes", "--rdzv-conf straggler_exclude=yes: must be 0 or 1"),
])
def test_bad_settings_name_the_key_and_value(key, value, message):
    from elaunch.features.stragglers import StragglerSettings

    with pytest.raises(ValueError) as info:
        StragglerSettings.from_conf({key: value})
    assert str(info.value).startswith(message)


def test_ranks_that_do_not_run_in_step_are_not_judged():
    """No collective between the ranks: each at its own pace (one at half the others'); nobody is named."""
    calls = {r: [T0 + (k + 1) * (0.2 if r == 1 else 0.1) for k in range(400)] for r in range(3)}
    assert run(calls, 3) == [[], [], []]
    assert window_lateness(stamps(calls, 1)).lateness == {}


def test_a_window_without_enough_stamps_keeps_the_streak():
    from elaunch.agent.stragglers import WindowLateness

    state = StragglerState()
    for window, named in [({0: 0.0, 1: 0.6}, []), ({0: 0.0}, []), ({0: 0.0, 1: 0.6}, [1]), ({0: 0.0}, [1]),
                          ({0: 0.0, 1: 0.1}, [])]:
        state = judge(state, WindowLateness(0.2, window))
        assert sorted(state.named) == named, (window, state)


def test_the_watch_thread_is_the_run_supervisors_added_once_at_the_first_look_and_stopped_by_it():
    from types import SimpleNamespace

    from elaunch.agent.straggler_watch import StragglerWatch
    from elaunch.features.stragglers import StragglerSettings
    from elaunch.supervision import Supervisor

    sup = Supervisor()
    watch = StragglerWatch(StragglerSettings(window=600.0), lambda: None, lambda: None, None, "h", sup)
    group = SimpleNamespace(round=0, workers=[SimpleNamespace(local_rank=0, global_rank=0)])
    assert not watch.thread.is_alive()
    assert watch.poll(SimpleNamespace(group=group)) is None
    watch.poll(SimpleNamespace(group=group))  # once
    assert [e.helper for e in sup._entries] == [watch.thread] and watch.thread.is_alive()
    assert not sup.polls  # its death waits for the monitor's next look
    watch.close()  # the watchdog's close leaves the thread to the supervisor
    assert watch.thread.is_alive()
    sup.close()
    assert not watch.thread.is_alive()
