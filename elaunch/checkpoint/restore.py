"""One round's restore on one node: from every node's inventory document to each local rank's file.

The keeper (``checkpoint.keeper``) exchanges the documents; :class:`RoundRestore`
turns them into the plan (``checkpoint.plan.choose``: the one step of the job and a
source per rank) and gathers this node's files: its own slots and replicas as they
are, a peer's memory fetched into ``restore/`` (``checkpoint.replicas.fetch``), a persisted
file as it is. A source that cannot be read is replaced by another holder of the
same step (own memory, a peer's, then disk); when none is left the rank's file is
named but missing, so its worker's ``ckpt.load()`` fails rather than resume from
another step than its peers. Also the pure helpers the keeper needs for a round: the
ranks of each node and the replica ring. Stdlib only.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping, Sequence

from elaunch.checkpoint import plan as planner

log = logging.getLogger("elaunch.agent")

#: The event's name of each kind of source (``checkpoint_restore``'s ``sources``).
MEMORY, PEER, DISK, MISSING = "memory", "peer", "disk", "missing"


def ranks_by_group(nodes: Sequence, world_size: int, local_world_size: int) -> dict[str, list[int]]:
    """Group rank (as text) -> its global ranks: contiguous per node in group-rank order (``ranks.assign_ranks``).

    Args:
        nodes: the round's ``NodeInfo`` in group-rank order, or () (every node runs ``local_world_size``).
        world_size: the number of nodes.
    """
    sizes = [n.local_world_size for n in nodes] if nodes else [local_world_size] * world_size
    out, base = {}, 0
    for g, size in enumerate(sizes):
        out[str(g)] = list(range(base, base + size))
        base += size
    return out


def successors(addrs: Mapping[str, str], me: str, n: int) -> list[tuple[str, tuple[str, int]]]:
    """The next ``n`` nodes after ``me`` by group rank that named a replica address: ``[(group rank, (host, port))]``.

    ``addrs``: group rank (text) -> ``host:port`` (``[v6]:port``); ``me`` must be one of them.
    """
    order = sorted(addrs, key=int)
    if me not in order or n <= 0:
        return []
    at = order.index(me)
    out = []
    for g in order[at + 1:] + order[:at]:
        host, _, port = addrs[g].rpartition(":")
        if host and port.isdigit() and len(out) < n:
            out.append((g, (host.strip("[]"), int(port))))
    return out


def ring(addrs: Mapping[str, str], me: str, n: int) -> list[tuple[str, int]]:
    """The next ``n`` nodes after ``me`` by group rank that named a replica address: ``[(host, port), ...]``."""
    return [peer for _g, peer in successors(addrs, me, n)]


def source_kind(source: planner.Source, me: str) -> str:
    """``memory`` (this node's slot or replica), ``peer`` (another node's memory) or ``disk``."""
    if source.where == planner.DISK:
        return DISK
    return MEMORY if source.node == me else PEER


def _fetch(host: str, port: int, rank: int, step: int, dest: str, timeout: float, *, key: bytes,
           source: str | None = None) -> bool:
    from elaunch.checkpoint.replicas import fetch

    return fetch(host, port, rank, step, dest, timeout, key=key, source=source)


class RoundRestore:
    """This node's view of one round's restore.

    Args:
        docs: group rank (text) -> that node's document (``plan.inventory_doc``), this node's included.
        me: this node's group rank (text).
        restore_dir: where fetched snapshots go (the node directory's ``restore/``).
        fetch_timeout: seconds one fetch may take.
        fetch: ``(host, port, saved rank, step, dest, timeout, *, key, source) -> bool`` (default
            ``checkpoint.replicas.fetch``).
        keys: group rank (text) -> the key of that node's replica service (a node with none is not fetched from).
        source: this node's address, the source of its fetches' connections (None: the kernel's choice).

    Attributes:
        held: group rank (text) -> what that node holds (``plan.Held`` entries).
    """

    def __init__(self, docs: Mapping[str, dict], me: str, restore_dir: str, fetch_timeout: float,
                 fetch: Callable[..., bool] = _fetch, *, keys: Mapping[str, bytes] | None = None,
                 source: str | None = None) -> None:
        self._docs, self._me, self._dir, self._timeout, self._fetch = docs, me, restore_dir, fetch_timeout, fetch
        self._keys, self._source = dict(keys or {}), source
        self.held = {g: planner.held_from_doc(d) for g, d in docs.items()}

    def plan(self, ranks: Mapping[str, Sequence[int]], world_size: int) -> planner.Plan:
        """``plan.choose`` over every node's holdings (``ranks``: group rank -> its global ranks).

        Raises:
            ValueError: ``ranks`` does not cover ``0 .. world_size - 1`` once each.
        """
        return planner.choose(ranks, self.held, world_size, self._me)

    def gather(self, plan: planner.Plan) -> dict[int, tuple[str, str]]:
        """This node's ranks -> (the file its worker restores, its kind: :data:`MEMORY`, :data:`PEER`,
        :data:`DISK`, or :data:`MISSING` when no holder of the step could be read)."""
        if plan.parts:
            return self._gather_parts(plan)
        files = {}
        for rank, source in sorted(plan.mine.items()):
            for cand in [source, *self._alternatives(plan.step, rank, source)]:
                path = self._obtain(cand, plan.step, f"r{rank}")
                if path:
                    files[rank] = (path, source_kind(cand, self._me))
                    break
            else:
                log.error("checkpoint restore: no source of step %d for rank %d could be read; its worker's "
                          "ckpt.load() fails so that no rank resumes from another step", plan.step, rank)
                files[rank] = (os.path.join(self._dir, f"r{rank}"), MISSING)
        return files

    def _gather_parts(self, plan: planner.Plan) -> dict[int, tuple[str, str]]:
        """Every saved rank's part of the step into this node's memory; each local rank's file one of them.

        The kind is :data:`PEER` for every local rank when some part was fetched, else :data:`MEMORY`;
        :data:`DISK` when a part could not be had and a persisted DCP directory of the step serves instead.
        """
        got: dict[int, tuple[str, str]] = {}
        lacking = []
        for saved, source in sorted(plan.parts_of(self._me).items()):
            for cand in [source, *self._part_alternatives(plan.step, saved, source)]:
                path = self._obtain(cand, plan.step, f"s{saved}")
                if path:
                    got[saved] = (path, source_kind(cand, self._me))
                    break
            else:
                lacking.append(saved)
        if lacking:
            for d in self._dirs(plan.step):
                if os.path.exists(d.locator):
                    log.warning("checkpoint restore: the part of saved rank(s) %s of step %d could not be had; "
                                "this node's ranks read the persisted DCP directory %s", lacking, plan.step, d.locator)
                    return {rank: (d.locator, DISK) for rank in plan.mine}
            log.error("checkpoint restore: the part of saved rank(s) %s of step %d could not be had from any holder; "
                      "this node's workers' dcp.load() fails so that no rank resumes from another step",
                      lacking, plan.step)
            return {rank: (os.path.join(self._dir, f"r{rank}"), MISSING) for rank in plan.mine}
        kind = PEER if any(k == PEER for _p, k in got.values()) else MEMORY
        saved_world = plan.saved_world_size or len(got)
        return {rank: (got[rank % saved_world][0], kind) for rank in plan.mine}

    def _part_alternatives(self, step: int, saved: int, first: planner.Source) -> list[planner.Source]:
        """Other holders of saved rank ``saved``'s reshardable part of ``step`` in memory: own first, then peers."""
        found = []
        for node in sorted(self.held, key=int):
            for h in self.held[node]:
                if h.step == step and h.rank == saved and h.reshardable and h.where in planner.MEMORY:
                    src = planner.Source(node, h.where, h.locator)
                    if src != first and src not in found:
                        found.append(src)
        return sorted(found, key=lambda s: s.node != self._me)

    def _dirs(self, step: int) -> list[planner.Source]:
        """The persisted DCP directories of ``step`` this node reads: its own, then shared ones of others."""
        found = [planner.Source(node, h.where, h.locator) for node in sorted(self.held, key=int)
                 for h in self.held[node] if h.step == step and h.where == planner.DISK and h.reshardable
                 and (node == self._me or h.shared)]
        return sorted(found, key=lambda s: s.node != self._me)

    def _alternatives(self, step: int, rank: int, first: planner.Source) -> list[planner.Source]:
        """Other sources of ``step`` for ``rank``: own memory, peers' memory, own disk, shared disk; when ``first`` is
        a persisted DCP directory, only other such directories (a part alone serves no other world size)."""
        dirs = self._dirs(step)
        if first in dirs:
            return [d for d in dirs if d != first]
        found = []
        for node in sorted(self.held, key=int):
            for h in self.held[node]:
                if h.step != step or not (h.replicated or h.rank == rank) or (h.where == planner.DISK and h.reshardable):
                    continue
                if h.where == planner.DISK and not (node == self._me or h.shared):
                    continue
                src = planner.Source(node, h.where, h.locator)
                if src != first and src not in found:
                    found.append(src)
        found += [d for d in dirs if d != first]  # a whole DCP save of the step: it serves any rank
        return sorted(found, key=lambda s: (s.where == planner.DISK, s.node != self._me))

    def _obtain(self, source: planner.Source, step: int, name: str) -> str:
        """The local path of ``source``'s snapshot (fetched into ``restore/<name>`` from a peer's memory), or ""."""
        if source.where == planner.DISK or source.node == self._me:
            return source.locator if os.path.exists(source.locator) else ""
        saved = next((h.rank for h in self.held.get(source.node, ()) if h.locator == source.locator), None)
        host, _, port = planner.addr_from_doc(self._docs.get(source.node)).rpartition(":")
        key = self._keys.get(source.node)
        if saved is None or not host or not port.isdigit() or not key:
            return ""
        dest = os.path.join(self._dir, name)
        ok = self._fetch(host.strip("[]"), int(port), saved, step, dest, self._timeout, key=key, source=self._source)
        return dest if ok else ""
