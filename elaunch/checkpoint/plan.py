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
* **Sharded state** (FSDP, TP: each rank its own): step ``S`` serves, at the
  cheapest, when the new world size equals the saved one and, for every rank ``r``, a
  snapshot ``(rank r, step S)`` exists somewhere: each rank restores its own part.
* **Reshardable state** (saved through ``torch.distributed.checkpoint`` with
  ``elaunch.checkpoint.SnapshotWriter``: each rank's part holds the layout of its own
  chunks, and the parts of every saved rank together the job's, ``reshardable``): when the own-part rule above does not serve, a step ``S`` saved at
  world size ``Ws`` serves a new world of *any* size once a part of every saved rank
  ``0 .. Ws-1`` of ``S`` is held in some node's memory (slot or replica). Every node then
  gathers every saved rank's part into its own memory (``Plan.parts``: per node, each
  saved rank's best source, own memory first, else a peer, fetches spread as below), and
  each new rank's file is one of its node's parts: DCP's planner reshards from them. When
  memory lacks a saved rank's part, a complete persisted DCP directory of ``S`` (a
  ``disk`` entry flagged ``reshardable``; any rank reads it) serves each node that lists it
  (or any node, when ``shared``). Other sharded state (``ckpt.save``'s) cannot reshard:
  when another world size is the only blocker of a step, ``Plan.reason`` says so (load the
  persisted checkpoint with ``torch.distributed.checkpoint``, which reshards).
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
When several rules could serve a step, the first of: replicated, own parts, parts
gathered from memory, a persisted DCP directory.
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
#: Version of the exchanged document (:func:`inventory_doc`). 2: an entry has an 8th field, ``reshardable``;
#: documents of version 1 (7 fields) are still read, their entries not reshardable.
DOC_VERSION = 2
_READ_VERSIONS = (1, 2)


class Held(NamedTuple):
    """One snapshot a node holds.

    Attributes:
        step: the training step saved.
        rank: the global rank that saved it; world_size: the world size then.
        replicated: True when every rank's state was the same (any rank's serves any).
        where: :data:`SLOT`, :data:`REPLICA` or :data:`DISK`.
        locator: the file's path on its node (a slot file, a replica, a ``.pt`` file, a DCP directory).
        shared: for a disk entry, True when the path is on storage every node sees.
        reshardable: a rank's part of a ``torch.distributed.checkpoint`` save (``SnapshotWriter``), which
            with the step's other parts serves any world size; on a disk entry: a complete persisted DCP
            directory of the step (``rank`` 0, ``world_size`` 0: it serves every rank).
    """

    step: int
    rank: int
    world_size: int
    replicated: bool
    where: str
    locator: str
    shared: bool = False
    reshardable: bool = False


def _is_dcp_dir(h: Held) -> bool:
    return h.where == DISK and h.reshardable


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
        partial: True when ``reason`` names a newer reshardable step that some saved rank had not committed
            (a fault during that step's save, the usual case after a kill), not one blocked by its world size.
        refused: one line per replica refused because it is ahead of every node's own snapshots (see the
            module's rules), for the agent's log.
        parts: when the step is resharded from memory: node -> saved rank -> the :class:`Source` of that
            saved rank's part the node gathers, for every node and every saved rank (else empty).
            Each rank's entry in ``sources`` is then one of its node's parts.
        saved_world_size: the world size the step was saved at, when it is resharded from memory or from a
            persisted DCP directory whose world size is known (else None).
    """

    step: int | None
    sources: dict[int, Source] = field(default_factory=dict)
    mine: dict[int, Source] = field(default_factory=dict)
    reason: str = ""
    partial: bool = False
    refused: tuple[str, ...] = ()
    parts: dict[str, dict[int, Source]] = field(default_factory=dict)
    saved_world_size: int | None = None

    def fetches(self, me: str) -> dict[int, Source]:
        """This node's ranks whose source is in another node's memory (to fetch from that peer)."""
        return {r: s for r, s in self.mine.items() if s.node != me}

    def parts_of(self, me: str) -> dict[int, Source]:
        """Saved rank -> the source of the part node ``me`` gathers ({} unless resharded from memory)."""
        return self.parts.get(me, {})


def choose(ranks_by_node: Mapping[str, Iterable[int]], held: Mapping[str, Iterable[Held]], world_size: int,
           me: str) -> Plan:
    """Choose the one step the job restores and each new rank's source (see the module's rules).

    Args:
        ranks_by_node: node id -> the new global ranks its workers run, covering ``0 .. world_size - 1``.
        held: node id -> what that node holds (a node missing here holds nothing).
        world_size: the new world size (number of ranks).
        me: this node's id; its ranks' sources are ``Plan.mine``.

    Returns:
        The plan; ``Plan(step=None)`` when no step serves every rank. ``reason`` names the
        newest step that could not serve when that was only for its world size (sharded
        state saved by ``ckpt.save``) or for a reshardable part in no node's memory.

    Raises:
        ValueError: ``ranks_by_node`` does not give each rank of ``0 .. world_size - 1`` exactly one node.
    """
    node_of = _node_of_rank(ranks_by_node, world_size)
    held, refused = _without_leading_replicas(held)
    by_step: dict[int, list[tuple[str, Held]]] = {}
    for node in sorted(held):
        for h in held[node]:
            by_step.setdefault(h.step, []).append((node, h))
    reason, partial = "", False
    nodes = sorted(set(node_of.values()))  # the nodes that run ranks: each gathers the parts it needs
    for step in sorted(by_step, reverse=True):
        sources, parts, saved = _serve(node_of, nodes, by_step[step], world_size)
        if sources is None:
            if not reason:
                reason, partial = _mismatch(step, by_step[step], world_size)
            continue
        mine = {r: s for r, s in sources.items() if node_of[r] == me}
        return Plan(step, sources, mine, reason, partial, refused, parts, saved)
    return Plan(None, reason=reason, partial=partial, refused=refused)


def _serve(node_of: dict[int, str], nodes: list[str], entries: list[tuple[str, Held]], world_size: int):
    """``(sources, parts, saved world size)`` by the first rule that serves a step (replicated, own parts, parts
    gathered from memory, a persisted DCP directory); ``(None, {}, None)`` when none does."""
    replicated = [(n, h) for n, h in entries if h.replicated]
    if replicated:
        return _assign(node_of, lambda r: replicated), {}, None
    sources = _sharded(node_of, entries, world_size)
    if sources is not None:
        return sources, {}, None
    saved, parts = _gathered(nodes, entries)
    if parts:
        return _from_parts(node_of, parts, saved), parts, saved
    dirs = [(n, h) for n, h in entries if _is_dcp_dir(h)]
    return (_assign(node_of, lambda r: dirs) if dirs else None), {}, None


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
    picked = _pick([(node_of[rank], rank) for rank in sorted(node_of)], candidates, {})
    return None if picked is None else {rank: s for (_at, rank), s in picked.items()}


def _pick(wants: list[tuple[str, int]], candidates, load: dict[str, int]) -> dict[tuple[str, int], Source] | None:
    """``(node, key)`` -> the best source for that node among ``candidates(key)``, ``wants`` taken in order,
    each pick from a peer counted in ``load``; None when one has no source it can use."""
    out: dict[tuple[str, int], Source] = {}
    for at, key in wants:
        best = _best(at, candidates(key), load)
        if best is None:
            return None
        node, h = best
        if node != at:
            load[node] = load.get(node, 0) + 1
        out[(at, key)] = Source(node, h.where, h.locator)
    return out


def _gathered(nodes: list[str], entries: list[tuple[str, Held]]) -> tuple[int | None, dict[str, dict[int, Source]]]:
    """``(saved world size, node -> saved rank -> source)`` when a reshardable step's parts of every saved rank
    are in some node's memory (the largest such world size), else ``(None, {})``."""
    parts = [(n, h) for n, h in entries if h.reshardable and h.where in MEMORY]
    for saved in sorted({h.world_size for _, h in parts}, reverse=True):
        of = [(n, h) for n, h in parts if h.world_size == saved]
        wants = [(node, r) for node in nodes for r in range(saved)]
        picked = _pick(wants, lambda r: [(n, h) for n, h in of if h.rank == r], {})
        if saved <= 0 or picked is None:  # None: a saved rank's part is in no node's memory
            continue
        out: dict[str, dict[int, Source]] = {}
        for (node, r), src in picked.items():
            out.setdefault(node, {})[r] = src
        return saved, out
    return None, {}


def _from_parts(node_of: dict[int, str], parts: dict[str, dict[int, Source]], saved: int) -> dict[int, Source]:
    """Each new rank's file: its node's part of saved rank ``rank % saved`` (its own when it saved one)."""
    return {rank: parts[node][rank % saved] for rank, node in node_of.items()}


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


def _mismatch(step: int, entries: list[tuple[str, Held]], world_size: int) -> tuple[str, bool]:
    """``(reason, partial)``: the reason when a reshardable ``step`` lacks a saved rank's part (``partial`` True)
    or a sharded one is whole for another world size (all its ranks held); else ``("", False)``."""
    entries = [(n, h) for n, h in entries if not _is_dcp_dir(h)]
    missing = _missing_parts(entries)
    if missing:
        return missing, True
    for saved in sorted({h.world_size for _, h in entries if h.world_size != world_size}):
        ranks = {h.rank for _, h in entries if h.world_size == saved}
        if ranks >= set(range(saved)):
            return (f"sharded snapshot of step {step} of world size {saved} cannot serve world size {world_size}: "
                    f"load the persisted checkpoint with torch.distributed.checkpoint"), False
    return "", False


def _missing_parts(entries: list[tuple[str, Held]]) -> str:
    """The reason when a reshardable step lacks some saved rank's part in memory and no DCP directory serves."""
    parts = [h for _, h in entries if h.reshardable and h.where in MEMORY]
    for saved in sorted({h.world_size for h in parts}, reverse=True):
        lacking = sorted(set(range(saved)) - {h.rank for h in parts if h.world_size == saved})
        if lacking:
            shown = ", ".join(map(str, lacking[:8])) + (", ..." if len(lacking) > 8 else "")
            return (f"reshardable step {entries[0][1].step} of world size {saved}: the part of saved rank(s) "
                    f"{shown} is in no node's memory, and no complete persisted DCP directory of that step is on "
                    f"a disk every node reads")
    return ""


def inventory_doc(infos: Iterable[Any], persisted: tuple[int, Mapping[int, str], bool] | None, node_addr: str,
                  *, shared: bool = False, dcp: tuple[int, str] | None = None) -> dict:
    """The JSON-safe document a node publishes in the round's exchange: its address and what it holds.

    Args:
        infos: the node's committed snapshots (``slotfile.SlotInfo``: ``path``, ``step``, ``rank``,
            ``world_size``, ``replicated``, ``reshardable``), e.g. ``slotfile.inventory(node_dir)``; a path
            in a ``replicas`` directory is a :data:`REPLICA`, any other a :data:`SLOT`.
        persisted: ``persisted.newest_complete(dir)``: ``(step, {rank: path}, replicated)`` or None; the
            world size is read from each file's name (``rank_<r>_of_<world_size>.pt``).
        node_addr: the address peers fetch from (the replica service's ``host:port``).
        shared: True when the persisted files are on storage every node sees.
        dcp: ``persisted.newest_dcp(dir)``: ``(step, path)`` of the newest complete persisted DCP
            directory, or None; listed as a reshardable :data:`DISK` entry (rank 0, world size 0).

    Returns:
        ``{"v": 2, "addr": node_addr, "held": [[step, rank, world_size, replicated, where, locator, shared,
        reshardable], ...]}``.
    """
    held = []
    for info in infos:
        where = REPLICA if os.path.basename(os.path.dirname(info.path)) == "replicas" else SLOT
        held.append(Held(info.step, info.rank, info.world_size, bool(info.replicated), where, info.path,
                         reshardable=bool(getattr(info, "reshardable", False))))
    if persisted is not None:
        step, paths, replicated = persisted
        for rank, path in sorted(paths.items()):
            named = rank_and_world(path)
            ws = named[1] if named else 0
            held.append(Held(step, rank, ws, bool(replicated), DISK, path, shared))
    if dcp is not None:
        step, path = dcp
        held.append(Held(step, 0, 0, False, DISK, path, shared, True))
    return {"v": DOC_VERSION, "addr": node_addr, "held": [list(h) for h in held]}


def held_from_doc(doc: Any) -> list[Held]:
    """The :class:`Held` entries of a document from :func:`inventory_doc` (version 1 or 2; a 7-field entry is not
    reshardable); malformed entries or documents: skipped."""
    if not isinstance(doc, dict) or doc.get("v") not in _READ_VERSIONS or not isinstance(doc.get("held"), list):
        return []
    out = []
    for e in doc["held"]:
        if not (isinstance(e, list) and (len(e) == 7 or (len(e) == 8 and doc["v"] >= 2))):
            continue
        step, rank, ws, replicated, where, locator, shared = e[:7]
        reshardable = e[7] if len(e) == 8 else False
        if (all(type(x) is int for x in (step, rank, ws)) and where in (SLOT, REPLICA, DISK)
                and isinstance(locator, str) and all(isinstance(x, bool) for x in (replicated, shared, reshardable))):
            out.append(Held(step, rank, ws, replicated, where, locator, shared, reshardable))
    return out


def addr_from_doc(doc: Any) -> str:
    """The fetch address a document names ("" when it names none)."""
    addr = doc.get("addr") if isinstance(doc, dict) else None
    return addr if isinstance(addr, str) else ""
