"""Which step the whole job restores, and where each new rank gets it from. Pure, stdlib only.

At the start of each round every agent publishes what its node holds (its
:func:`inventory_doc`: committed slots, replicas, the newest complete persisted
step) through the job channel's ``exchange``, and every agent runs :func:`choose`
on the same documents, so every agent computes the same plan (it depends on the
documents, never on which node runs it).

The rules:

* **One step for the job.** The job restores the highest step ``S`` that every
  new global rank ``0 .. world_size - 1`` can get; ranks never resume from
  different steps. No such step: start fresh (``Plan.step`` is None).
* **Replicated state** (DDP: every rank saved the same state, ``replicated``):
  any one snapshot of ``S``, anywhere, serves every rank, whatever the world size.
* **Sharded state** (FSDP, TP: each rank its own): step ``S`` serves only when the
  new world size equals the saved one and, for every rank ``r``, a snapshot
  ``(rank r, step S)`` exists somewhere. When the world size changed, memory
  cannot reshard: if that is the only blocker of a step, ``Plan.reason`` says so
  (load the persisted checkpoint with ``torch.distributed.checkpoint``, which reshards).
* **Where from**, best first, for a rank that runs on node ``n``: a snapshot in
  ``n``'s own memory (its slot, then a replica it holds) > a peer's memory (slot
  or replica, fetched from that peer) > a persisted file (``disk``). A disk entry
  serves only the node that listed it, unless it says ``shared`` (a path every
  node sees), then any node; ``n``'s own files come before shared ones of others.
* **A replica never leads.** A replica (a copy a peer sent) whose step is ahead of
  every node's own snapshots (its workers' slots and its persisted files) is refused
  (``Plan.refused``, logged by the agent): a step is restored only when some node's own
  workers committed it, so a forged or stray copy cannot choose the job's step.
* **Spreading fetches.** Among peers holding the same step, a rank fetches from
  the one that was picked least so far (ties: the lowest node id), ranks taken
  in ascending order, so one node's copy is not read by every newcomer.

An inventory entry is a :class:`Held`; a rank's source a :class:`Source`.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from elaunch.checkpoint.persisted import rank_and_world

#: Where a snapshot lies: a worker's slot, a replica a peer sent, a persisted torch file.
SLOT, REPLICA, DISK = "slot", "replica", "disk"
MEMORY = (SLOT, REPLICA)
#: Version of the exchanged document (:func:`inventory_doc`).
DOC_VERSION = 1


class Held(NamedTuple):
    """One snapshot a node holds.

    Attributes:
        step: the training step saved.
        rank: the global rank that saved it; world_size: the world size then.
        replicated: True when every rank's state was the same (any rank's serves any).
        where: :data:`SLOT`, :data:`REPLICA` or :data:`DISK`.
        locator: the file's path on its node (a slot file, a replica, a ``.pt`` file).
        shared: for a disk entry, True when the path is on storage every node sees.
    """

    step: int
    rank: int
    world_size: int
    replicated: bool
    where: str
    locator: str
    shared: bool = False


class Source(NamedTuple):
    """Where one new rank restores from: ``node`` (a node id), ``where`` and ``locator`` of a :class:`Held`."""

    node: str
    where: str
    locator: str


@dataclass(frozen=True)
class Plan:
    """The job's restore plan for one round.

    Attributes:
        step: the step every rank restores, or None: start fresh.
        sources: new global rank -> its :class:`Source`, for every rank of every node (empty when ``step`` is None).
        mine: this node's ranks -> their sources (a subset of ``sources``).
        reason: why a newer snapshot could not serve ("" when none was blocked that way), for the agent's log.
        refused: one line per replica refused because it is ahead of every node's own snapshots (see the
            module's rules), for the agent's log.
    """

    step: int | None
    sources: dict[int, Source] = field(default_factory=dict)
    mine: dict[int, Source] = field(default_factory=dict)
    reason: str = ""
    refused: tuple[str, ...] = ()

    def fetches(self, me: str) -> dict[int, Source]:
        """This node's ranks whose source is in another node's memory (to fetch from that peer)."""
        return {r: s for r, s in self.mine.items() if s.node != me}


def choose(ranks_by_node: Mapping[str, Iterable[int]], held: Mapping[str, Iterable[Held]], world_size: int,
           me: str) -> Plan:
    """Choose the one step the job restores and each new rank's source (see the module's rules).

    Args:
        ranks_by_node: node id -> the new global ranks its workers run, covering ``0 .. world_size - 1``.
        held: node id -> what that node holds (a node missing here holds nothing).
        world_size: the new world size (number of ranks).
        me: this node's id; its ranks' sources are ``Plan.mine``.

    Returns:
        The plan; ``Plan(step=None)`` (with a ``reason`` when a sharded snapshot's world
        size was the only blocker of a step) when no step serves every rank.

    Raises:
        ValueError: ``ranks_by_node`` does not give each rank of ``0 .. world_size - 1`` exactly one node.
    """
    node_of = _node_of_rank(ranks_by_node, world_size)
    held, refused = _without_leading_replicas(held)
    by_step: dict[int, list[tuple[str, Held]]] = {}
    for node in sorted(held):
        for h in held[node]:
            by_step.setdefault(h.step, []).append((node, h))
    reason = ""
    for step in sorted(by_step, reverse=True):
        entries = by_step[step]
        replicated = [(n, h) for n, h in entries if h.replicated]
        if replicated:
            sources = _assign(node_of, lambda r: replicated)
        else:
            sources = _sharded(node_of, entries, world_size)
            if sources is None and not reason:
                reason = _mismatch(step, entries, world_size)
        if sources is not None:
            mine = {r: s for r, s in sources.items() if node_of[r] == me}
            return Plan(step, sources, mine, refused=refused)
    return Plan(None, reason=reason, refused=refused)


def _without_leading_replicas(held: Mapping[str, Iterable[Held]]) -> tuple[dict[str, list[Held]], tuple[str, ...]]:
    """``held`` less the replicas whose step is ahead of every node's own snapshot (slot or disk); and a line each."""
    held = {node: list(entries) for node, entries in held.items()}
    own = [h.step for entries in held.values() for h in entries if h.where != REPLICA]
    top = max(own, default=None)
    kept: dict[str, list[Held]] = {}
    refused = []
    for node in sorted(held):
        kept[node] = []
        for h in held[node]:
            if h.where == REPLICA and (top is None or h.step > top):
                refused.append(f"the replica of rank {h.rank} step {h.step} on node {node} ({h.locator}): no node's "
                               f"own snapshot is that new (newest: {'none' if top is None else f'step {top}'})")
            else:
                kept[node].append(h)
    return kept, tuple(refused)


def _node_of_rank(ranks_by_node: Mapping[str, Iterable[int]], world_size: int) -> dict[int, str]:
    node_of: dict[int, str] = {}
    for node, ranks in ranks_by_node.items():
        for r in ranks:
            if r in node_of:
                raise ValueError(f"rank {r} is on two nodes: {node_of[r]} and {node}")
            node_of[r] = node
    if sorted(node_of) != list(range(world_size)):
        raise ValueError(f"ranks {sorted(node_of)} are not 0..{world_size - 1} (world size {world_size})")
    return node_of


def _sharded(node_of: dict[int, str], entries: list[tuple[str, Held]],
             world_size: int) -> dict[int, Source] | None:
    """Sources of a sharded step: each rank's own snapshot, saved at this world size; None if one lacks."""
    fitting = [(n, h) for n, h in entries if h.world_size == world_size]
    return _assign(node_of, lambda r: [(n, h) for n, h in fitting if h.rank == r])


def _assign(node_of: dict[int, str], candidates) -> dict[int, Source] | None:
    """Pick each rank's best source among ``candidates(rank)``; None when a rank has none it can use."""
    load: dict[str, int] = {}
    sources: dict[int, Source] = {}
    for rank in sorted(node_of):
        best = _best(node_of[rank], candidates(rank), load)
        if best is None:
            return None
        node, h = best
        if node != node_of[rank]:
            load[node] = load.get(node, 0) + 1
        sources[rank] = Source(node, h.where, h.locator)
    return sources


def _best(at: str, candidates: list[tuple[str, Held]], load: dict[str, int]) -> tuple[str, Held] | None:
    """The best source for a rank on node ``at``: own memory > peers' memory (least picked) > usable disk."""
    def rank_of(entry: tuple[str, Held]) -> tuple:
        node, h = entry
        own = node == at
        if h.where in MEMORY:
            tier = 0 if own else 1
        else:
            tier = 2 if own else 3
        return (tier, 0 if own else load.get(node, 0), node, MEMORY.index(h.where) if h.where in MEMORY else 0,
                h.rank, h.locator)

    usable = [(n, h) for n, h in candidates if h.where in MEMORY or n == at or h.shared]
    return min(usable, key=rank_of, default=None)


def _mismatch(step: int, entries: list[tuple[str, Held]], world_size: int) -> str:
    """The reason when a sharded ``step`` is whole for another world size (all its ranks held), else ""."""
    for saved in sorted({h.world_size for _, h in entries if h.world_size != world_size}):
        ranks = {h.rank for _, h in entries if h.world_size == saved}
        if ranks >= set(range(saved)):
            return (f"sharded snapshot of step {step} of world size {saved} cannot serve world size {world_size}: "
                    f"load the persisted checkpoint with torch.distributed.checkpoint")
    return ""


def inventory_doc(infos: Iterable[Any], persisted: tuple[int, Mapping[int, str], bool] | None, node_addr: str,
                  *, shared: bool = False) -> dict:
    """The JSON-safe document a node publishes in the round's exchange: its address and what it holds.

    Args:
        infos: the node's committed snapshots (``slotfile.SlotInfo``: ``path``, ``step``, ``rank``,
            ``world_size``, ``replicated``), e.g. ``slotfile.inventory(node_dir)``; a path in a
            ``replicas`` directory is a :data:`REPLICA`, any other a :data:`SLOT`.
        persisted: ``persisted.newest_complete(dir)``: ``(step, {rank: path}, replicated)`` or None; the
            world size is read from each file's name (``rank_<r>_of_<world_size>.pt``).
        node_addr: the address peers fetch from (the replica service's ``host:port``).
        shared: True when the persisted files are on storage every node sees.

    Returns:
        ``{"v": 1, "addr": node_addr, "held": [[step, rank, world_size, replicated, where, locator, shared], ...]}``.
    """
    held = []
    for info in infos:
        where = REPLICA if os.path.basename(os.path.dirname(info.path)) == "replicas" else SLOT
        held.append(Held(info.step, info.rank, info.world_size, bool(info.replicated), where, info.path))
    if persisted is not None:
        step, paths, replicated = persisted
        for rank, path in sorted(paths.items()):
            named = rank_and_world(path)
            ws = named[1] if named else 0
            held.append(Held(step, rank, ws, bool(replicated), DISK, path, shared))
    return {"v": DOC_VERSION, "addr": node_addr, "held": [list(h) for h in held]}


def held_from_doc(doc: Any) -> list[Held]:
    """The :class:`Held` entries of a document from :func:`inventory_doc`; malformed entries or documents: skipped."""
    if not isinstance(doc, dict) or doc.get("v") != DOC_VERSION or not isinstance(doc.get("held"), list):
        return []
    out = []
    for e in doc["held"]:
        if not (isinstance(e, list) and len(e) == 7):
            continue
        step, rank, ws, replicated, where, locator, shared = e
        if (all(type(x) is int for x in (step, rank, ws)) and where in (SLOT, REPLICA, DISK)
                and isinstance(locator, str) and isinstance(replicated, bool) and isinstance(shared, bool)):
            out.append(Held(step, rank, ws, replicated, where, locator, shared))
    return out


def addr_from_doc(doc: Any) -> str:
    """The fetch address a document names ("" when it names none)."""
    addr = doc.get("addr") if isinstance(doc, dict) else None
    return addr if isinstance(addr, str) else ""
