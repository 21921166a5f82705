"""elaunch.agent.metrics: events -> metric values, and the gauges read at scrape time (pure: no server, no agent).

The real agent behind a real ``/metrics`` is in tests/integration/test_metrics.py.
"""

from __future__ import annotations

import sys

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from elaunch.agent.ledger import CATEGORIES, ledger_of
from elaunch.agent.metrics import CAUSES, AgentMetrics
from elaunch.checkpoint.keeper import NodeSnapshot as Snapshot

L = {"run_id": "job", "node": "n1", "role": "trainer"}


def ev(t: float, kind: str, **fields) -> dict:
    return {"time": t, "kind": kind, "node": "n1", "host": "h", "round": 0, **fields}


def value(m: AgentMetrics, name: str, **labels) -> float | None:
    return m.registry.get_sample_value(name, {**L, **labels})


def metrics(now: float = 100.0, **kw) -> AgentMetrics:
    return AgentMetrics("job", "n1", "trainer", clock=lambda: now, **kw)


def test_every_counter_is_exported_at_zero_before_any_event():
    m = metrics()
    for cause in CAUSES:
        assert value(m, "elaunch_restarts_total", cause=cause) == 0
    for name in ("elaunch_rendezvous_rounds_total", "elaunch_membership_changes_total", "elaunch_node_losses_total",
                 "elaunch_hang_verdicts_total", "elaunch_rendezvous_duration_seconds_count",
                 "elaunch_inprocess_restarts_total"):
        assert value(m, name) == 0, name
    for state in ("running", "succeeded", "failed", "stopped"):
        assert value(m, "elaunch_workers", state=state) == 0
    assert value(m, "elaunch_goodput_ratio") is None  # no time has passed


@pytest.mark.parametrize("events, name, labels, expected", [
    ([ev(1, "restart", cause="failure", counted=True)], "elaunch_restarts_total", {"cause": "failure"}, 1),
    ([ev(1, "restart", cause="failure"), ev(2, "restart", cause="membership")],
     "elaunch_restarts_total", {"cause": "membership"}, 1),
    ([ev(1, "restart", cause="node_lost", counted=False)], "elaunch_restarts_total", {"cause": "node_lost"}, 1),
    ([ev(1, "rendezvous_complete", seconds=0.3), ev(5, "rendezvous_complete", seconds=40.0)],
     "elaunch_rendezvous_rounds_total", {}, 2),
    ([ev(1, "rendezvous_complete", seconds=0.3), ev(5, "rendezvous_complete", seconds=40.0)],
     "elaunch_rendezvous_duration_seconds_sum", {}, 40.3),
    ([ev(1, "rendezvous_complete", seconds=0.3), ev(5, "rendezvous_complete", seconds=40.0)],
     "elaunch_rendezvous_duration_seconds_bucket", {"le": "0.5"}, 1),
    ([ev(1, "rendezvous_complete", seconds=0.3), ev(5, "rendezvous_complete", seconds=40.0)],
     "elaunch_rendezvous_duration_seconds_bucket", {"le": "60.0"}, 2),
    ([ev(1, "membership_change", came=["c"], left=["a", "b"], world_size=2)], "elaunch_membership_changes_total", {}, 1),
    ([ev(1, "membership_change", came=["c"], left=["a", "b"], world_size=2)], "elaunch_node_losses_total", {}, 2),
    ([ev(1, "membership_change", came=["c"], left=[], world_size=3)], "elaunch_node_losses_total", {}, 0),
    ([ev(1, "hang", ranks=[0], culprit=0, stuck=False), ev(9, "hang", ranks=[1], culprit=1, stuck=True)],
     "elaunch_hang_verdicts_total", {}, 2),
    ([ev(1, "inprocess_restart", kept=[0, 2], started=[1], seconds=0.04)], "elaunch_inprocess_restarts_total", {}, 1),
    ([ev(1, "notice", signal="SIGUSR1"), ev(2, "no_such_kind")], "elaunch_restarts_total", {"cause": "failure"}, 0),
])
def test_events_map_to_counters(events, name, labels, expected):
    m = metrics()
    for e in events:
        m.observe(e)
    assert value(m, name, **labels) == pytest.approx(expected)


def test_workers_by_state_follow_the_last_group_and_the_live_exit_codes():
    codes: dict[int, int | None] = {0: None, 1: None}
    m = metrics(exit_codes=lambda: codes)
    m.observe(ev(1, "workers_started", attempt=0, ranks=[0, 1], local_ranks=[0, 1], pids=[5, 6], master="m:1"))
    assert m.worker_states() == {"running": 2, "succeeded": 0, "failed": 0, "stopped": 0}
    codes[1] = 3  # rank 1 crashed; the agent has not stopped the group yet
    assert m.worker_states() == {"running": 1, "succeeded": 0, "failed": 1, "stopped": 0}
    m.observe(ev(2, "worker_exited", rank=1, local_rank=1, pid=6, exitcode=3, signal=None, stopped=False))
    m.observe(ev(2, "worker_exited", rank=0, local_rank=0, pid=5, exitcode=-15, signal="SIGTERM", stopped=True))
    assert m.worker_states() == {"running": 0, "succeeded": 0, "failed": 1, "stopped": 1}
    codes.update({0: None, 1: None})  # the next group: a new start resets the states
    m.observe(ev(3, "workers_started", attempt=1, ranks=[0, 1], local_ranks=[0, 1], pids=[7, 8], master="m:1"))
    codes[0] = 0
    assert value(m, "elaunch_workers", state="running") == 1
    assert value(m, "elaunch_workers", state="succeeded") == 1


def test_progress_gauges_per_local_rank_only_once_reported():
    m = metrics(progress=lambda: {0: (1.5, 120), 1: (None, None), 2: (0.2, None)})
    assert value(m, "elaunch_progress_age_seconds", local_rank="0") == 1.5
    assert value(m, "elaunch_progress_age_seconds", local_rank="1") is None  # never called progress()
    assert value(m, "elaunch_progress_age_seconds", local_rank="2") == 0.2
    assert value(m, "elaunch_progress_step", local_rank="0") == 120
    assert value(m, "elaunch_progress_step", local_rank="2") is None  # progress() without a step


@pytest.mark.parametrize("snap, step, age, lag", [
    (None, None, None, None),  # in-memory checkpoints off
    (Snapshot(), None, None, None),  # nothing saved yet
    (Snapshot(step=40, time=97.0), 40, 3.0, None),  # without --checkpoint-dir
    (Snapshot(step=40, time=97.0, persisted_time=90.0), 40, 3.0, 7.0),
])
def test_snapshot_gauges(snap, step, age, lag):
    m = metrics(snapshot=lambda: snap)
    assert value(m, "elaunch_snapshot_step") == step
    assert value(m, "elaunch_snapshot_age_seconds") == age
    assert value(m, "elaunch_snapshot_persist_lag_seconds") == lag


JOB = [ev(0, "rendezvous_join"), ev(2, "rendezvous_complete", seconds=2.0),
       ev(2, "workers_started", attempt=0, ranks=[0], local_ranks=[0], pids=[5], master="m:1"),
       ev(4, "training", step=None), ev(30, "hang", ranks=[0], culprit=0, stuck=False, quiet_seconds=10.0)]


def test_ledger_counters_and_goodput_are_the_ledgers():
    m = metrics(now=40.0)
    for e in JOB:
        m.observe(e)
    expected = ledger_of(JOB, now=40.0)
    for cat in CATEGORIES:
        assert value(m, "elaunch_ledger_seconds_total", category=cat) == pytest.approx(expected["seconds"][cat])
    assert value(m, "elaunch_goodput_ratio") == pytest.approx(expected["goodput"])


def test_ledger_counters_never_go_down_when_a_hang_moves_productive_seconds():
    now = [25.0]
    m = AgentMetrics("job", "n1", "trainer", clock=lambda: now[0])
    for e in JOB[:-1]:
        m.observe(e)
    assert value(m, "elaunch_ledger_seconds_total", category="productive") == pytest.approx(21.0)  # 4..25
    now[0] = 30.0
    m.observe(JOB[-1])  # the verdict moves 20..30 to hung: the ledger's productive is 16 s now
    assert value(m, "elaunch_ledger_seconds_total", category="productive") == pytest.approx(21.0)  # stays flat
    assert value(m, "elaunch_ledger_seconds_total", category="hung") == pytest.approx(10.0)
    assert value(m, "elaunch_goodput_ratio") == pytest.approx(16.0 / 30.0)  # the gauge is exact


def test_the_exposition_parses_with_the_names_and_types_of_the_contract():
    m = metrics(progress=lambda: {0: (0.5, 3)}, snapshot=lambda: Snapshot(3, 99.0, 98.0))
    for e in JOB:
        m.observe(e)
    m.observe(ev(31, "restart", cause="failure"))
    m.observe(ev(32, "straggler", named=[{"rank": 1}], cleared=[], stragglers=[1]))
    types = {f.name: f.type for f in text_string_to_metric_families(generate_latest(m.registry).decode())}
    assert types == {"elaunch_straggler": "gauge",
        "elaunch_restarts": "counter", "elaunch_rendezvous_rounds": "counter",
        "elaunch_rendezvous_duration_seconds": "histogram", "elaunch_membership_changes": "counter",
        "elaunch_node_losses": "counter", "elaunch_hang_verdicts": "counter", "elaunch_workers": "gauge",
        "elaunch_inprocess_restarts": "counter",
        "elaunch_progress_age_seconds": "gauge", "elaunch_progress_step": "gauge", "elaunch_snapshot_step": "gauge",
        "elaunch_snapshot_age_seconds": "gauge", "elaunch_snapshot_persist_lag_seconds": "gauge",
        "elaunch_ledger_seconds": "counter", "elaunch_goodput_ratio": "gauge",
    }


def test_progress_sampler_dates_each_counter_move_and_reports_steps(tmp_path):
    from elaunch.procs.progress_files import ProgressFiles
    from elaunch.agent.progress_sampler import ProgressSampler

    words = {}  # what a worker's elaunch.progress() writes: the counter, and the step + 1 at offset 16
    now = [10.0]
    with ProgressFiles(range(2), base_dir=str(tmp_path)) as files:
        def write(lr: int, counter: int, step: int | None = None) -> None:
            with open(files.progress_file(lr), "r+b") as f:
                f.write(counter.to_bytes(8, sys.byteorder))
                if step is not None:
                    f.seek(16)
                    f.write((step + 1).to_bytes(8, sys.byteorder))
            words[lr] = counter

        sampler = ProgressSampler(lambda: files, clock=lambda: now[0])
        assert sampler.table() == {0: (None, None), 1: (None, None)}  # no call yet: no age
        write(0, 1, step=7)
        now[0] = 12.0
        assert sampler.table() == {0: (0.0, 7), 1: (None, None)}
        now[0] = 15.5  # rank 0 quiet since 12.0
        write(1, 4)
        assert sampler.table() == {0: (3.5, 7), 1: (0.0, None)}
        files.reset()  # the next group: zeroed counters have no age
        assert sampler.table() == {0: (None, None), 1: (None, None)}
    assert sampler.table() == {0: (None, None), 1: (None, None)}  # closed files: the last look stays, no error


def test_watch_gives_the_sampler_thread_to_the_supervisor_which_stops_it_and_never_wakes_the_monitor():
    from elaunch.agent.events import EventLog
    from elaunch.supervision import Supervisor

    class Files:
        looks = 0

        def read(self):
            Files.looks += 1
            return {0: Files.looks}

        def steps(self):
            return {0: None}

    sup = Supervisor()
    m = metrics()
    m.watch(EventLog(None, "n1", "h"), "n1", sup, progress_files=Files)
    [entry] = sup._entries
    thread = entry.helper
    assert thread.name == "progress sampler" and thread.is_alive()
    assert not sup.polls  # a dead sampler waits for the monitor's next look: no wake-up every interval
    assert value(m, "elaunch_progress_age_seconds", local_rank="0") is not None  # the scrape reads through it
    sup.close()
    assert not thread.is_alive()
    m.close()


def test_keeper_snapshot_facts_newest_slot_and_the_persisted_steps_commit(tmp_path):
    from elaunch.checkpoint.keeper import CheckpointKeeper
    from elaunch.agent.events import AgentEvents
    from elaunch.checkpoint import slotfile
    from tests.unit.test_checkpoint_keeper import Launcher, write_slot

    k = CheckpointKeeper("job/1", 0, None, 60.0, lambda: None, root=str(tmp_path))
    assert k.snapshot_facts() is None  # not opened: in-memory checkpoints off
    k.open(Launcher(), AgentEvents(None, "n0", "host", 0))
    try:
        assert k.snapshot_facts() == Snapshot(None, None, None)  # nothing saved yet
        write_slot(slotfile.slot_paths(k.node_dir.path, 0)[0], step=3, rank=0, world_size=2)
        write_slot(slotfile.slot_paths(k.node_dir.path, 1)[0], step=3, rank=1, world_size=2)
        write_slot(slotfile.slot_paths(k.node_dir.path, 0)[1], step=4, rank=0, world_size=2)
        infos = {(i.step, i.rank): i.time for i in slotfile.inventory(k.node_dir.path, ("slots",))}
        facts = k.snapshot_facts()
        assert (facts.step, facts.time, facts.persisted_time) == (4, infos[4, 0], None)

        class Persister:  # what _report_persisted reads of the persister child: its finished persists
            def poll_done(self):
                return [(3, "/ckpt/step_3", 0.25)]

        k._report_persisted(Persister())
        assert k.snapshot_facts().persisted_time == max(infos[3, 0], infos[3, 1])
    finally:
        k.close()


def test_straggler_gauge_follows_the_events_and_a_new_group_clears_it():
    m = metrics()
    assert value(m, "elaunch_straggler", rank="3") is None  # no family before a straggler event
    m.observe(ev(1, "straggler", named=[{"rank": 3}], cleared=[], stragglers=[3]))
    assert value(m, "elaunch_straggler", rank="3") == 1
    m.observe(ev(2, "straggler", named=[{"rank": 5}], cleared=[3], stragglers=[5]))
    assert (value(m, "elaunch_straggler", rank="3"), value(m, "elaunch_straggler", rank="5")) == (0, 1)
    m.observe(ev(3, "workers_started", attempt=1, ranks=[0], local_ranks=[0], pids=[5], master="m:1"))
    assert value(m, "elaunch_straggler", rank="5") is None
