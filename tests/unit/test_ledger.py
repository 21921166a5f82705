"""The goodput ledger's fold (pure logic: event dicts in, seconds out)."""

from __future__ import annotations

import pytest

from elaunch.agent.ledger import CATEGORIES, Ledger, ledger_of, ledgers


def ev(t: float, kind: str, node: str = "a", **fields) -> dict:
    return {"time": t, "kind": kind, "node": node, "host": "h", "round": 0, **fields}


def start(t0: float = 0.0, node: str = "a", step=None) -> list[dict]:
    """join at t0, complete +1, started +2, training +3."""
    return [ev(t0, "rendezvous_join", node), ev(t0 + 1, "rendezvous_complete", node),
            ev(t0 + 2, "workers_started", node), ev(t0 + 3, "training", node, step=step)]


def fold(events, now):
    led = Ledger()
    for e in events:
        led.observe(e)
    return led, led.seconds(now)


def only(**nonzero) -> dict:
    return {c: pytest.approx(nonzero.get(c, 0.0)) for c in CATEGORIES}


def test_empty_ledger_has_every_category_and_no_goodput():
    led = Ledger()
    assert led.seconds(100.0) == dict.fromkeys(CATEGORIES, 0.0)
    assert led.goodput(100.0) is None
    assert ledger_of([]) == {"seconds": dict.fromkeys(CATEGORIES, 0.0), "goodput": None}


def test_clean_run_is_rendezvous_starting_then_productive_until_the_end():
    events = start() + [ev(13, "worker_exited", step=100), ev(13, "job_succeeded", restarts=0)]
    led, s = fold(events, now=50.0)
    assert s == only(rendezvous=1, starting=2, productive=10)
    assert led.goodput(50.0) == pytest.approx(10 / 13)
    assert led.end == 13  # nothing after the node's job end counts, whatever now says
    assert led.seconds(1000.0) == s


def test_live_seconds_sum_to_now_minus_first_event():
    led, s = fold(start(), now=20.0)
    assert sum(s.values()) == pytest.approx(20.0)
    assert s["productive"] == pytest.approx(17.0)


def test_restart_mid_run_restores_until_caught_up():
    events = start(step=1) + [
        ev(10, "worker_exited", exitcode=1, step=50),
        ev(10, "restart", cause="failure", step=50),
        *start(11, step=40),  # join 11, complete 12, started 13, training 14 (resumed from a checkpoint at 40)
        ev(20, "caught_up", step=50),
    ]
    _, s = fold(events, now=30.0)
    # productive 3..10 and 20..30; stopped 10..11; rendezvous 0..1, 11..12; starting 1..3, 12..14; restoring 14..20
    assert s == only(productive=17, stopped=1, rendezvous=2, starting=4, restoring=6)


def test_caught_up_at_training_time_means_no_restoring():
    events = start(step=1) + [ev(10, "worker_exited", step=5), *start(11, step=5), ev(14, "caught_up", step=5)]
    _, s = fold(events, now=20.0)
    assert s["restoring"] == 0.0
    assert s["productive"] == pytest.approx(7 + 6)


def test_without_steps_restoring_ends_at_training():
    events = start() + [ev(10, "worker_exited", step=None), ev(10, "restart", step=None), *start(11)]
    _, s = fold(events, now=20.0)
    assert s == only(productive=7 + 6, stopped=1, rendezvous=2, starting=4)


def test_another_failure_before_catching_up_keeps_the_next_group_behind():
    events = start(step=1) + [ev(10, "worker_exited", step=50), *start(11, step=40),
                              ev(16, "worker_exited", step=45), *start(17, step=40), ev(25, "caught_up", step=50)]
    _, s = fold(events, now=25.0)
    assert s["restoring"] == pytest.approx((16 - 14) + (25 - 20))


def test_hang_moves_quiet_time_from_productive_to_hung_until_the_group_stops():
    events = start() + [ev(20, "hang", ranks=[0], culprit=None, stuck=False, quiet_seconds=5.0),
                        ev(22, "worker_exited", exitcode=-15, step=None), ev(22, "restart", step=None),
                        ev(23, "job_failed")]
    led, s = fold(events, now=23.0)
    assert s == only(rendezvous=1, starting=2, productive=12, hung=7, stopped=1)
    assert [seg[2] for seg in led.segments(23.0)] == ["rendezvous", "starting", "productive", "hung", "stopped"]


def test_hang_quiet_longer_than_training_leaves_starting_time_alone():
    events = start() + [ev(6, "hang", quiet_seconds=100.0)]
    led, s = fold(events, now=8.0)
    assert s == only(rendezvous=1, starting=2, hung=5)


def test_hang_inside_restoring_time_is_hung():
    events = start(step=1) + [ev(10, "worker_exited", step=50), *start(11, step=1), ev(20, "hang", quiet_seconds=2)]
    _, s = fold(events, now=20.0)
    assert s["restoring"] == pytest.approx(4)  # 14..18
    assert s["hung"] == pytest.approx(2)


def test_hang_while_no_group_runs_changes_nothing():
    events = start() + [ev(10, "worker_exited"), ev(11, "hang", quiet_seconds=5)]
    _, s = fold(events, now=12.0)
    assert s["hung"] == 0.0


def test_worker_exited_written_late_cuts_the_running_segment_at_its_time():
    # the agent writes worker_exited when the group ended: its time can be before the previous line's
    events = start() + [ev(12, "restart", step=None), ev(10, "worker_exited", step=None)]
    _, s = fold(events, now=13.0)
    assert s["productive"] == pytest.approx(9)  # 3..12: restart's line came first and stopped the group
    events = start() + [ev(10, "worker_exited", step=None), ev(9.5, "worker_exited", step=None)]
    _, s = fold(events, now=13.0)
    assert sum(s.values()) == pytest.approx(13.0)  # never negative, never double-counted
    events = start() + [ev(12, "hang", quiet_seconds=1.0), ev(11, "worker_exited", exitcode=-15, step=None)]
    _, s = fold(events, now=13.0)
    assert s == only(rendezvous=1, starting=2, productive=8, hung=1, stopped=1)  # stopped from 12, the hang's line


def test_restart_logged_after_the_next_round_formed_does_not_stop_the_new_group():
    # another node failed: this node logs the job's restart once the next round formed
    events = start() + [ev(10, "worker_exited", exitcode=-15, step=None), *start(11)[:2],
                        ev(12.5, "restart", step=None), ev(13, "workers_started"), ev(14, "training")]
    _, s = fold(events, now=20.0)
    assert s == only(rendezvous=2, starting=2 + 2, productive=7 + 6, stopped=1)


def test_first_event_not_a_join_counts_as_stopped_until_a_transition():
    led, s = fold([ev(0, "notice", signal="SIGUSR1"), ev(4, "rendezvous_join")], now=5.0)
    assert s == only(stopped=4, rendezvous=1)
    assert led.start == 0


def test_unknown_kinds_and_extra_fields_are_ignored():
    events = start() + [ev(5, "checkpoint_persisted", step=3), ev(6, "whatever", x=1)]
    _, s = fold(events, now=10.0)
    assert s["productive"] == pytest.approx(7)


def test_node_not_needed_ends_the_node_during_rendezvous():
    events = [ev(0, "rendezvous_join"), ev(3, "node_not_needed", reason="surplus")]
    led, s = fold(events, now=100.0)
    assert s == only(rendezvous=3)
    assert led.goodput(100.0) == 0.0


def test_ledger_of_a_dead_agents_log_ends_at_its_last_event_unless_now_is_given():
    events = start() + [ev(9, "checkpoint_persisted", step=1)]  # then kill -9: no end event
    assert ledger_of(events)["seconds"]["productive"] == pytest.approx(6)
    assert ledger_of(events, now=13.0)["seconds"]["productive"] == pytest.approx(10)


def test_ledger_of_sums_nodes_for_the_job_goodput():
    a = start(0, "a") + [ev(13, "job_succeeded", "a")]  # 10 of 13 productive
    b = start(0, "b") + [ev(5, "worker_exited", "b"), ev(5, "restart", "b"), ev(6, "rendezvous_join", "b"),
                         ev(13, "job_failed", "b")]  # 2 of 13
    mixed = sorted(a + b, key=lambda e: e["time"])
    out = ledger_of(mixed)
    assert out["seconds"]["productive"] == pytest.approx(12)
    assert sum(out["seconds"].values()) == pytest.approx(26)
    assert out["goodput"] == pytest.approx(12 / 26)
    per = ledgers(mixed)
    assert set(per) == {"a", "b"} and per["b"].goodput(99) == pytest.approx(2 / 13)


def test_the_ledger_loads_without_the_agent():
    import subprocess
    import sys

    code = ("import sys, elaunch.agent.ledger, elaunch.timeline.model\n"
            "print(sorted(m for m in sys.modules if m.startswith(('elaunch.agent.', 'elaunch.rendezvous', 'torch'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "['elaunch.agent.ledger']"  # status and timeline read it: the agent stays unloaded
