"""The liveness probe, end to end in threads over the in-memory backend.

Heartbeats are every 5 s and a node counts as dead after 15 s of silence (torch's
rule); the probe lets a waiting node tell a dead participant from a live one in
about ``probe_delay + probe_timeout`` seconds instead.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

from elaunch.rendezvous.contract import NodeInfo
from elaunch.rendezvous.dynamic.handler import DynamicRendezvousHandler
from elaunch.rendezvous.dynamic.settings import RendezvousSettings
from elaunch.rendezvous.dynamic.state import RendezvousState
from tests.conftest import wait_for
from tests.unit.fakes import FakeRoundStores, InMemoryBackend

SETTINGS = RendezvousSettings("job", 1, 2, join_timeout=8, last_call_timeout=30, settle_timeout=0.05,
                              keep_alive_interval=5, keep_alive_max_attempt=3, poll_interval=0.02,
                              probe_delay=0.1, probe_timeout=0.6)


def _state(backend) -> RendezvousState:
    return RendezvousState.from_bytes(backend.get_state()[0])


def test_dead_participant_is_pruned_after_the_probe_not_after_15_s():
    backend = InMemoryBackend()
    a = DynamicRendezvousHandler(NodeInfo("a"), SETTINGS, backend, FakeRoundStores())
    b = DynamicRendezvousHandler(NodeInfo("b"), SETTINGS, backend, FakeRoundStores())
    try:
        assert a.next_rendezvous().world_size == 1
        a._stop_heartbeats()  # a's agent "dies": it never heart-beats or leaves again
        info = b.next_rendezvous()  # join_timeout 8 s < 15 s: only the probe can free the round
        assert (info.round, info.world_size) == (1, 1)
        assert a.node_id not in _state(backend).last_heartbeats
    finally:
        a._stop_heartbeats()
        b._stop_heartbeats()


def _monitor(handler: DynamicRendezvousHandler, stop: threading.Event) -> None:
    """The agent's monitor loop: it reads the state (here every 0.05 s) and so sees probes."""
    while not stop.wait(0.05):
        handler.num_nodes_waiting()


def test_live_participant_answers_probes_and_stays():
    backend = InMemoryBackend()
    a = DynamicRendezvousHandler(NodeInfo("a"), SETTINGS, backend, FakeRoundStores())
    b = DynamicRendezvousHandler(NodeInfo("b"), SETTINGS, backend, FakeRoundStores())
    pool = ThreadPoolExecutor(2)
    stop = threading.Event()
    try:
        assert a.next_rendezvous().world_size == 1  # a keeps running (its heartbeat thread is live)
        # a beats every 5 s (not cheap_heartbeats, as on etcd): only its monitor's read of a
        # probe makes it beat in time
        monitoring = pool.submit(_monitor, a, stop)
        joining = pool.submit(b.next_rendezvous)  # b waits for the next round and probes
        first = wait_for(lambda: _state(backend).probe_at, 5, what="a probe")
        wait_for(lambda: (_state(backend).probe_at or 0) > first, 5, what="a second probe, after the first expired")
        s = _state(backend)
        assert a.node_id in s.participants and s.complete and s.round == 0  # answered: not pruned
        assert backend.beats[a.node_id] >= first  # in a's own key; the state is not rewritten
        assert a.num_nodes_waiting() == 1
        a.set_closed()  # end b's wait
        joining.exception(10)
        stop.set()
        monitoring.result(10)
    finally:
        stop.set()
        a._stop_heartbeats()
        b._stop_heartbeats()
        pool.shutdown(wait=True, cancel_futures=True)
