"""One round's exchange of small JSON documents between the members, over the backend's node keys.

``DynamicJobChannel.exchange`` runs it (the in-memory checkpoints' inventories,
issue 24): every member writes its document for round ``r`` to its own node key
``exchange-<kind>`` (beside the state, never in it: no round changes), tagged
``{"round": r, "doc": ...}``, and reads the others' keys until every member's
holds round ``r``. A key still holding an older round is not this round's (it is
waited for); a key holding a newer round means that member moved on and will not
publish ``r`` (it is not waited for). Each node overwrites its one key per kind,
so the keys are bounded by the nodes the job ever had.

**Agreement.** When a member is late, the nodes' deadlines fall at different
times, and one node could take a document that another gave up on: their plans
(``checkpoint.plan.choose``) would then differ. So the member with the lowest
node id (the leader) rewrites its key once its own wait ended, with the node ids
it took (``"agreed"``); every other member, after its own wait, waits for that
list and returns exactly those documents (reading again the ones it had not seen,
dropping the ones the leader had not taken, its own included). Only when the
leader's list does not come (the leader is gone, or moved to a newer round) does
a member return what it saw itself (logged). Stdlib only.
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Iterable
from typing import Callable

from elaunch.rendezvous.contract import RendezvousError
from elaunch.rendezvous.dynamic.backend import RendezvousBackend

log = logging.getLogger("elaunch.rendezvous.dynamic.handler")

#: Longest pause between two reads of the members' keys, in seconds (the first ones are shorter).
MAX_POLL = 0.02
FIRST_POLL = 0.002
_KIND = re.compile(r"[A-Za-z0-9_]+")


def key_kind(kind: str) -> str:
    """The node-key kind an exchange of ``kind`` uses (``exchange-<kind>``).

    Raises:
        ValueError: ``kind`` is empty or has characters other than letters, digits and ``_``.
    """
    if not _KIND.fullmatch(kind):
        raise ValueError(f"exchange kind {kind!r}: use letters, digits and '_' only")
    return f"exchange-{kind}"


class NodeExchange:
    """Runs exchanges for one node over ``backend``'s node keys.

    Args:
        backend: ``put_node_key`` / ``get_node_keys``.
        node_id: this node's id.
        sleep: sleeps seconds; monotonic: a clock in seconds (injectable for tests).
    """

    def __init__(self, backend: RendezvousBackend, node_id: str, sleep: Callable[[float], None] = time.sleep,
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        self._backend = backend
        self._me = node_id
        self._sleep = sleep
        self._now = monotonic

    def run(self, kind: str, round: int, doc: dict, members: Iterable[str], timeout: float) -> dict[str, dict]:
        """Publish ``doc`` for ``round`` and return the members' documents of ``round`` the leader agreed on.

        Waits up to ``timeout`` seconds for the members' documents, then (not the
        leader) up to ``timeout`` seconds more for the leader's list. Backend errors
        are logged at DEBUG and waited through: a member whose document cannot be
        read counts as having published none.

        Returns:
            node id -> document; this node's own unless the leader left it out.

        Raises:
            ValueError: a bad ``kind`` (see :func:`key_kind`); TypeError, ValueError: ``doc`` is not JSON.
        """
        key = key_kind(kind)
        members = sorted(set(members) | {self._me})
        mine = {"round": round, "doc": doc}
        self._put(key, mine)
        docs, _gone = self._collect(key, round, members, {self._me: doc}, self._now() + timeout)
        leader = members[0]
        if leader == self._me:
            if len(members) > 1:
                self._put(key, {**mine, "agreed": sorted(docs)})
            return docs
        deadline = self._now() + timeout
        agreed = self._agreed(key, round, leader, deadline)
        if agreed is None:
            log.warning("node %s: no agreed %s exchange of round %d from %s; using the %d document(s) seen here",
                        self._me, kind, round, leader, len(docs))
            return docs
        late = [n for n in agreed if n not in docs]
        if late:
            docs.update(self._collect(key, round, late, {}, deadline)[0])  # the leader read them: they are there
        return {n: docs[n] for n in agreed if n in docs}

    def _put(self, key: str, value: dict) -> None:
        data = json.dumps(value, separators=(",", ":")).encode()
        try:
            self._backend.put_node_key(key, self._me, data)
        except RendezvousError as exc:
            log.debug("node %s could not publish its %s document: %s", self._me, key, exc)

    def _read(self, key: str, nodes: list[str]) -> dict[str, dict]:
        """The parsed keys of ``nodes`` (unreadable, missing and malformed ones left out)."""
        try:
            raw = self._backend.get_node_keys(key, nodes)
        except RendezvousError as exc:
            log.debug("node %s could not read %s documents: %s", self._me, key, exc)
            return {}
        out = {}
        for node, data in raw.items():
            try:
                value = json.loads(data)
            except ValueError:
                continue
            if isinstance(value, dict) and isinstance(value.get("round"), int) and isinstance(value.get("doc"), dict):
                out[node] = value
        return out

    def _collect(self, key: str, round: int, nodes: list[str], docs: dict[str, dict],
                 deadline: float) -> tuple[dict[str, dict], set[str]]:
        """Read until each of ``nodes`` published ``round`` or a newer one, or ``deadline``; (docs, moved on)."""
        gone: set[str] = set()
        pause = FIRST_POLL
        while True:
            pending = [n for n in nodes if n not in docs and n not in gone]
            if pending:
                for node, value in self._read(key, pending).items():
                    if value["round"] == round:
                        docs[node] = value["doc"]
                    elif value["round"] > round:
                        gone.add(node)  # moved on to a newer round: it will not publish this one
                pending = [n for n in pending if n not in docs and n not in gone]
            if not pending or self._now() >= deadline:
                return docs, gone
            self._sleep(pause)
            pause = min(MAX_POLL, pause * 2)

    def _agreed(self, key: str, round: int, leader: str, deadline: float) -> list[str] | None:
        """Wait for the leader's list of ``round``; None when it moved on or ``deadline`` passed first."""
        pause = FIRST_POLL
        while True:
            value = self._read(key, [leader]).get(leader)
            if value is not None and value["round"] > round:
                return None
            agreed = value.get("agreed") if value is not None and value["round"] == round else None
            if isinstance(agreed, list) and all(isinstance(n, str) for n in agreed):
                return agreed
            if self._now() >= deadline:
                return None
            self._sleep(pause)
            pause = min(MAX_POLL, pause * 2)
