"""``elaunch status``'s goodput: event logs read from the nodes' log directories, the table's column and line."""

from __future__ import annotations

import json

import pytest

from elaunch.status.goodput import add_goodput, node_ledger
from elaunch.status.report import goodput_line, table


def ev(t, kind, node, **fields):
    return {"time": 1000.0 + t, "kind": kind, "node": node, "host": "h", "round": 0, **fields}


def log_dir(tmp_path, name, events, tail=""):
    d = tmp_path / name
    d.mkdir()
    (d / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events) + tail)
    return str(d)


def running(node):  # joined at 0, started at 2, training from 3
    return [ev(0, "rendezvous_join", node), ev(1, "rendezvous_complete", node), ev(2, "workers_started", node),
            ev(3, "training", node, step=0)]


def report(nodes, read_at=1010.0):
    base = {"schema": 1, "backend": "c10d", "endpoint": "e:1", "run_id": "j", "read_at": read_at, "round": 0,
            "state": "running", "last_call_deadline": None, "waiting": [],
            "restarts": {"used": 0, "max": 0, "budgets": [0]}, "failure": None, "job_failed": False}
    rows = [{"node": n, "addr": "127.0.0.1", "pid": 1, "role": "default", "local_world_size": 1, "group_rank": i,
             "ranks": [i], "joined_at": 1000.0, "heartbeat_age": 0.1, "dead": dead, "log_dir": d, "checkpoint": None}
            for i, (n, d, dead) in enumerate(nodes)]
    return {**base, "nodes": rows}


def test_live_nodes_count_until_the_read_dead_ones_until_their_last_event(tmp_path):
    a = log_dir(tmp_path, "a", running("a"))
    b = log_dir(tmp_path, "b", running("b") + [ev(5, "checkpoint_persisted", "b", step=1)], tail='{"time": 10')
    doc = add_goodput(report([("a", a, False), ("b", b, True)], read_at=1010.0))
    ga, gb = (n["goodput"] for n in doc["nodes"])
    assert ga["seconds"]["productive"] == pytest.approx(7) and ga["goodput"] == pytest.approx(0.7)
    assert gb["seconds"]["productive"] == pytest.approx(2) and gb["goodput"] == pytest.approx(0.4)  # a cut line skipped
    assert doc["goodput"]["nodes_read"] == 2
    assert doc["goodput"]["goodput"] == pytest.approx(9 / 15)
    text = table(doc)
    assert text.splitlines()[3].split()[-1] == "GOODPUT"
    assert "70.0%" in text and "40.0%" in text
    assert ("goodput: 60.0% (productive 9.0 s of 15.0 node-seconds; lost: rendezvous 2.0 s, starting 4.0 s; "
            "event logs of 2 of 2 node(s))") in text


def test_a_node_whose_log_is_not_readable_here_has_no_goodput(tmp_path):
    a = log_dir(tmp_path, "a", running("a"))
    doc = add_goodput(report([("a", a, False), ("b", str(tmp_path / "elsewhere"), False)]))
    assert doc["nodes"][1]["goodput"] is None
    assert doc["goodput"]["nodes_read"] == 1
    assert "event logs of 1 of 2 node(s)" in table(doc)
    assert table(doc).splitlines()[5].split()[-1] == "-"
    none = add_goodput(report([("a", None, False)]))
    assert none["goodput"] == {"goodput": None, "seconds": none["goodput"]["seconds"], "nodes_read": 0}
    assert "GOODPUT" not in table(none) and goodput_line(none).startswith("goodput: unknown")


def test_only_the_nodes_own_events_are_folded(tmp_path):
    d = log_dir(tmp_path, "a", running("a") + running("other"))
    g = node_ledger({"node": "a", "log_dir": d, "dead": False}, now=1010.0)
    assert sum(g["seconds"].values()) == pytest.approx(10)


def test_a_report_without_goodput_renders_as_before():
    assert goodput_line(report([])) is None
