"""Small, real fakes for unit tests (no torch, no network).

``InMemoryBackend`` is a complete compare-and-set backend for the dynamic
rendezvous, shared between handler objects in threads of one process.
``FakeRoundStores`` hands out a made-up workers' store per round.
"""

from __future__ import annotations

import threading

from elaunch.rendezvous.api import NodeInfo
from elaunch.rendezvous.dynamic.backend import RendezvousBackend
from elaunch.rendezvous.dynamic.handler import RoundStores, RoundStoreFactory


class InMemoryBackend(RendezvousBackend):
    """A state blob behind a lock; the token is a version number (0: nothing stored)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._data: bytes | None = None
        self._version = 0
        self.writes = 0

    @property
    def name(self) -> str:
        return "in-memory"

    def get_state(self):
        with self._lock:
            return self._data, self._version

    def set_state(self, state: bytes, token):
        with self._lock:
            if (token or 0) == self._version:
                self._data = state
                self._version += 1
                self.writes += 1
                return self._data, self._version, True
            return self._data, self._version, False

    def put(self, state: bytes) -> None:
        """Overwrite the state unconditionally (to seed a test)."""
        with self._lock:
            self._data = state
            self._version += 1


class FakeRoundStores(RoundStoreFactory):
    """Round r's workers' store is ``fake-master:(20000 + r)``; the agent store is a dict."""

    def __init__(self) -> None:
        self.rounds: list[tuple[int, int, int]] = []
        self.closed = False

    def setup_round(self, round: int, rank: int, world_size: int, nodes: tuple[NodeInfo, ...]) -> RoundStores:
        self.rounds.append((round, rank, world_size))
        return RoundStores("fake-master", 20000 + round, True, {})

    def close(self) -> None:
        self.closed = True


class KeyedHeartbeatBackend(InMemoryBackend):
    """``InMemoryBackend`` whose heartbeats live in per-node keys (``supports_heartbeat_keys``)."""

    def __init__(self) -> None:
        super().__init__()
        self.beats: dict[str, float] = {}

    @property
    def supports_heartbeat_keys(self) -> bool:
        return True

    def put_heartbeat(self, node_id: str, at: float) -> None:
        with self._lock:
            self.beats[node_id] = at

    def get_heartbeats(self, nodes):
        with self._lock:
            return {n: self.beats[n] for n in nodes if n in self.beats}

    def get_state_and_heartbeats(self, nodes):
        with self._lock:
            return self._data, self._version, {n: self.beats[n] for n in nodes if n in self.beats}
