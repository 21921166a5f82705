"""The status report as pure logic: round states, node rows, budgets, the table, grouped stacks."""

from __future__ import annotations

import pytest

from elaunch.rendezvous.contract import FailureRecord, NodeInfo
from elaunch.rendezvous.dynamic import job_ops
from elaunch.rendezvous.dynamic.state import RendezvousState
from elaunch.status import report

INFO = NodeInfo("10.0.0.1", "default", 2)


def _state(**kw) -> RendezvousState:
    s = RendezvousState(**kw)
    for node in set(s.participants) | s.wait_list | s.redundancy_list:
        s.node_infos.setdefault(node, INFO)
    return s


@pytest.mark.parametrize("kw, expected", [
    ({}, "waiting"),
    ({"complete": True}, "running"),
    ({"complete": True, "closed": True}, "closed"),
    ({"complete": True, "closed": True, "job_failed": True}, "failed"),
])
def test_round_state(kw, expected):
    assert report.round_state(RendezvousState(**kw)) == expected


@pytest.mark.parametrize("node, pid", [("10.0.0.1_4242_0", 4242), ("host_with_underscores_77_3", 77),
                                       ("odd", None), ("a_b_c", None)])
def test_agent_pid_from_node_id(node, pid):
    assert report.agent_pid(node) == pid


def test_running_round_without_agent_records_computes_ranks_and_says_budget_unknown():
    s = _state(round=3, complete=True, participants={"b_2_0": 1, "a_1_0": 0}, wait_list={"c_3_0"},
               last_heartbeats={"a_1_0": 90.0, "b_2_0": 50.0, "c_3_0": 99.0}, restarts=2)
    doc = report.build(s, {}, backend="c10d", endpoint="h:1", run_id="j", now=100.0, dead_after=15.0)
    assert [(n["node"], n["pid"], n["group_rank"], n["ranks"]) for n in doc["nodes"]] == [
        ("a_1_0", 1, 0, [0, 1]), ("b_2_0", 2, 1, [2, 3])]
    assert [(n["heartbeat_age"], n["dead"]) for n in doc["nodes"]] == [(10.0, False), (50.0, True)]
    assert [(w["node"], w["list"]) for w in doc["waiting"]] == [("c_3_0", "wait")]
    assert doc["restarts"] == {"used": 2, "max": None, "budgets": []}
    text = report.table(doc)
    assert "round 3: running" in text and "restarts used: 2 (budget unknown" in text
    assert "50.0 s DEAD" in text and "1 node(s) waiting to join" in text


def test_agent_records_give_ranks_joined_and_budget_only_for_this_round():
    s = _state(round=1, complete=True, participants={"a_1_0": 0, "b_2_0": 1})
    agents = {"a_1_0": {"round": 1, "ranks": [0, 1], "max_restarts": 3, "joined_at": 5.0},
              "b_2_0": {"round": 0, "ranks": [9], "max_restarts": 5, "joined_at": 1.0}}  # stale record
    doc = report.build(s, agents, backend="etcd-v3", endpoint="e:2", run_id="j", now=10.0, dead_after=15.0)
    assert [(n["ranks"], n["joined_at"]) for n in doc["nodes"]] == [([0, 1], 5.0), ([2, 3], None)]
    assert doc["restarts"] == {"used": 0, "max": 3, "budgets": [3, 5]}
    assert "restarts used: 0 of 3 (agents disagree: --max-restarts 3, 5)" in report.table(doc)


def test_forming_round_has_no_group_ranks_and_shows_its_last_call():
    s = _state(round=0, participants={"a_1_0": -1}, deadline=50.0)
    doc = report.build(s, {}, backend="c10d", endpoint="h:1", run_id="j", now=10.0, dead_after=15.0)
    assert doc["state"] == "waiting" and doc["last_call_deadline"] == 50.0
    assert [(n["group_rank"], n["ranks"]) for n in doc["nodes"]] == [(None, [])]
    assert "round 0: waiting (last call closes at" in report.table(doc)


def test_failed_job_table_names_the_root_cause():
    failure = FailureRecord(round=2, at=1.0, node="a_1_0", host="h1", rank=3, pid=77, exitcode=-9,
                            message="Traceback\nboom", hung=True)
    s = job_ops.fail_job(_state(round=2, complete=True, participants={"a_1_0": 0}), failure)
    doc = report.build(s, {}, backend="c10d", endpoint="h:1", run_id="j", now=10.0, dead_after=15.0)
    text = report.table(doc)
    assert doc["state"] == "failed" and doc["failure"]["rank"] == 3
    assert "last failure: round 2, rank 3 on h1 (pid 77), exitcode -9 (hung)" in text
    assert "the job failed" in text and "  boom" in text


def test_group_stacks_folds_identical_stacks_across_nodes():
    same = "Thread {tid} (idle): \"MainThread\"\n    wait (x.py:3)\n    <module> (x.py:9)\n"
    docs = {"n0": {"workers": [{"rank": 0, "text": same.format(tid=11)}, {"rank": 1, "text": "Thread 5\n  other"}]},
            "n1": {"workers": [{"rank": 2, "text": same.format(tid=12)},
                               {"rank": 3, "text": "", "method": "unavailable", "reason": "gone"}]}}
    groups = report.group_stacks(docs)
    assert [g["ranks"] for g in groups] == [[0, 2], [1], [3]]
    text = report.stacks_text(groups, ["n2"])
    assert text.count("wait (x.py:3)") == 1 and "=== ranks 0,2 (2 workers) ===" in text
    assert "(no stacks: gone)" in text and "no stacks from node(s) n2" in text


def test_a_status_request_for_stacks_names_no_hung_worker():
    hung = FailureRecord(round=0, at=1.0, rank=1, hung=True)
    asked = job_ops.request_dump(_state(), hung)
    status = job_ops.request_dump(asked, None)
    assert (asked.dump_id, asked.dump_by["rank"]) == (1, 1)
    assert (status.dump_id, status.dump_by, status.dump_acks) == (2, None, [])
    assert job_ops.job_state(status, "n", 0, _settings()).dump_by is None


def _settings():
    from elaunch.rendezvous.dynamic.settings import RendezvousSettings

    return RendezvousSettings(run_id="j", min_nodes=1, max_nodes=1)
