"""The node check's pure decisions: the two pairing rounds and each node's verdict (``--node-check``).

The check (``agent/node_check.py`` starts it, ``procs/_node_check_child.py`` runs it)
times a compute probe on every node and an all-reduce between pairs of nodes, in two
pairing rounds, then every agent exchanges its node's results through the job channel
and calls :func:`judge` on the same documents: every node reaches the same verdicts.

**Pairing**: :mod:`elaunch.features.node_check` (the check's child runs the pairs too).

**Verdicts.** A node's *pair time* is the seconds of one all-reduce of the check's
buffer with one partner (the larger of the two ends' measurements; a failed or
missing all-reduce counts as infinitely slow). A node's *best* time is its fastest
pairing over both rounds: a node whose link is slow is slow with every partner, while
its partners are fast with someone else. With ``factor`` the conf key
``node_check_slow_factor`` (default 2):

* ``failed``: the node's check reported an error, or no result at all (its check
  crashed, timed out, or its agent did not publish in time);
* ``slow``: its best pair time is above ``factor`` x the median of the nodes' best
  times (it was slow in both pairings), or its compute probe took more than
  ``factor`` x the median probe; either also by more than :data:`NOISE_FLOOR` seconds,
  so that millisecond jitter on an idle link is never a verdict;
* ``ok`` otherwise. With two nodes the network part cannot tell the nodes apart (both
  have the same single pairing): only the compute probe and failures name a node there.

DLRover's ``--network-check`` pairs nodes the same way (slowest with fastest in its
second round); torchrun has no such check. Stdlib only.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from elaunch.features.node_check import DEFAULT_SLOW_FACTOR

#: Seconds by which a time must also exceed the median to count as slow (timer and scheduling noise).
NOISE_FLOOR = 0.02
#: The verdicts, in the order reports list them.
OK, SLOW, FAILED = "ok", "slow", "failed"


@dataclass(frozen=True)
class NodeResult:
    """One node's figures and verdict.

    Attributes:
        group_rank: the node's group rank in the checked round (-1: unknown, no result).
        compute: seconds of its compute probe, or None (failed, or no result).
        best_pair: seconds of its fastest all-reduce over both pairing rounds (inf: every
            one failed), or None (it had no partner: a one-node round, or no result).
        verdict: :data:`OK`, :data:`SLOW` or :data:`FAILED`.
        reasons: one short phrase per finding (empty for ok).
    """

    group_rank: int
    compute: float | None
    best_pair: float | None
    verdict: str
    reasons: tuple[str, ...] = ()


@dataclass(frozen=True)
class NodeCheckReport:
    """Every node's verdict of one round's check, the same on every node.

    Attributes:
        round: the rendezvous round checked.
        factor: ``node_check_slow_factor``.
        compute_median: seconds, the median compute probe (None: no node measured one).
        pair_median: seconds, the median of the nodes' best pair times (None: no pairs; inf:
            most pairings failed).
        pairs: ``(pairing round, a, b, seconds or None)`` of every all-reduce (merged ends).
        nodes: node id -> :class:`NodeResult`.
    """

    round: int
    factor: float
    compute_median: float | None
    pair_median: float | None
    pairs: tuple[tuple[int, int, int, float | None], ...] = ()
    nodes: Mapping[str, NodeResult] = field(default_factory=dict)

    @property
    def faulty(self) -> list[str]:
        """Node ids whose verdict is not ok, sorted."""
        return sorted(n for n, r in self.nodes.items() if r.verdict != OK)

    def to_doc(self) -> dict:
        """The report as JSON-able data (the ``node_check`` event's fields; inf as None)."""
        def num(x: float | None) -> float | None:
            return None if x is None or not math.isfinite(x) else round(x, 6)

        return {
            "round": self.round, "factor": self.factor,
            "compute_median": num(self.compute_median), "pair_median": num(self.pair_median),
            "pairs": [[r, a, b, num(t)] for r, a, b, t in self.pairs],
            "nodes": {n: {"group_rank": r.group_rank, "compute": num(r.compute), "best_pair": num(r.best_pair),
                          "verdict": r.verdict, "reasons": list(r.reasons)} for n, r in sorted(self.nodes.items())},
            "faulty": self.faulty,
        }


def _median(values: Sequence[float]) -> float | None:
    if not values:
        return None
    s = sorted(values)
    mid = len(s) // 2
    return s[mid] if len(s) % 2 else (s[mid - 1] + s[mid]) / 2 if math.isfinite(s[mid]) else s[mid]


def _slow(value: float, median: float | None, factor: float) -> bool:
    return (median is not None and math.isfinite(median) and value > factor * median
            and value - median > NOISE_FLOOR)


def _merged_pairs(docs: Mapping[str, dict]) -> dict[tuple[int, int, int], float | None]:
    """(pairing round, a, b) -> seconds from every node's report: the larger end; None when an end failed."""
    merged: dict[tuple[int, int, int], float | None] = {}
    for doc in docs.values():
        for entry in doc.get("pairs") or ():
            try:
                r, a, b, t = int(entry[0]), int(entry[1]), int(entry[2]), entry[3]
            except (TypeError, ValueError, IndexError):
                continue
            key = (r, min(a, b), max(a, b))
            t = None if t is None else float(t)
            if key in merged and (merged[key] is None or t is None):
                merged[key] = None
            else:
                merged[key] = t if key not in merged else max(merged[key], t)
    return merged


def judge(round: int, members: Mapping[str, int], docs: Mapping[str, dict],
          factor: float = DEFAULT_SLOW_FACTOR) -> NodeCheckReport:
    """Every node's verdict from the round's exchanged check results.

    Args:
        round: the rendezvous round checked.
        members: node id -> group rank, for every node of the round (a member without a
            document is :data:`FAILED`: its check did not report).
        docs: node id -> that node's result document: ``{"compute": seconds or None,
            "pairs": [[pairing round, a, b, seconds or None], ...], "error": text or None}``
            (``a``, ``b`` group ranks; the child's output, see ``procs/_node_check_child.py``).
        factor: ``node_check_slow_factor`` (> 1).

    Returns:
        The report (see the module docstring for the rules).
    """
    rank_of = dict(members)
    pairs = _merged_pairs({n: d for n, d in docs.items() if n in rank_of})
    computes = {n: float(d["compute"]) for n, d in docs.items()
                if n in rank_of and isinstance(d.get("compute"), (int, float)) and not d.get("error")}
    compute_median = _median(list(computes.values()))
    best: dict[str, float] = {}
    by_rank = {r: n for n, r in rank_of.items()}
    for (_r, a, b), t in pairs.items():
        for g in (a, b):
            node = by_rank.get(g)
            if node is not None:
                best[node] = min(best.get(node, math.inf), math.inf if t is None else t)
    pair_median = _median([best[n] for n in best if n in docs and not docs[n].get("error")])
    nodes = {}
    for node, g in rank_of.items():
        doc = docs.get(node)
        c, p = computes.get(node), best.get(node)
        if doc is None or doc.get("error") or c is None:
            why = ("no result from its check" if doc is None else
                   f"check failed: {doc['error']}" if doc.get("error") else "no compute time")
            nodes[node] = NodeResult(g, c, p, FAILED, (why,))
            continue
        reasons = []
        if _slow(c, compute_median, factor):
            reasons.append(f"compute {c:.3g} s > {factor:g} x median {compute_median:.3g} s")
        if p is not None and (_slow(p, pair_median, factor) or (math.isinf(p) and _finite(pair_median))):
            what = "every all-reduce failed" if math.isinf(p) else f"best all-reduce {p:.3g} s"
            reasons.append(f"{what} > {factor:g} x median {pair_median:.3g} s")
        nodes[node] = NodeResult(g, c, p, SLOW if reasons else OK, tuple(reasons))
    flat = tuple((r, a, b, t) for (r, a, b), t in sorted(pairs.items()))
    return NodeCheckReport(round, factor, compute_median, pair_median, flat, nodes)


def _finite(x: float | None) -> bool:
    return x is not None and math.isfinite(x)


def sitting_out(report: NodeCheckReport, exclude: bool, min_nodes: int) -> list[str]:
    """The faulty nodes that sit out the next rounds, the same on every node.

    All of them, when ``exclude`` (conf ``exclude_after`` given, > 0) and the others
    still make ``min_nodes``; else none (the job starts and they are only named).

    Returns:
        Sorted node ids.
    """
    faulty = report.faulty
    if not exclude or not faulty or len(report.nodes) - len(faulty) < min_nodes:
        return []
    return faulty
