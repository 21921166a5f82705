"""The node check's pure decisions as tables: the two pairing rounds, the verdicts, who sits out, and the
status report's CHECK column and node check lines.

No processes: ``elaunch.agent.node_verdict`` is pure.
"""

from __future__ import annotations

import math

import pytest

from elaunch.agent.node_verdict import FAILED, OK, SLOW, judge, sitting_out
from elaunch.features.node_check import first_pairs, parse_slow_factor, second_pairs

F, S = 0.010, 0.400  # seconds of one all-reduce: a fast pairing and one with a slow link in it


@pytest.mark.parametrize("n, pairs", [
    (1, []),
    (2, [(0, 1)]),
    (3, [(0, 1), (0, 2)]),
    (4, [(0, 1), (2, 3)]),
    (5, [(0, 1), (2, 3), (0, 4)]),
    (8, [(0, 1), (2, 3), (4, 5), (6, 7)]),
])
def test_first_pairs(n, pairs):
    assert first_pairs(n) == pairs


@pytest.mark.parametrize("n, round1, pairs", [
    (2, {(0, 1): F}, []),  # two nodes meet once: no one else to meet
    # three nodes, node 2's link slow: it meets node 1 (the fastest it has not met), 0 meets 1 again
    (3, {(0, 1): F, (0, 2): S}, [(0, 1), (1, 2)]),
    # node 0 slow (in both of its round-1 pairs): it meets 2 again, 1 meets 2
    (3, {(0, 1): S, (0, 2): S}, [(0, 2), (1, 2)]),
    # four nodes, node 0 slow: the slowest (0, then its partner 1) meet the fastest they have not met
    (4, {(0, 1): S, (2, 3): F}, [(0, 3), (1, 2)]),
    # a failed (None) or missing round-1 pair counts as the slowest
    (4, {(0, 1): F, (2, 3): None}, [(2, 1), (3, 0)]),
    (4, {(0, 1): F}, [(2, 1), (3, 0)]),
    # all alike: by group rank, never the same partner twice when avoidable
    (4, {(0, 1): F, (2, 3): F}, [(0, 3), (1, 2)]),
    # the slow pair's nodes first meet the fastest (by rank among equals); fast nodes may meet again
    (6, {(0, 1): F, (2, 3): F, (4, 5): S}, [(4, 3), (5, 2), (0, 1)]),
])
def test_second_pairs(n, round1, pairs):
    want = [(min(a, b), max(a, b)) for a, b in pairs]
    got = second_pairs(n, round1)
    assert got == want
    partners = {i: set() for i in range(n)}
    for a, b in first_pairs(n) + got:
        partners[a].add(b)
        partners[b].add(a)
    worst = max((t if t is not None else math.inf) for t in round1.values())
    slow_pairs = [p for p in first_pairs(n) if round1.get(p, math.inf) in (None, worst) or p not in round1]
    if n >= 3:  # the nodes of the slowest round-1 pairs meet someone new in round 2
        assert all(len(partners[i]) >= 2 for p in slow_pairs for i in p), partners


def docs_for(n: int, compute: dict[int, float] | None = None, slow: set[int] = frozenset(),
             failed_pairs: set[tuple[int, int]] = frozenset(), errors: dict[int, str] | None = None,
             missing: set[int] = frozenset()) -> tuple[dict[str, int], dict[str, dict]]:
    """Members and documents of ``n`` nodes; pairs with a node of ``slow`` take S seconds, others F."""
    compute = compute or {}
    errors = errors or {}

    def t(a, b):
        if (a, b) in failed_pairs:
            return None
        return S if a in slow or b in slow else F

    r1 = {p: t(*p) for p in first_pairs(n)}
    rounds = [(1, p) for p in first_pairs(n)] + [(2, p) for p in second_pairs(n, r1)]
    members = {f"n{i}": i for i in range(n)}
    docs = {}
    for i in range(n):
        if i in missing:
            continue
        docs[f"n{i}"] = {"compute": compute.get(i, 0.2), "error": errors.get(i),
                         "pairs": [[r, a, b, t(a, b)] for r, (a, b) in rounds if i in (a, b)]}
    return members, docs


@pytest.mark.parametrize("case, n, kw, verdicts", [
    ("healthy 3", 3, {}, {}),
    ("healthy 8", 8, {}, {}),
    ("slow link on node 2 of 3", 3, {"slow": {2}}, {"n2": SLOW}),
    ("slow link on node 0 of 3", 3, {"slow": {0}}, {"n0": SLOW}),
    ("slow link on node 1 of 3", 3, {"slow": {1}}, {"n1": SLOW}),
    ("slow link on node 5 of 8", 8, {"slow": {5}}, {"n5": SLOW}),
    ("two slow links of 8", 8, {"slow": {0, 5}}, {"n0": SLOW, "n5": SLOW}),
    ("slow link, 2 nodes: cannot tell which", 2, {"slow": {1}}, {}),
    ("slow compute", 4, {"compute": {3: 0.9}}, {"n3": SLOW}),
    ("compute jitter below the factor", 4, {"compute": {0: 0.15, 1: 0.25, 2: 0.38, 3: 0.2}}, {}),
    ("slow compute, 2 nodes", 2, {"compute": {0: 0.2, 1: 0.9}}, {}),  # the median of 2 is their mean
    ("check error", 3, {"errors": {1: "gloo: connection refused"}}, {"n1": FAILED}),
    ("no document", 3, {"missing": {2}}, {"n2": FAILED}),
    ("every all-reduce of node 2 failed", 3, {"failed_pairs": {(0, 2), (1, 2)}}, {"n2": SLOW}),
    ("the only pair failed: 2 nodes", 2, {"failed_pairs": {(0, 1)}}, {}),
])
def test_judge(case, n, kw, verdicts):
    members, docs = docs_for(n, **kw)
    report = judge(7, members, docs, factor=2.0)
    got = {node: r.verdict for node, r in report.nodes.items() if r.verdict != OK}
    assert got == verdicts, (case, report)
    assert report.faulty == sorted(verdicts)
    for node, r in report.nodes.items():
        assert bool(r.reasons) == (r.verdict != OK)
        assert r.group_rank == members[node]


def test_judge_is_the_same_whatever_the_documents_order():
    members, docs = docs_for(5, slow={3})
    a = judge(1, members, docs)
    b = judge(1, dict(reversed(list(members.items()))), dict(reversed(list(docs.items()))))
    assert a.to_doc() == b.to_doc() and a.faulty == ["n3"]


def test_judge_takes_the_slower_end_of_a_pair_and_a_failed_end():
    members = {"a": 0, "b": 1}
    docs = {"a": {"compute": 0.1, "pairs": [[1, 0, 1, 0.02]]}, "b": {"compute": 0.1, "pairs": [[1, 0, 1, 0.05]]}}
    assert judge(0, members, docs).pairs == ((1, 0, 1, 0.05),)
    docs["b"]["pairs"] = [[1, 0, 1, None]]
    assert judge(0, members, docs).pairs == ((1, 0, 1, None),)


def test_noise_floor_keeps_millisecond_jitter_from_a_verdict():
    members = {f"n{i}": i for i in range(3)}
    # node 2's pairs take 5x the others', but only a few milliseconds more
    docs = {"n0": {"compute": 0.1, "pairs": [[1, 0, 1, 0.001], [1, 0, 2, 0.005]]},
            "n1": {"compute": 0.1, "pairs": [[1, 0, 1, 0.001], [2, 1, 2, 0.005]]},
            "n2": {"compute": 0.1, "pairs": [[1, 0, 2, 0.005], [2, 1, 2, 0.005]]}}
    assert judge(0, members, docs).faulty == []


def test_report_doc_names_medians_and_reasons():
    members, docs = docs_for(3, slow={2})
    doc = judge(4, members, docs, factor=3.0).to_doc()
    assert doc["round"] == 4 and doc["factor"] == 3.0 and doc["faulty"] == ["n2"]
    assert doc["pair_median"] == F and doc["compute_median"] == 0.2
    assert doc["nodes"]["n2"]["best_pair"] == S and doc["nodes"]["n2"]["verdict"] == SLOW
    assert "best all-reduce 0.4 s > 3 x median 0.01 s" in doc["nodes"]["n2"]["reasons"]
    members, docs = docs_for(3, failed_pairs={(0, 2), (1, 2)})
    assert judge(0, members, docs).to_doc()["nodes"]["n2"]["best_pair"] is None  # inf is not JSON


@pytest.mark.parametrize("faulty, exclude, min_nodes, out", [
    ({2}, True, 2, ["n2"]),
    ({2}, False, 2, []),  # only named
    ({2}, True, 3, []),  # the others would not make MIN
    ({0, 2}, True, 2, []),  # all or none: excluding both leaves 1 < 2
    ({0, 2}, True, 1, ["n0", "n2"]),
    (set(), True, 1, []),
])
def test_sitting_out(faulty, exclude, min_nodes, out):
    members, docs = docs_for(3, errors={i: "boom" for i in faulty})
    assert sitting_out(judge(0, members, docs), exclude, min_nodes) == out


@pytest.mark.parametrize("value, out", [("2", 2.0), ("1.5", 1.5), (3, 3.0), (" 10 ", 10.0)])
def test_parse_slow_factor(value, out):
    assert parse_slow_factor(value) == out


@pytest.mark.parametrize("value, why", [("1", "must be a number > 1"), ("0.5", "must be"), ("-3", "must be"),
                                        ("nan", "must be"), ("inf", "must be"), ("fast", "expected a number > 1")])
def test_parse_slow_factor_rejects(value, why):
    with pytest.raises(ValueError) as err:
        parse_slow_factor(value)
    assert str(err.value).startswith(f"--rdzv-conf node_check_slow_factor={value}: ") and why in str(err.value)
    assert math.isfinite(2.0)


def test_status_shows_each_nodes_check_and_names_the_faulty():
    from elaunch.rendezvous.contract import NodeInfo
    from elaunch.rendezvous.dynamic.state import RendezvousState
    from elaunch.status import report

    s = RendezvousState(round=2, complete=True, participants={"a_1_0": 0, "b_2_0": 1})
    for n in s.participants:
        s.node_infos[n] = NodeInfo(f"10.0.0.{1 + s.participants[n]}", "default", 1)
    faulty = {"c_3_0": {"verdict": SLOW, "reasons": ["best all-reduce 0.4 s > 2 x median 0.01 s"],
                        "addr": "10.0.0.3", "sits_out": True}}
    checks = {"a_1_0": {"round": 1, "verdict": OK, "reasons": [], "faulty": faulty},
              "b_2_0": {"round": 1, "verdict": OK, "reasons": [], "faulty": faulty}}
    doc = report.build(s, {}, backend="c10d", endpoint="h:1", run_id="j", now=10.0, dead_after=15.0,
                       node_checks=checks)
    assert [n["node_check"]["verdict"] for n in doc["nodes"]] == [OK, OK]
    assert doc["node_check"] == {"round": 1, "faulty": faulty}
    text = report.table(doc)
    assert "CHECK" in text.splitlines()[3]
    assert "node check (round 1): 1 node(s) named" in text
    assert "  10.0.0.3 (c_3_0): slow: best all-reduce 0.4 s > 2 x median 0.01 s (sits out)" in text
    healthy = report.build(s, {}, backend="c10d", endpoint="h:1", run_id="j", now=10.0, dead_after=15.0,
                           node_checks={"a_1_0": {"round": 2, "verdict": OK, "reasons": [], "faulty": {}}})
    assert "node check (round 2): every node ok" in report.table(healthy)
    plain = report.table(report.build(s, {}, backend="c10d", endpoint="h:1", run_id="j", now=10.0, dead_after=15.0))
    assert "CHECK" not in plain and "node check" not in plain  # without --node-check: as before
