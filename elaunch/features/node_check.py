"""The node check's pairing schedule and slow factor (``--node-check``; stdlib only).

What the check's three parts all need: the options (``elaunch.config`` parses
``node_check_slow_factor``), the check's child process (``procs/_node_check_child.py``
runs the pairs) and the verdict (:mod:`elaunch.agent.node_verdict` judges them).
Imports nothing of elaunch.

**Pairing.** Round 1 pairs nodes by group rank: 0-1, 2-3, ...; with an odd number of
nodes the last one also pairs with node 0 (node 0 runs its two all-reduces one after
the other), so every node has a partner. Round 2 pairs the slowest node of round 1
with the fastest one it has not met yet, the next slowest with the next fastest, and
so on; an odd node left over pairs with the fastest node it has not met. So a node
slowed by its partner in round 1 meets a different, fast node in round 2.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

#: ``node_check_slow_factor``'s default: a node more than twice as slow as the median is named.
DEFAULT_SLOW_FACTOR = 2.0

Pair = tuple[int, int]


def parse_slow_factor(value: object, label: str = "--rdzv-conf node_check_slow_factor") -> float:
    """``node_check_slow_factor`` as a float > 1 (a number of times the median).

    Raises:
        ValueError: not a finite number > 1; the message names ``label`` and the value.
    """
    try:
        factor = float(str(value).strip())
    except ValueError:
        raise ValueError(f"{label}={value}: expected a number > 1 (times the median)") from None
    if not math.isfinite(factor) or factor <= 1:
        raise ValueError(f"{label}={value}: must be a number > 1 (times the median)")
    return factor


def first_pairs(n: int) -> list[Pair]:
    """Round 1's pairs of ``n`` nodes by group rank: (0, 1), (2, 3), ...; an odd last node with node 0.

    Returns:
        The pairs ``(a, b)``, ``a < b``, in the order every node runs them ([] for n < 2).
    """
    pairs = [(i, i + 1) for i in range(0, n - 1, 2)]
    if n % 2 and n > 1:
        pairs.append((0, n - 1))
    return pairs


def second_pairs(n: int, round1: Mapping[Pair, float | None]) -> list[Pair]:
    """Round 2's pairs: the slowest node of round 1 with the fastest it has not met, and so on.

    Args:
        n: the number of nodes (group ranks 0 .. n-1).
        round1: each round-1 pair -> its seconds (None: failed); a missing pair counts as failed.

    Returns:
        The pairs ``(a, b)``, ``a < b``, in the order every node runs them ([] for n < 3:
        two nodes have no one else to meet).
    """
    if n < 3:
        return []
    met: dict[int, set[int]] = {i: set() for i in range(n)}
    worst = {i: 0.0 for i in range(n)}
    for a, b in first_pairs(n):
        t = round1.get((a, b))
        t = math.inf if t is None else t
        met[a].add(b)
        met[b].add(a)
        worst[a], worst[b] = max(worst[a], t), max(worst[b], t)
    order = sorted(range(n), key=lambda i: (-worst[i], i))  # slowest first
    fastest_first = order[::-1]
    free = set(range(n))
    pairs: list[Pair] = []

    def partner(node: int, among: Iterable[int]) -> int | None:
        cands = [j for j in fastest_first if j != node and j in among]
        fresh = [j for j in cands if j not in met[node]]
        return (fresh or cands or [None])[0]

    for node in order:
        if node not in free:
            continue
        free.discard(node)
        other = partner(node, free)
        if other is None:  # the odd node left over: the fastest node it has not met, paired twice
            other = partner(node, range(n))
        else:
            free.discard(other)
        pairs.append((min(node, other), max(node, other)))
    return pairs
