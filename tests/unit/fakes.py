"""Small, real fakes for unit tests (no torch, no network).

``InMemoryBackend`` is a complete compare-and-set backend for the dynamic
rendezvous, with per-node heartbeat keys, shared between handler objects in
threads of one process. ``FakeRoundStores`` hands out a made-up workers' store
per round. ``IntentBackend`` adds c10d's intent log and round notices (batched joins and exits); with a
``SimClock`` its waits run scripted hooks and advance simulated time, so one
node's batched paths run as a table, in one thread.
"""

from __future__ import annotations

import threading

from elaunch.rendezvous.contract import NodeInfo
from elaunch.rendezvous.dynamic.backend import RendezvousBackend
from elaunch.rendezvous.dynamic.handler import RoundStores, RoundStoreFactory
from elaunch.rendezvous.dynamic.state import JoinIntent


class InMemoryBackend(RendezvousBackend):
    """A state blob behind a lock, the token a version number (0: nothing stored); heartbeats in ``beats``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._data: bytes | None = None
        self._version = 0
        self.writes = 0
        self.node_keys: dict[tuple[str, str], bytes] = {}
        self.beats: dict[str, float] = {}

    @property
    def name(self) -> str:
        return "in-memory"

    def put_node_key(self, kind: str, node_id: str, data: bytes) -> None:
        self.node_keys[kind, node_id] = data

    def get_node_keys(self, kind: str, nodes):
        return {n: self.node_keys[kind, n] for n in nodes if (kind, n) in self.node_keys}

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

    def put_heartbeat(self, node_id: str, at: float) -> None:
        with self._lock:
            self.beats[node_id] = at

    def get_heartbeats(self, nodes):
        with self._lock:
            return {n: self.beats[n] for n in nodes if n in self.beats}

    def get_state_and_heartbeats(self, nodes):
        with self._lock:
            return self._data, self._version, {n: self.beats[n] for n in nodes if n in self.beats}


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


class SimClock:
    """Simulated seconds since the epoch for single-threaded tables: sleeping advances it."""

    def __init__(self, start: float = 1_000_000.0) -> None:
        self.now = start

    def time(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += max(0.0, seconds)


class IntentBackend(InMemoryBackend):
    """``InMemoryBackend`` with c10d's intent log, tickets and round notices (``supports_intents``).

    As in ``C10dBackend``: round r's log grows by one line per post; each post takes
    a ticket (ticket 1 is the round's combiner) and a notice takes one too (it wakes
    the combiner); the log's position is the number of tickets taken.
    ``wait_for_arrival``/``wait_for_round`` block on a condition (threads, real
    time); given a :class:`SimClock` they instead run the hooks scripted with
    :meth:`on` (what other nodes do meanwhile) and, when still not satisfied,
    advance the clock by the timeout and return False. ``calls`` lists every
    backend method called, in order.
    """

    def __init__(self, clock: SimClock | None = None) -> None:
        super().__init__()
        self._cond = threading.Condition(self._lock)
        self.clock = clock
        self.logs: dict[int, list[bytes]] = {}
        self.tickets: dict[int, int] = {}
        self.notices: set[int] = set()
        self.calls: list[str] = []
        self._hooks: dict[str, list] = {}

    @property
    def supports_intents(self) -> bool:
        return True

    def on(self, method: str, hook) -> None:
        """Run ``hook(self)`` once, at the next call of ``method`` (after a post, before a wait's check)."""
        self._hooks.setdefault(method, []).append(hook)

    def _called(self, method: str) -> None:
        self.calls.append(method)
        hooks = self._hooks.pop(method, [])
        for hook in hooks:
            hook(self)

    def get_state(self):
        self.calls.append("get_state")
        return super().get_state()

    def get_stored_state(self):
        self.calls.append("get_stored_state")
        return super().get_state()

    def get_state_token(self):
        self.calls.append("get_state_token")
        return super().get_state()[1]

    def set_state(self, state: bytes, token):
        self.calls.append("set_state")
        return super().set_state(state, token)

    def put_heartbeat(self, node_id: str, at: float) -> None:
        self.calls.append("put_heartbeat")
        super().put_heartbeat(node_id, at)

    def get_heartbeats(self, nodes):
        self.calls.append("get_heartbeats")
        return super().get_heartbeats(nodes)

    def get_state_and_heartbeats(self, nodes):
        self.calls.append("get_state_and_heartbeats")
        return super().get_state_and_heartbeats(nodes)

    def post_intent(self, round: int, intent: bytes) -> bool:
        first = self._append(round, intent)
        self._called("post_intent")
        return first

    def _append(self, round: int, intent: bytes) -> bool:
        with self._cond:
            self.logs.setdefault(round, []).append(intent)
            ticket = self.tickets[round] = self.tickets.get(round, 0) + 1
            self._cond.notify_all()
        return ticket == 1

    def get_state_and_intents(self, round: int, nodes=()):
        self.calls.append("get_state_and_intents")
        with self._lock:
            beats = {n: self.beats[n] for n in nodes if n in self.beats}
            return self._data, self._version, b"".join(self.logs.get(round, [])), self.tickets.get(round, 0), beats

    def notify_round(self, round: int) -> None:
        self.calls.append("notify_round")
        self.announce(round)

    def announce(self, round: int) -> None:
        """``notify_round`` as another node's (not among ``calls``)."""
        with self._cond:
            self.notices.add(round)
            self.tickets[round] = self.tickets.get(round, 0) + 1  # wakes the combiner
            self._cond.notify_all()

    def wait_for_arrival(self, round: int, position: int, timeout: float) -> bool:
        self._called("wait_for_arrival")
        return self._wait(lambda: self.tickets.get(round, 0) > position, timeout)

    def wait_for_round(self, round: int, timeout: float) -> bool:
        self._called("wait_for_round")
        return self._wait(lambda: round in self.notices, timeout)

    def _wait(self, arrived, timeout: float) -> bool:
        with self._cond:
            if self.clock is None:
                return self._cond.wait_for(arrived, timeout)
            if arrived():
                return True
        self.clock.sleep(timeout)
        return False

    def post(self, node: str, round: int, at: float, previous_rank: int = -1) -> bool:
        """Post ``node``'s join intent (another node's, to seed a test); True when it is the combiner."""
        info = NodeInfo(node, "trainer", 1)
        return self._append(round, JoinIntent(node, info, previous_rank, round, at).to_bytes())
