"""A store stall counts against no node: the observer's own stalls restart its neighbours' lost_after."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from elaunch.rendezvous.contract import NodeInfo, RendezvousConnectionError
from elaunch.rendezvous.dynamic import liveness
from elaunch.rendezvous.dynamic.handler import DynamicRendezvousHandler
from elaunch.rendezvous.dynamic.settings import RendezvousSettings
from elaunch.rendezvous.dynamic.stalls import StoreStalls, beat_timeout, slow_after
from elaunch.rendezvous.dynamic.state import RendezvousState
from tests.conftest import wait_for
from tests.unit.fakes import FakeRoundStores, InMemoryBackend

S = RendezvousSettings("job", 1, 4, lost_after=3.0)
PAIR = frozenset({"a", "b"})


def _running(b_beat: float) -> RendezvousState:
    return RendezvousState(round=2, complete=True, participants={"a": 0, "b": 1},
                           last_heartbeats={"a": 100.0, "b": b_beat})


@pytest.mark.parametrize("desc, b_beat, stalled_until, expected", [
    ("no stall: b silent 3.5 s is lost", 96.5, 0.0, 1),
    ("a's own stall ended 1 s ago: b's silence counts from there", 96.5, 99.0, 0),
    ("a stall long past gives no grace", 96.5, 96.0, 1),
    ("b silent 3.5 s since a's stall ended", 90.0, 96.5, 1),
    ("a stall is no grace for a node with no beat (its presence lease is gone)", 0.0, 99.0, 1),
])
def test_lost_members_counts_silence_from_the_observers_last_stall(desc, b_beat, stalled_until, expected):
    assert liveness.lost_members(_running(b_beat), 2, PAIR, "a", S, ("b",), stalled_until) == expected, desc


def test_a_failed_or_slow_request_is_a_stall_a_quick_one_is_not():
    now = [1000.0]
    stalls = StoreStalls(lambda: now[0], slow_after=0.05)
    with stalls.timing():
        pass
    assert stalls.ended == 0.0
    with pytest.raises(RendezvousConnectionError), stalls.timing():
        raise RendezvousConnectionError("etcd away")
    assert stalls.ended == 1000.0
    now[0] = 1002.0
    with stalls.timing():
        time.sleep(0.1)  # the request itself, slower than slow_after
    assert stalls.ended == 1002.0


def test_the_rule_scales_with_lost_after():
    assert slow_after(S) == 0.75 and beat_timeout(S) == 1.5
    torch_rule = RendezvousSettings("job", 1, 4, keep_alive_interval=5, keep_alive_max_attempt=3)  # lost after 15 s
    assert beat_timeout(torch_rule) == torch_rule.heartbeat_timeout == 5.0


class HeldBeats(InMemoryBackend):
    """Heartbeat writes of held nodes wait until released: the store does not answer them meanwhile."""

    def __init__(self) -> None:
        super().__init__()
        self._gates: dict[str, threading.Event] = {}

    def hold(self, *nodes: str) -> None:
        for n in nodes:
            self._gates[n] = threading.Event()

    def release(self, *nodes: str) -> None:
        for n in nodes:
            gate = self._gates.pop(n, None)
            if gate is not None:
                gate.set()

    def put_heartbeat(self, node_id: str, at: float) -> None:
        gate = self._gates.get(node_id)
        if gate is not None:
            gate.wait(30)
        super().put_heartbeat(node_id, at)


def test_after_a_store_stall_a_neighbour_gets_a_whole_lost_after_again():
    """Beats of both nodes stall longer than lost_after; the store answers a first, b 1 s later: b is not lost.

    Then b alone stops landing beats while the store answers a (a cut link): b is lost.
    """
    s = RendezvousSettings("job", 2, 2, last_call_timeout=0.1, poll_interval=0.02, lost_after=2.0)
    backend = HeldBeats()
    a, b = (DynamicRendezvousHandler(NodeInfo(n, "trainer", 1), s, backend, FakeRoundStores()) for n in "ab")
    pool = ThreadPoolExecutor(max_workers=2)
    seen: list[int] = []

    def lost() -> int:
        seen.append(a.job_channel().num_nodes_lost())
        return seen[-1]

    try:
        assert {i.world_size for i in pool.map(lambda h: h.next_rendezvous(), (a, b))} == {2}
        backend.hold(a.node_id, b.node_id)  # the store stalls for both
        held = time.time()
        wait_for(lambda: lost() < 0 or time.time() - held > 3.0, 10, what="a stall longer than lost_after")
        backend.release(a.node_id)  # it answers a again; b's beats land 1 s later (< lost_after)
        released = time.time()
        wait_for(lambda: lost() < 0 or time.time() - released > 1.0, 10, what="b held 1 s longer")
        backend.release(b.node_id)
        wait_for(lambda: backend.beats.get(b.node_id, 0.0) > released, 10, what="b's beats landing again")
        assert not any(seen), "a counted b lost for the store's stall"
        backend.hold(b.node_id)  # b cut off, the store answers a: lost after 2 s, as before
        wait_for(lambda: lost() == 1, 2.0 + 5.0, what="b lost while the store answers a")
    finally:
        backend.release(a.node_id, b.node_id)
        for h in (a, b):
            h._stop_heartbeats()
        pool.shutdown(wait=True)
