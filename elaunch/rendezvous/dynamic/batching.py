"""Batched joins: a crowd of nodes joins one round in a bounded number of store round trips.

torch's join (and ours without this) has every node compare-and-set its own
addition into the one state key. When N nodes arrive together only one write
in each wave wins; the N-1 others read again and retry, so a node makes O(N)
round trips and the round O(N^2). With a backend that keeps an intent log
(``RendezvousBackend.supports_intents``; c10d does), a joining node instead:

1. posts a join intent (``state.JoinIntent``) to the round's log;
2. if its post was the round's first it is the round's *combiner*: it writes the
   state with every pending intent added (``merge.combine_joins`` /
   ``merge.combine_pending``), then blocks until the next post, and repeats;
3. any other node blocks until the round's notice (completed or closed), and
   adds itself (with every pending intent) only if the combiner has not added
   it within ``grace`` seconds (the combiner died or stalls).

Participants of a forming round keep alive without a contended write, in their
heartbeat keys (``supports_heartbeat_keys``; every backend with an intent log
has them); an intent's time also counts as a heartbeat of its node
(``merge.fold_intents``). The state machine (``ops.decide_join``)
is unchanged: batching only changes who writes the additions, and when.

Restarts use the same log: a participant leaving a complete round posts its
intent for the next round, and that round's combiner removes every poster in one
write (``merge.combine_exits``; the executor drives it).
Stdlib only.
"""

from __future__ import annotations

import time
from typing import Callable

from elaunch.rendezvous.api import NodeInfo
from elaunch.rendezvous.dynamic import ops
from elaunch.rendezvous.dynamic.backend import RendezvousBackend, Token
from elaunch.rendezvous.dynamic.reading import read_state_and_intents
from elaunch.rendezvous.dynamic.settings import RendezvousSettings
from elaunch.rendezvous.dynamic.state import JoinIntent, RendezvousState


class BatchedJoin:
    """One node's batched join of one round (see the module docstring).

    Args:
        backend: a backend with ``supports_intents``.
        node_id, node_info: who joins.
        previous_rank: its rank in its previous round, or -1.
        settings: the rendezvous settings; ``keep_alive_interval`` seconds is the
            grace a non-combiner gives the combiner before adding itself.
        clock: seconds since the epoch (default ``time.time``).
    """

    def __init__(self, backend: RendezvousBackend, node_id: str, node_info: NodeInfo, previous_rank: int,
                 settings: RendezvousSettings, clock: Callable[[], float] = time.time) -> None:
        self._backend = backend
        self._clock = clock
        self._node_id = node_id
        self._info = ops.node_info_dict(node_info)
        self._previous_rank = previous_rank
        self._settings = settings
        self.round: int | None = None  # the round we posted our join to
        self.first = False  # ours was the round's first join: we are the combiner
        self.posted_at = 0.0
        self.intents: list[JoinIntent] = []
        self.position = 0  # the log's position as of the last read (backend-defined)
        self.notified = False  # the last wait ended with the round's notice

    @property
    def grace(self) -> float:
        """Seconds a non-combiner waits for the combiner before adding itself."""
        return self._settings.keep_alive_interval

    def active(self, state: RendezvousState) -> bool:
        """True when we posted our join to ``state``'s round."""
        return self.round is not None and self.round == state.round

    @property
    def combiner(self) -> bool:
        """True when this node posted the round's first join: it adds everyone who posts."""
        return self.first

    def may_add_self(self, now: float) -> bool:
        """True for the combiner, and for anyone the combiner left out for ``grace`` seconds."""
        return self.combiner or now >= self.posted_at + self.grace

    def post(self, round: int, now: float) -> None:
        """Post our join intent to ``round`` (c10d: 3 store calls, etcd: 1 transaction)."""
        self.first = self._backend.post_intent(round, self._intent(round, now))
        self.round, self.posted_at, self.notified = round, now, False

    def read(self, known: RendezvousState) -> tuple[RendezvousState, Token]:
        """Read the state with the log (1 store call); the log's heartbeats folded in.

        With per-node heartbeat keys, those of ``known``'s nodes are read and
        folded in too (``reading.read_state_and_intents``).

        Raises:
            RendezvousConnectionError, RendezvousStateError: from the backend.
        """
        assert self.round is not None
        read = read_state_and_intents(self._backend, self.round, known,
                                      self._clock() - self._settings.keep_alive_interval)
        self.intents, self.position = read.intents, read.position
        return read.state, read.token

    def wait(self, state: RendezvousState, timeout: float) -> None:
        """Block up to ``timeout`` seconds: the combiner for the next post, others for the notice."""
        assert self.round is not None
        if self.combiner and self._node_id in state.participants:
            self.notified = False
            self._backend.wait_for_arrival(self.round, self.position, timeout)
        else:
            self.notified = self._backend.wait_for_round(self.round, timeout)

    def _intent(self, round: int, now: float) -> bytes:
        return JoinIntent(self._node_id, self._info, self._previous_rank, round, now).to_bytes()
