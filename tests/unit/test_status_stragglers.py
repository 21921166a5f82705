"""elaunch status's stragglers line: from the agents' ``straggler`` records of the current round (pure)."""

from __future__ import annotations

from elaunch.rendezvous.contract import NodeInfo
from elaunch.rendezvous.dynamic.state import RendezvousState
from elaunch.status import report


def _doc(records):
    s = RendezvousState(round=2, complete=True, participants={"a_1_0": 0, "b_2_0": 1})
    for node in s.participants:
        s.node_infos[node] = NodeInfo("10.0.0.1", "default", 1)
    return report.build(s, {}, backend="c10d", endpoint="h:1", run_id="j", now=100.0, dead_after=15.0,
                        stragglers=records)


NAMED = {"round": 2, "at": 90.0, "stragglers": [1], "step_time": 0.2,
         "named": {"1": {"node": "b_2_0", "host": "hostb", "lateness": 0.61}}}


def test_the_newest_record_of_this_round_names_the_straggler():
    stale = {"round": 1, "at": 95.0, "stragglers": [0], "named": {"0": {"node": "a_1_0", "host": "hosta"}}}
    doc = _doc({"a_1_0": NAMED, "b_2_0": stale})
    assert doc["stragglers"]["stragglers"] == [1]
    text = report.table(doc)
    assert "stragglers: 1 rank(s) named at" in text
    assert "  rank 1 on hostb (node b_2_0): late by 0.61 of a step (0.122 s of 0.2 s)" in text


def test_recovered_and_never_named():
    cleared = dict(NAMED, at=99.0, stragglers=[], named={})
    doc = _doc({"a_1_0": NAMED, "b_2_0": cleared})
    assert "stragglers: none (the last named one recovered at" in report.table(doc)
    doc = _doc({})
    assert doc["stragglers"] is None and "stragglers" not in report.table(doc)
