"""The one interface a storage backend implements for the dynamic rendezvous.

Mirrors torch's ``RendezvousBackend`` (``dynamic_rendezvous.py``): an opaque
blob read and written with compare-and-set. c10d (TCPStore) implements it now;
etcd v2/v3 later. Stdlib only.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from typing import Any

#: Opaque version marker of a stored state: whatever the backend compares on
#: (c10d: the stored bytes themselves; etcd: a revision / modified index).
Token = Any


class RendezvousBackend(abc.ABC):
    """Stores one run id's rendezvous state blob with compare-and-set."""

    @property
    @abc.abstractmethod
    def name(self) -> str:
        """The backend's registry name (``"c10d"``, ...)."""

    def never_reached(self) -> bool:
        """True when the backend's store is not made (yet, or at all): this node wrote nothing to
        close or leave. Never waits. Default: False.

        c10d's agent store may be made in a background thread (``c10d_agent_store.AgentStore``): its
        failure is the run's error, and closing the rendezvous would only fail again; a
        signal that stops the agent while it is still being reached leaves at once.
        """
        return False

    @abc.abstractmethod
    def get_state(self) -> tuple[bytes | None, Token]:
        """Return the stored state and its token; ``(None, token)`` when none was written yet.

        Raises:
            RendezvousConnectionError: the backend cannot be reached.
        """

    def get_stored_state(self) -> tuple[bytes | None, Token]:
        """Return the state and its token as stored, with nothing about liveness laid over them.

        For a reader that judges no node's liveness on this read
        (``reading.read_state_only``). Default: :meth:`get_state`. A backend whose
        :meth:`get_state` reads more than the state key to tell who is dead (etcd-v3:
        every node's presence key, 1,024 keys at 1,024 nodes) reads the one key here.

        Raises:
            RendezvousConnectionError: the backend cannot be reached.
        """
        return self.get_state()

    def get_state_token(self) -> Token:
        """Return the stored state's token alone (None when no state was written yet).

        For a node that only wants to know whether the state changed since it last
        looked (a batched join's grace, ``batching.BatchedJoin.wait``). Default: the
        token of :meth:`get_stored_state`. etcd-v3 reads the key's revision without
        its value; c10d's token is the value itself.

        Raises:
            RendezvousConnectionError: the backend cannot be reached.
        """
        return self.get_stored_state()[1]

    @abc.abstractmethod
    def set_state(self, state: bytes, token: Token | None) -> tuple[bytes, Token, bool] | None:
        """Write ``state`` if the stored one still has ``token`` (None: nothing stored yet).

        Returns:
            ``(current_state, current_token, written)``: what is stored after the
            attempt and whether it is ours; or None when the backend cannot tell
            (the caller reads again).

        Raises:
            RendezvousConnectionError: the backend cannot be reached.
        """

    def wait_for_change(self, token: Token | None, timeout: float) -> bool:
        """Block up to ``timeout`` seconds, returning early once the stored state's token is not ``token``.

        A polling node's wait between reads (``Action.SYNC``): etcd watches the
        state key and returns at its next write.

        Returns:
            True when it waited; False (the default: no watch) when the caller must
            sleep ``timeout`` seconds itself.

        Raises:
            RendezvousConnectionError: the backend cannot be reached.
        """
        return False

    # -- heartbeats: each node's own key beside the state (every backend) --------------

    @property
    def cheap_heartbeats(self) -> bool:
        """True when a heartbeat write costs next to nothing (c10d: memory on the store host).

        Agents then heart-beat every ``probe_timeout / 4`` seconds instead of
        reading the state that often to look for probes (see the handler).
        """
        return False

    @abc.abstractmethod
    def put_heartbeat(self, node_id: str, at: float) -> None:
        """Write ``at`` (seconds since the epoch) into ``node_id``'s own heartbeat key.

        Heartbeats live in per-node keys, never in the shared state: a beat is an
        uncontended write (torch's keep-alive instead rewrites the state with
        compare-and-set). The state's ``last_heartbeats`` holds each node's beat
        as of the state's last write; readers take the newer of the two
        (``reading.py``). A node writes its key before it first appears in the
        state, so every node a reader knows of has one.

        Raises:
            RendezvousConnectionError: the backend cannot be reached.
        """

    def beat(self, node_id: str, at: float) -> None:
        """:meth:`put_heartbeat` from the node's keep-alive thread (``keepalive.KeepAlive``).

        Nothing waits on that thread, so a backend may skip what bounds its calls
        in time for the others (c10d: the hand-off to a pooled thread); a stalled
        server then stalls only the keep-alive thread, which the handler abandons
        after ``heartbeat_timeout + 1`` seconds. Default: :meth:`put_heartbeat`.

        Raises:
            As :meth:`put_heartbeat`.
        """
        self.put_heartbeat(node_id, at)

    @abc.abstractmethod
    def get_heartbeats(self, nodes: Sequence[str]) -> dict[str, float]:
        """Return the heartbeat keys of ``nodes`` (seconds since the epoch); a node without one is left out.

        A backend may return more nodes' keys than asked (etcd-v3 reads them all).

        Raises:
            RendezvousConnectionError: the backend cannot be reached.
        """

    @abc.abstractmethod
    def get_state_and_heartbeats(self, nodes: Sequence[str]) -> tuple[bytes | None, Token, dict[str, float]]:
        """Return ``get_state()`` plus the heartbeat keys of ``nodes`` (as :meth:`get_heartbeats`), in one round trip.

        Raises:
            RendezvousConnectionError: the backend cannot be reached.
        """

    # -- small per-node documents for `elaunch status` (not the state; every backend) -------

    @abc.abstractmethod
    def put_node_key(self, kind: str, node_id: str, data: bytes) -> None:
        """Write (or overwrite) ``node_id``'s document of ``kind`` (``"agent"``, ``"stacks"``).

        These keys sit beside the state (``{prefix}/{kind}/{node}``), never in it:
        writing one changes no round. Each node overwrites its own key, so their
        number is bounded by the nodes the job ever had (etcd: on the state's TTL).

        Raises:
            RendezvousConnectionError: the backend cannot be reached.
        """

    @abc.abstractmethod
    def get_node_keys(self, kind: str, nodes: Sequence[str]) -> dict[str, bytes]:
        """Return the documents of ``kind`` that ``nodes`` wrote; a node that wrote none is left out.

        Never waits for a key to appear.

        Raises:
            RendezvousConnectionError: the backend cannot be reached.
        """

    # -- optional: a watch on the state (etcd-v3 has one) --------------------------------

    def watch_state(self, on_change: Callable[[], None]) -> Callable[[], None] | None:
        """Call ``on_change()`` (from another thread) after each write of the state, until stopped.

        Lets a running node's monitor see what another node wrote (a failure, the
        job's verdict) at its next check, without reading the state at every check.

        Returns:
            A function that stops the watch; None when the backend has no watch (the
            monitor then re-reads the state every ``poll_interval`` seconds).
        """
        return None

    # -- optional: batched joins and wake-ups (c10d has them; see batching.py) ---------

    @property
    def supports_intents(self) -> bool:
        """True when the intent-log methods below work (else they raise NotImplementedError)."""
        return False

    def post_intent(self, round: int, intent: bytes) -> bool:
        """Append one join intent (a line, ``state.JoinIntent``) to ``round``'s log.

        It also wakes a node blocked in :meth:`wait_for_arrival`.

        Returns:
            True when this was the round's first join: this node is the combiner.

        Raises:
            NotImplementedError: no intent log (``supports_intents`` is False).
            RendezvousConnectionError: the backend cannot be reached.
        """
        raise NotImplementedError(f"{self.name}: no intent log")

    def get_state_and_intents(self, round: int, nodes: Sequence[str] = ()
                              ) -> tuple[bytes | None, Token, bytes, int, dict[str, float]]:
        """Return the state, its token, ``round``'s intent log, the log's position and heartbeats, in one round trip.

        Only called after this node posted to ``round``. The position is opaque
        (c10d: joins so far; etcd: a revision), for :meth:`wait_for_arrival`.
        ``nodes``: whose heartbeat keys to read (see :meth:`get_state_and_heartbeats`).

        Raises:
            NotImplementedError: no intent log.
            RendezvousConnectionError: the backend cannot be reached.
        """
        raise NotImplementedError(f"{self.name}: no intent log")

    def wait_for_arrival(self, round: int, position: int, timeout: float) -> bool:
        """Block up to ``timeout`` seconds until a join (or notice) is posted to ``round`` after ``position``.

        Returns:
            True when one was, False when the time ran out.

        Raises:
            NotImplementedError: no intent log.
            RendezvousConnectionError: the backend cannot be reached.
        """
        raise NotImplementedError(f"{self.name}: no intent log")

    def notify_round(self, round: int) -> None:
        """Announce that ``round`` completed or the rendezvous closed.

        Wakes :meth:`wait_for_round` and :meth:`wait_for_arrival`.
        A no-op for backends without an intent log.
        """

    #: Rounds a round's notices and log are kept after it completed: round ``r``'s are
    #: forgotten when round ``r + FORGET_AFTER`` completes. By then every participant of
    #: round ``r`` has left it and joined a later round, so only a node frozen that long
    #: (pruned as dead meanwhile) can still look for them.
    FORGET_AFTER = 2

    def forget_round(self, round: int) -> None:
        """Delete ``round``'s log and notices, so a long job holds a bounded number of keys.

        Called once per round, by the node whose write completed round
        ``round + FORGET_AFTER``. A reader of a forgotten round's log gets an empty
        log (the state shows the round is over) and a wait on its notices times out.
        A no-op for backends without an intent log, and for those whose keys expire
        by themselves.

        Raises:
            RendezvousConnectionError: the backend cannot be reached.
        """

    def wait_for_round(self, round: int, timeout: float) -> bool:
        """Block up to ``timeout`` seconds until :meth:`notify_round` was called for ``round``; True if it was.

        Raises:
            NotImplementedError: no intent log.
            RendezvousConnectionError: the backend cannot be reached.
        """
        raise NotImplementedError(f"{self.name}: no round notices")
