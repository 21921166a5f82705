"""EventLog's file handling and the timeline model's layout (pure logic; the real jobs are in integration)."""

from __future__ import annotations

import json
import logging
import os
import signal

import pytest

from elaunch.agent.events import AgentEvents, EventLog, came_and_left, event_echo, failure_fields
from elaunch.rendezvous.contract import FailureRecord, NodeInfo, RendezvousInfo
from elaunch.timeline.model import build, nice_ticks


def test_event_log_appends_lines_lazily(tmp_path):
    path = tmp_path / "events.jsonl"
    ev = EventLog(str(path), "n1", "h", clock=lambda: 100.0)
    assert not path.exists()  # opened on the first event
    ev.emit("a", x=1)
    ev.round = 3
    ev.emit("b", at=99.5)
    ev.close()
    ev.emit("dropped")
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert lines == [{"time": 100.0, "kind": "a", "node": "n1", "host": "h", "round": -1, "x": 1},
                     {"time": 99.5, "kind": "b", "node": "n1", "host": "h", "round": 3}]


def test_event_log_never_raises_and_warns_once(tmp_path, caplog):
    ev = EventLog(str(tmp_path / "gone" / "events.jsonl"), "n", "h")
    with caplog.at_level(logging.WARNING, logger="elaunch.agent"):
        ev.emit("a")
        ev.emit("b")
    assert len([r for r in caplog.records if "event log" in r.getMessage()]) == 1


def test_echo_gets_each_line_without_a_file():
    got = []
    ev = EventLog(None, "n", "h", echo=got.append, clock=lambda: 1.0)
    ev.emit("a")
    assert [json.loads(line) for line in got] == [{"time": 1.0, "kind": "a", "node": "n", "host": "h", "round": -1}]


@pytest.mark.parametrize("name, echoes", [("null", False), ("dynamic_rendezvous", False), ("console", True)])
def test_torch_handler_names(name, echoes):
    assert (event_echo(name) is not None) is echoes


def test_unknown_handler_name_is_a_value_error():
    with pytest.raises(ValueError, match="event_log_handler='nope'"):
        event_echo("nope")


def test_came_and_left_by_id_and_by_address():
    assert came_and_left(frozenset({"a", "b"}), frozenset({"b", "c"})) == (["c"], ["a"])
    assert came_and_left({"10.0.0.1": 2}, {"10.0.0.1": 1, "10.0.0.2": 1}) == (["10.0.0.2"], ["10.0.0.1"])


def test_failure_fields_drop_the_no_traceback_line():
    f = FailureRecord(round=0, at=1.0, host="h", rank=3, exitcode=-9,
                      message="To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html")
    assert failure_fields(f) == {"rank": 3, "host": "h", "exitcode": -9, "signal": "SIGKILL", "message": ""}


def _e(t, kind, **kw):
    return {"time": t, "kind": kind, "node": kw.pop("node", "n"), "host": "h", "round": kw.pop("round", 0), **kw}


def test_model_spans_and_marks():
    tl = build([
        _e(10, "rendezvous_join", round=-1), _e(11, "rendezvous_complete"),
        _e(11.5, "workers_started", ranks=[0, 1], local_ranks=[0, 1], pids=[5, 6]),
        _e(13, "worker_exited", rank=1, local_rank=1, pid=6, exitcode=1, stopped=False),
        _e(13.25, "worker_exited", rank=0, local_rank=0, pid=5, exitcode=-15, stopped=True),
        _e(13.5, "restart", counted=True, count=1, budget=1, failure={"rank": 1, "host": "h"}),
        _e(13.5, "rendezvous_join"), _e(14, "rendezvous_complete", round=1),
        _e(14, "membership_change", round=1, came=["x"], left=[]),
        _e(20, "job_succeeded", round=1, restarts=1), _e(12, "rendezvous_join", node="m", round=-1),
    ])
    assert tl.t0 == 10 and tl.end == 10 and [lane.node for lane in tl.lanes] == ["n", "m"]
    lane = tl.lanes[0]
    assert ("round", 1, 3.5, "r0", -1) in lane.spans and ("round", 4, 10, "r1", -1) in lane.spans
    assert ("worker_failed", 1.5, 3, "rank 1", 1) in lane.spans
    assert ("worker_stopped", 1.5, 3.25, "rank 0", 0) in lane.spans
    assert [m[0] for m in lane.marks] == ["failure", "restart", "membership", "job_succeeded"]
    assert tl.lanes[1].spans == [("rendezvous", 2, 2, "", -1)]  # still joining at its last event


def test_model_marks_the_node_check():
    tl = build([
        _e(10, "rendezvous_join", round=-1), _e(11, "rendezvous_complete"),
        _e(12.5, "node_check", seconds=1.5, faulty=[], sitting_out=[], nodes={"n": {"verdict": "ok"}}),
        _e(13, "rendezvous_join"), _e(14, "rendezvous_complete", round=1),
        _e(16, "node_check", round=1, seconds=2.0, faulty=["m"], sitting_out=["m"],
           nodes={"n": {"verdict": "ok"}, "m": {"verdict": "slow"}}),
    ])
    marks = [m for m in tl.lanes[0].marks]
    assert marks == [("node_ok", 2.5, "node check in 1.5 s: every node ok", -1),
                     ("node_faulty", 6, "node check in 2.0 s: m (slow, sits out)", -1)]


def test_model_marks_checkpoint_restores_and_persists():
    tl = build([
        _e(10, "rendezvous_join", round=-1), _e(11, "rendezvous_complete"),
        _e(11.25, "checkpoint_restore", step=41, sources={"0": "memory", "1": "peer", "2": "peer"}),
        _e(15, "checkpoint_persisted", step=60, path="/ck/step_000000000060", seconds=0.4321),
    ])
    assert tl.lanes[0].marks == [
        ("restore", 1.25, "restore of step 41: memory (rank 0), peer (ranks 1, 2)", -1),
        ("persisted", 5, "step 60 persisted in 0.43 s to /ck/step_000000000060", -1),
    ]


def test_nice_ticks():
    assert nice_ticks(16.0) == [0, 2, 4, 6, 8, 10, 12, 14, 16]
    assert nice_ticks(0.7)[:3] == [0, 0.1, 0.2]


def _info(round: int, restart_count: int | None):
    return RendezvousInfo(round, 0, 2, "127.0.0.1", 1, nodes=(NodeInfo("127.0.0.1", "default", 1),) * 2,
                          restart_count=restart_count)


def _restarts(path):
    return [(e["counted"], e["count"], e["cause"], e["failed_round"]) for e in
            (json.loads(line) for line in path.read_text().splitlines()) if e["kind"] == "restart"]


def test_a_failure_reported_elsewhere_is_logged_counted_only_when_the_jobs_count_rose(tmp_path):
    """Another node published its workers' failure of round 1, and the next round's restart count says whether
    that node counted it: risen, a counted failure; unchanged, not counted (that node's workers failed because a
    member node was lost, which its failure probe told it after it had published the failure)."""
    path = tmp_path / "events.jsonl"
    ev = AgentEvents(str(path), "n", "h", budget=3)
    ev.rendezvous_complete(_info(0, 0), None)
    ev.restart_after_rendezvous(FailureRecord(round=0, at=1.0, host="b", rank=1, exitcode=1))
    ev.rendezvous_complete(_info(1, 1), None)  # counted: 0 -> 1
    ev.restart_after_rendezvous(FailureRecord(round=1, at=2.0, host="b", rank=1, exitcode=1))
    ev.rendezvous_complete(_info(2, 1), None)  # not counted: still 1
    ev.close()
    assert _restarts(path) == [(True, 1, "failure", 0), (False, 1, "node_lost", 1)]


def test_a_failure_reported_elsewhere_without_an_earlier_count_is_logged_counted(tmp_path):
    """This node's first round, or a backend that keeps no count: nothing to compare, counted as before."""
    path = tmp_path / "events.jsonl"
    ev = AgentEvents(str(path), "n", "h", budget=3)
    ev.restart_after_rendezvous(FailureRecord(round=4, at=1.0, host="b", rank=1, exitcode=1))
    ev.rendezvous_complete(_info(5, 2), None)
    ev.close()
    assert _restarts(path) == [(True, 2, "failure", 4)]


def test_a_signal_landing_in_an_event_write_stops_the_agent_and_the_event_is_kept(tmp_path):
    """The agent's real handlers (SIGTERM -> SignalException); SIGTERM arrives while an event is written
    (inside its echo to --event-log-handler): the exception leaves ``emit``, as it would anywhere else.
    Before (SignalException an ``Exception``), the event log's ``except Exception`` for a failing user
    handler took it for one and dropped it, and the agent went on (a SIGTERMed agent kept its rendezvous
    and its spares)."""
    from elaunch.agent.agent import SignalException
    from elaunch.launch import _SignalHandlers

    echoed = []

    def echo(line: bytes) -> None:
        os.kill(os.getpid(), signal.SIGTERM)  # the handler runs before this function returns
        echoed.append(line)

    events = AgentEvents(str(tmp_path / "events.jsonl"), "node", "host", 3, echo=echo)
    with _SignalHandlers(("SIGTERM",)):
        with pytest.raises(SignalException):
            events.emit("rendezvous_join")
        events.emit("after")  # the echo was not dropped as a failing handler (it runs, and is not signalled again)
    assert echoed and b'"after"' in echoed[-1]
    assert (tmp_path / "events.jsonl").read_text().count('"kind"') == 2
