"""Batched joins and per-node heartbeat keys on a real TCPStore (rendezvous/dynamic/batching.py)."""

from __future__ import annotations

import datetime
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("torch.distributed")

from torch.distributed import TCPStore  # noqa: E402

from elaunch.rendezvous import registry  # noqa: E402
from elaunch.rendezvous.c10d import C10dBackend  # noqa: E402
from elaunch.rendezvous.contract import NodeInfo, RendezvousTimeoutError  # noqa: E402
from elaunch.rendezvous.c10d_store import BoundedStore  # noqa: E402
from elaunch.rendezvous.dynamic.state import JoinIntent, RendezvousState  # noqa: E402
from tests.conftest import wait_for  # noqa: E402
from tests.integration.test_c10d_rendezvous import free_port, params  # noqa: E402


class CountingStore(BoundedStore):
    """The handler's own store, counting the calls that reach the server."""

    def __init__(self, inner: BoundedStore) -> None:
        super().__init__(inner.store, inner._endpoint, inner._timeout)
        self.calls: list[str] = []
        self._lock = threading.Lock()

    def __getattr__(self, name):
        attr = super().__getattr__(name)
        if name in ("get", "set", "add", "compare_set", "multi_get", "wait", "check", "append"):
            with self._lock:
                self.calls.append(name)
        return attr


class CountingDirect:
    """The raw store the keep-alive thread writes through (``C10dBackend.beat``), counted in ``counting.calls``."""

    def __init__(self, raw, counting: CountingStore) -> None:
        self._raw, self._counting = raw, counting

    def set(self, key, value):
        with self._counting._lock:
            self._counting.calls.append("set")
        return self._raw.set(key, value)


@pytest.fixture
def crowd():
    handlers = []
    pool = ThreadPoolExecutor(max_workers=64)

    def make(n, min_nodes, max_nodes, **conf):
        # no presence ports: their upkeep (a publish, the neighbours' reads) runs in the keep-alive
        # threads once joined, and would be counted here among the join's store calls
        conf.setdefault("presence", "false")
        port = free_port()
        hs = [registry.create_handler(params(port, min_nodes, max_nodes, is_host=str(i == 0).lower(), **conf))
              for i in range(n)]
        handlers.extend(hs)
        for h in hs:
            h._backend._store = CountingStore(h._backend._store)
            h._backend._direct = CountingDirect(h._backend._direct, h._backend._store)
        return hs

    make.pool = pool
    yield make
    for h in handlers:
        h.shutdown()
    pool.shutdown(wait=True)


def test_a_crowd_joins_one_round_in_a_bounded_number_of_store_calls(crowd):
    hs = crowd(48, 48, 48)
    infos = list(crowd.pool.map(lambda h: h.next_rendezvous(), hs))
    assert {(i.round, i.world_size) for i in infos} == {(0, 48)}
    assert sorted(i.rank for i in infos) == list(range(48))
    calls = [len(h._backend._store.calls) for h in hs]
    # torch's join retries its own write once per competing node: O(N) calls each.
    # Batched, a joiner reads, posts (append + add + set), waits and reads again;
    # only the combiner's calls grow with the crowd.
    assert statistics.median(calls) <= 12, calls
    writes = sum(h._backend._store.calls.count("compare_set") for h in hs)
    assert writes < 48 + 10, writes  # each handler initialises the key once; few state writes beyond


def test_a_node_woken_by_the_notice_reads_the_state_without_the_heartbeat_keys(crowd):
    # it only finishes: at 1024 nodes each such read also fetched 1,024 heartbeat keys
    hs = crowd(8, 8, 8)
    infos = list(crowd.pool.map(lambda h: h.next_rendezvous(), hs))
    assert {(i.round, i.world_size) for i in infos} == {(0, 8)}
    calls = [h._backend._store.calls for h in hs]
    # what each node read after its last wait (its heartbeat thread's sets left out)
    after = [[c for c in cs[len(cs) - cs[::-1].index("wait"):] if c != "set"] for cs in calls if "wait" in cs]
    # 7 non-combiners wait for the notice, then read with one plain get (a woken node
    # whose grace ran out first may have read with the keys: allow two of those)
    assert sum(a == ["get"] for a in after) >= 5, after


def test_joiners_add_themselves_when_the_combiner_never_combines(crowd):
    # a ghost posts round 0's first join and then does nothing (a combiner that died)
    hs = crowd(3, 3, 3, keep_alive_interval=0.5)
    backend = hs[0]._backend
    ghost = JoinIntent("ghost", NodeInfo("10.0.0.1", "trainer", 1), -1, 0, 0.0)
    assert backend.post_intent(0, ghost.to_bytes()) is True
    started = time.monotonic()
    infos = list(crowd.pool.map(lambda h: h.next_rendezvous(), hs))
    assert {(i.round, i.world_size) for i in infos} == {(0, 3)}  # the stale ghost was never added
    assert time.monotonic() - started < 15


def test_a_node_waiting_for_the_next_round_is_combined_into_it(crowd):
    a, b = crowd(2, 1, 2, last_call_timeout=1)
    assert a.next_rendezvous().world_size == 1
    late = crowd.pool.submit(b.next_rendezvous)
    wait_for(lambda: a.num_nodes_waiting() == 1, 10, what="b on the wait list")
    again = a.next_rendezvous()  # a re-forms: b posted to the new round and the combiner adds it
    assert (again.round, again.world_size) == (1, 2)
    assert late.result(timeout=10).world_size == 2


def test_heartbeats_live_in_per_node_keys_and_a_silent_member_is_lost(crowd):
    a, b, c = crowd(3, 3, 3, keep_alive_interval=0.2, keep_alive_max_attempt=10, probe_timeout=0.8)
    list(crowd.pool.map(lambda h: h.next_rendezvous(), (a, b, c)))
    state_writes = lambda: sum(h._backend._store.calls.count("compare_set") for h in (a, b, c))  # noqa: E731
    before, beats = state_writes(), c._backend._store.calls.count("set")
    wait_for(lambda: c._backend._store.calls.count("set") >= beats + 4, 10, what="four heartbeats of c")
    assert state_writes() == before  # heartbeats went to the keys, not the shared state
    assert [h.job_channel().num_nodes_lost() for h in (a, b, c)] == [0, 0, 0]
    c._stop_heartbeats()
    wait_for(lambda: [h.job_channel().num_nodes_lost() for h in (a, b)] == [1, 1], 10, what="c seen as lost")
    stored = RendezvousState.from_bytes(a._backend.get_state()[0])
    assert set(stored.participants) == {a.node_id, b.node_id, c.node_id}


def test_a_crowd_restarts_into_the_next_round_without_a_write_each(crowd):
    hs = crowd(48, 48, 48)
    first = {h.node_id: i.rank for h, i in zip(hs, crowd.pool.map(lambda h: h.next_rendezvous(), hs))}
    writes = lambda: sum(h._backend._store.calls.count("compare_set") for h in hs)  # noqa: E731
    before = writes()
    # every node restarts at once (a worker failed): each posts its exit to the next
    # round's log and that round's combiner removes them all, then adds them all
    infos = list(crowd.pool.map(lambda h: h.next_rendezvous(), hs))
    assert {(i.round, i.world_size) for i in infos} == {(1, 48)}
    assert {h.node_id: i.rank for h, i in zip(hs, infos)} == first  # ranks kept across the restart
    # one exit write and one wait-list write per node before (96 at least); now a handful
    assert writes() - before < 24, writes() - before


def test_leavers_wait_for_a_member_still_running_then_all_join_the_next_round(crowd):
    a, b, c = crowd(3, 3, 3)
    list(crowd.pool.map(lambda h: h.next_rendezvous(), (a, b, c)))
    # a and b restart; c's workers still run (it polls every 30 s, say)
    restarting = [crowd.pool.submit(h.next_rendezvous) for h in (a, b)]
    wait_for(lambda: c.num_nodes_waiting() == 2, 15, what="a and b waiting for the next round")
    stored = RendezvousState.from_bytes(c._backend.get_state()[0])
    assert (stored.round, set(stored.participants), stored.wait_list) == (0, {c.node_id}, {a.node_id, b.node_id})
    assert not any(f.done() for f in restarting)
    again = c.next_rendezvous()  # c notices and restarts too: the last one out opens round 1
    assert (again.round, again.world_size) == (1, 3)
    assert {f.result(timeout=20).round for f in restarting} == {1}


def test_leavers_leave_on_their_own_when_the_combiner_never_combines(crowd):
    hs = crowd(3, 3, 3, keep_alive_interval=0.5)
    list(crowd.pool.map(lambda h: h.next_rendezvous(), hs))
    # a ghost takes round 1's first ticket and then does nothing (a combiner that died)
    ghost = JoinIntent("ghost", NodeInfo("10.0.0.1", "trainer", 1), -1, 1, 0.0)
    assert hs[0]._backend.post_intent(1, ghost.to_bytes()) is True
    infos = list(crowd.pool.map(lambda h: h.next_rendezvous(), hs))
    assert {(i.round, i.world_size) for i in infos} == {(1, 3)}  # after the grace, each left by itself


def test_a_long_job_holds_a_bounded_number_of_store_keys(crowd):
    # every restart round writes its log, tickets, arrival and completion notices and
    # its master address; round r's are deleted once round r + 2 completed, so the
    # store holds as many keys after 12 rounds as after 4
    hs = crowd(3, 3, 3)
    agent_store = hs[0]._backend._store.store

    def rounds(k):
        for _ in range(k):
            infos = list(crowd.pool.map(lambda h: h.next_rendezvous(), hs))
            assert len({i.round for i in infos}) == 1 and infos[0].world_size == 3

    rounds(4)
    keys = agent_store.num_keys()
    rounds(8)
    assert agent_store.num_keys() == keys
    assert infos_round(hs) == 11
    # a node two rounds behind (frozen) that reads a forgotten round's log gets an
    # empty one at once, not a get that blocks on the deleted keys for read_timeout
    host, _, port = hs[0]._backend._endpoint.rpartition(":")
    client = TCPStore(host, int(port), is_master=False, timeout=datetime.timedelta(seconds=1))
    stale = C10dBackend(client, "job", hs[0]._backend._endpoint)
    data, _, log_bytes, _, _ = stale.get_state_and_intents(0, [h.node_id for h in hs])
    assert log_bytes == b"" and RendezvousState.from_bytes(data).round == 11


def infos_round(hs):
    return RendezvousState.from_bytes(hs[0]._backend.get_state()[0]).round


def test_a_node_that_timed_out_of_its_join_is_not_added_after_it_gave_up(crowd):
    # join_timeout (1 s) < dead_after (3 x 5 s): the quitter's intent is still "fresh"
    # long after it gave up. It posted first, so the next joiner's batch would add it
    # from the log: a phantom participant, counted until its heartbeat expires.
    a, b = crowd(2, 2, 3, keep_alive_interval=5, last_call_timeout=0.5)
    port = int(a._backend._endpoint.rpartition(":")[2])
    quitter = registry.create_handler(params(port, 2, 3, is_host="false", join_timeout=1, keep_alive_interval=5))
    try:
        with pytest.raises(RendezvousTimeoutError, match="join_timeout=1 s"):
            quitter.next_rendezvous()
        infos = list(crowd.pool.map(lambda h: h.next_rendezvous(), (a, b)))
    finally:
        quitter.shutdown()
    stored = RendezvousState.from_bytes(a._backend.get_state()[0])
    assert quitter.node_id not in stored.participants
    assert [i.world_size for i in infos] == [2, 2]
