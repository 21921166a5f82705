"""When the store last stalled for this node: the time its peers' silence is counted from.

A running member judges its ring neighbours lost when their heartbeats lag
(``liveness.lost_members``). A lapse counts against a node only while the store
answered the observer: during an etcd leader election, a slow or frozen
leader, or a stalled TCPStore host, no node's beat lands, and the node whose
client happened to be on the unlucky endpoint lands its next one a little
later than the others. etcd's own leases follow the same rule (a new leader
renews every lease). So each observer notes the end of its own last stall --
one of its requests to the store that failed, or took longer than
``slow_after`` seconds -- and a neighbour's silence is counted from the later of
its last beat and that moment: after a stall, every neighbour gets a whole
``lost_after`` again. A host killed outright, or cut off, still loses while the
store answers the survivors. Stdlib only.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Callable

from elaunch.rendezvous.contract import RendezvousError
from elaunch.rendezvous.dynamic.settings import RendezvousSettings

#: A request slower than ``lost_after`` divided by this is a stall (0.75 s of the default 3 s).
SLOW_FRACTION = 4


def slow_after(settings: RendezvousSettings) -> float:
    """Seconds after which one request of this node to the store counts as a stall: ``lost_after / 4``."""
    return settings.member_lost_after / SLOW_FRACTION


def beat_timeout(settings: RendezvousSettings) -> float:
    """Seconds one heartbeat write may take before it is given up: ``lost_after / 2``, at most ``heartbeat_timeout``.

    A beat lost in the store's stall (etcd drops a proposal made during a leader
    election; the client waits out its whole RPC timeout) would land a time already
    older than ``lost_after``; given up, the next beat carries a fresh one.
    """
    return min(settings.heartbeat_timeout, settings.member_lost_after / 2)


class StoreStalls:
    """The end of this node's last store stall, fed by its heart-beats and its monitor's reads.

    Thread-safe enough for its use: the keep-alive thread and the monitor each
    only move :attr:`ended` forward.

    Args:
        clock: seconds since the epoch (the clock heartbeats are written in).
        slow_after: seconds after which a request that succeeded still counts as a stall.
    """

    def __init__(self, clock: Callable[[], float], slow_after: float) -> None:
        self._clock = clock
        self._slow_after = slow_after
        self.ended = 0.0  # seconds since the epoch; 0: no stall seen

    def note(self) -> None:
        """Record that a stall of this node's requests ended now."""
        self.ended = max(self.ended, self._clock())

    @contextmanager
    def timing(self) -> Iterator[None]:
        """Time one request to the store: a ``RendezvousError`` from it, or taking over ``slow_after`` s, is a stall.

        Raises:
            Whatever the request raises (re-raised after it was noted).
        """
        started = time.monotonic()
        try:
            yield
        except RendezvousError:
            self.note()
            raise
        if time.monotonic() - started > self._slow_after:
            self.note()
