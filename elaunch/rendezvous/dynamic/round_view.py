"""One node's view of its running round in the shared state, shared by the handler and its job channel.

Holds what both need: the round this node last joined (its info, members and the
ring neighbours whose heartbeats it judges), the cached read of the state that
the agent's monitor polls (at most ``poll_interval`` seconds old), and the count
of the round's lost members. The handler sets the round when one forms
(:meth:`RoundView.enter`); the handler's ``num_nodes_waiting`` and the channel's
job state, lost and new counts read through :meth:`RoundView.read`. Stdlib only.
"""

from __future__ import annotations

import time
from typing import Callable

from elaunch.rendezvous.contract import RendezvousInfo
from elaunch.rendezvous.dynamic import liveness
from elaunch.rendezvous.dynamic.backend import RendezvousBackend
from elaunch.rendezvous.dynamic.reading import read_watched
from elaunch.rendezvous.dynamic.settings import RendezvousSettings
from elaunch.rendezvous.dynamic.state import RendezvousState
from elaunch.rendezvous.dynamic.stalls import StoreStalls


class RoundView:
    """This node's running round and its cached read of the shared state.

    Args:
        node_id: this node's id in the state.
        settings: ``poll_interval`` (seconds a cached read is reused), ``fresh_for`` and the liveness rules.
        backend: where the state lives.
        clock: seconds since the epoch.
        stalls: when the store last stalled for this node (a read that failed or was slow notes one).

    Attributes:
        info: the round this node last joined, or None before the first.
        members: node ids of that round (empty before the first).
        watched: this node and the members whose heartbeats it judges (its ring neighbours).
        on_read: called with each state read from the backend (the handler answers probes there).
    """

    def __init__(self, node_id: str, settings: RendezvousSettings, backend: RendezvousBackend,
                 clock: Callable[[], float], stalls: StoreStalls) -> None:
        self.node_id = node_id
        self._settings = settings
        self._backend = backend
        self._clock = clock
        self.stalls = stalls
        self.info: RendezvousInfo | None = None
        self.members: frozenset[str] = frozenset()
        self.watched: tuple[str, ...] = ()
        self.on_read: Callable[[RendezvousState], None] = lambda state: None
        self._cached: tuple[float, RendezvousState] | None = None
        self._written = False  # the backend's watch saw a write since the cached read

    def enter(self, members: frozenset[str]) -> None:
        """This node joined a round of ``members``: watch its ring neighbours from now on."""
        self.members = members
        self.watched = (self.node_id, *liveness.ring_neighbours(members, self.node_id))

    def state_written(self) -> None:
        """The backend's watch saw a write: the cached read is stale (called from the watch's thread)."""
        self._written = True

    def invalidate(self) -> None:
        """Forget the cached read: the next :meth:`read` goes to the backend."""
        self._cached = None

    def cached(self) -> RendezvousState | None:
        """The cached read, whatever its age, or None."""
        return None if self._cached is None else self._cached[1]

    def read(self) -> RendezvousState:
        """Read the state; reuse a read younger than ``poll_interval`` seconds.

        The heartbeat keys read are this node's and its ring neighbours'
        (``reading.read_watched``): O(1) keys per read, however many nodes the round has.
        Where the backend watches the state (etcd-v3), a write seen since the cached
        read makes it stale at once: another node's failure or verdict reaches the
        monitor at its next check, not ``poll_interval`` seconds later.

        Raises:
            RendezvousConnectionError: the backend is unreachable.
            RendezvousStateError: the stored state is corrupt.
        """
        now = time.monotonic()
        if self._cached is not None and not self._written and now - self._cached[0] < self._settings.poll_interval:
            return self._cached[1]
        self._written = False  # before the read: a write during it makes the next check read again
        with self.stalls.timing():  # a failed or slow read: the store stalled for this node
            state, _token = read_watched(self._backend, self.watched, self.members,
                                         self._clock() - self._settings.fresh_for)
        self._cached = (now, state)
        self.on_read(state)
        return state

    def lost(self, state: RendezvousState) -> int:
        """How many members of this node's round ``state`` shows gone (``liveness.lost_members``); 0 before a round."""
        if self.info is None:
            return 0
        return liveness.lost_members(state, self.info.round, self.members, self.node_id, self._settings,
                                self.watched[1:], self.stalls.ended)

    def left(self, state: RendezvousState) -> int:
        """How many members of this node's round have left the rendezvous (``liveness.members_left``);
        0 before a round."""
        if self.info is None:
            return 0
        return liveness.members_left(state, self.info.round, self.members, self.node_id, self._settings,
                                     self.watched[1:], self.stalls.ended)
