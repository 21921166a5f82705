"""The RendezvousBackend contract (get / compare-and-set / concurrent writers) on c10d, etcd-v2, etcd-v3."""

from __future__ import annotations

import threading
import time

import pytest

from elaunch.rendezvous.dynamic.state import RendezvousState
from elaunch.rendezvous.etcd.common import parse_conf
from tests.conftest import wait_for
from tests.etcd.conftest import make_params

_ids = iter(range(10**6))


@pytest.fixture(params=["c10d", "etcd-v2", "etcd-v3"])
def backend(request, etcd_v2, etcd_v3):
    """A fresh backend (own run id) of each kind; etcd ones on the module's servers."""
    run_id = f"contract-{next(_ids)}"
    if request.param == "c10d":
        torch_dist = pytest.importorskip("torch.distributed")
        from elaunch.rendezvous.c10d import C10dBackend
        from elaunch.rendezvous.c10d_store import BoundedStore

        store = torch_dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        endpoint = f"127.0.0.1:{store.port}"
        yield C10dBackend(BoundedStore(store, endpoint, 10.0), run_id, endpoint)  # as create_handler builds it
        return
    if request.param == "etcd-v2":
        from elaunch.rendezvous.etcd.v2 import EtcdV2KV, EtcdV2StateBackend

        conf = parse_conf(make_params("etcd-v2", etcd_v2.endpoints, run_id, 1, 1))
        kv = EtcdV2KV(conf)
        yield EtcdV2StateBackend(kv, f"{conf.prefix}/{run_id}/state")
    else:
        from elaunch.rendezvous.etcd.v3 import EtcdV3KV, EtcdV3StateBackend

        conf = parse_conf(make_params("etcd-v3", etcd_v3.endpoints, run_id, 1, 1))
        kv = EtcdV3KV(conf)
        yield EtcdV3StateBackend(kv, f"{conf.prefix}/{run_id}/state", f"{conf.prefix}/{run_id}/nodes/")
    kv.close()


def test_empty_then_set_then_get(backend):
    assert backend.get_state()[0] is None
    written = backend.set_state(b'{"a": 1}', None)
    assert written is not None and written[0] == b'{"a": 1}' and written[2] is True
    data, token = backend.get_state()
    assert data == b'{"a": 1}' and token == written[1]


def test_the_token_alone_is_the_stored_states_and_changes_with_each_write(backend):
    written = backend.set_state(b"first", None)
    assert backend.get_state_token() == written[1] == backend.get_stored_state()[1]
    again = backend.set_state(b"second", written[1])
    assert again[2] is True and backend.get_state_token() == again[1] != written[1]


def test_stale_token_loses_and_returns_the_current_state(backend):
    backend.set_state(b"first", None)
    _, token = backend.get_state()
    assert backend.set_state(b"second", token)[2] is True
    lost = backend.set_state(b"third", token)  # token of "first": stale
    assert lost is not None and lost[0] == b"second" and lost[2] is False
    again = backend.set_state(b"fourth", None)  # "nothing stored yet" is stale too
    assert again is not None and again[0] == b"second" and again[2] is False
    assert backend.get_state()[0] == b"second"


def test_concurrent_writers_never_lose_an_update(backend):
    backend.set_state(b"0", None)
    n_threads, n_incr = 4, 15

    def writer(me: int):
        # values carry the writer (as real states carry node ids): c10d's token is the bytes themselves
        for _ in range(n_incr):
            while True:
                data, token = backend.get_state()
                result = backend.set_state(f"{int(data.split(b':')[0]) + 1}:{me}".encode(), token)
                if result is not None and result[2]:
                    break

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert int(backend.get_state()[0].split(b":")[0]) == n_threads * n_incr


@pytest.mark.parametrize("backend", ["etcd-v2", "etcd-v3"], indirect=True)  # c10d polls: no watch hook
def test_wait_for_change_wakes_on_a_write(backend):
    backend.set_state(b"one", None)
    _, token = backend.get_state()
    timer = threading.Timer(0.3, lambda: backend.set_state(b"two", token))
    timer.start()
    start = time.monotonic()
    try:
        backend.wait_for_change(token, 30.0)  # returns on the write, not after 30 s
    finally:
        timer.join()
    assert time.monotonic() - start < 20
    assert backend.get_state()[0] == b"two"


def test_v3_node_without_a_live_lease_reads_as_dead(etcd_v3):
    from elaunch.rendezvous.etcd.v3 import EtcdV3KV, EtcdV3StateBackend
    from elaunch.rendezvous.etcd.presence import Presence

    conf = parse_conf(make_params("etcd-v3", etcd_v3.endpoints, "lease-job", 1, 2))
    base = f"{conf.prefix}/lease-job"
    kv = EtcdV3KV(conf)
    backend = EtcdV3StateBackend(kv, f"{base}/state", f"{base}/nodes/")
    alive, dying = Presence(EtcdV3KV(conf), f"{base}/nodes/a", 30), Presence(EtcdV3KV(conf), f"{base}/nodes/b", 2)
    alive.start()
    dying.start()
    try:
        now = time.time()
        state = RendezvousState(participants={"a": 0, "b": 1}, last_heartbeats={"a": now, "b": now})
        backend.set_state(state.to_bytes(), None)
        beats = RendezvousState.from_bytes(backend.get_state()[0]).last_heartbeats
        assert beats["a"] > 0 and beats["b"] > 0
        dying._stop.set()  # the agent "dies": no more keep-alives, no revoke; the 2 s lease expires
        dying._thread.join(5)
        wait_for(lambda: RendezvousState.from_bytes(backend.get_state()[0]).last_heartbeats["b"] == 0.0,
                 15, what="b's lease to expire")
        assert RendezvousState.from_bytes(backend.get_state()[0]).last_heartbeats["a"] > 0
        # the stored state, for a reader that judges no one (read_state_only): as written
        stored, token = backend.get_stored_state()
        assert stored == state.to_bytes() and token == backend.get_state()[1]
        alive.stop()  # a clean exit revokes at once
        wait_for(lambda: RendezvousState.from_bytes(backend.get_state()[0]).last_heartbeats["a"] == 0.0,
                 5, what="a's revoked lease")
    finally:
        alive.stop()
        dying.kv.close()
        kv.close()


def test_v3_a_few_nodes_read_judges_only_their_presence(etcd_v3):
    from elaunch.rendezvous.etcd.presence import Presence
    from elaunch.rendezvous.etcd.v3 import EtcdV3KV, EtcdV3StateBackend

    conf = parse_conf(make_params("etcd-v3", etcd_v3.endpoints, "few-job", 1, 3))
    base = f"{conf.prefix}/few-job"
    kv = EtcdV3KV(conf)
    backend = EtcdV3StateBackend(kv, f"{base}/state", f"{base}/nodes/")
    alive = Presence(EtcdV3KV(conf), f"{base}/nodes/a", 30)
    alive.start()
    try:
        state = RendezvousState(participants={"a": 0, "b": 1, "c": 2}, last_heartbeats=dict.fromkeys("abc", 10.0))
        backend.set_state(state.to_bytes(), None)
        backend.put_heartbeat("a", 20.0)
        backend.put_heartbeat("b", 21.0)  # b beats but has no presence (its lease is gone): dead
        data, _token, beats = backend.get_state_and_heartbeats(["a", "b"])  # the monitor's read: 2 nodes
        assert beats == {"a": 20.0}
        stored = RendezvousState.from_bytes(data).last_heartbeats
        assert stored == {"a": 10.0, "b": 0.0, "c": 10.0}  # c was not read: not judged, though it has no presence
        data, _token, _beats = backend.get_state_and_heartbeats(list("abcde"))  # many: every presence judged
        assert RendezvousState.from_bytes(data).last_heartbeats == {"a": 10.0, "b": 0.0, "c": 0.0}
    finally:
        alive.stop()
        kv.close()


def test_node_keys_sit_beside_the_state_and_are_overwritten_in_place(backend):
    backend.set_state(b"state", None)
    assert backend.get_node_keys("agent", ["n1", "n2"]) == {}  # none written: left out, no wait
    backend.put_node_key("agent", "n1", b'{"round": 0}')
    backend.put_node_key("agent", "n1", b'{"round": 1}')
    backend.put_node_key("stacks", "n2", b"x" * 100_000)
    assert backend.get_node_keys("agent", ["n1", "n2"]) == {"n1": b'{"round": 1}'}
    assert backend.get_node_keys("stacks", ["n2"]) == {"n2": b"x" * 100_000}
    assert backend.get_state()[0] == b"state"  # the state is untouched


@pytest.mark.parametrize("backend", ["c10d", "etcd-v2"], indirect=True)  # etcd-v3: beats count with a lease
def test_heartbeat_keys_are_each_nodes_own_and_leave_the_state_alone(backend):
    backend.set_state(b"state", None)
    _, token = backend.get_state()
    nodes = [f"n{i}" for i in range(6)]
    for i, node in enumerate(nodes):
        backend.put_heartbeat(node, 1000.0 + i)
    backend.put_heartbeat("n0", 2000.5)  # overwritten in place, no compare
    backend.beat("n2", 2002.5)  # the keep-alive thread's write (c10d: not through the pool): the same key
    expected = {n: 1000.0 + i for i, n in enumerate(nodes)} | {"n0": 2000.5, "n2": 2002.5}
    assert backend.get_heartbeats(nodes[:2]) == {"n0": 2000.5, "n1": 1001.0}  # a few (the monitor's read)
    assert backend.get_heartbeats(nodes) == expected  # many (a join's read; etcd-v2: one directory read)
    assert backend.get_heartbeats([]) == {}
    data, token_after, beats = backend.get_state_and_heartbeats(nodes[3:])
    assert (data, beats) == (b"state", {n: expected[n] for n in nodes[3:]})
    assert token_after == token  # beats never write the state


@pytest.mark.parametrize("backend", ["etcd-v2"], indirect=True)  # c10d: nodes in a state have a key by contract
def test_a_node_without_a_heartbeat_key_is_left_out(backend):
    backend.put_heartbeat("here", 5.0)
    assert backend.get_heartbeats(["here", "gone"]) == {"here": 5.0}
    assert backend.get_heartbeats([f"gone{i}" for i in range(8)] + ["here"]) == {"here": 5.0}


def test_c10d_reader_writes_nothing():
    torch_dist = pytest.importorskip("torch.distributed")
    from elaunch.rendezvous.c10d import C10dBackend

    store = torch_dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    reader = C10dBackend(store, "never-started", f"127.0.0.1:{store.port}", create=False)
    assert not reader.exists()
    assert not store.check([reader.key])  # an agent's backend would have created it
    C10dBackend(store, "never-started", f"127.0.0.1:{store.port}")
    assert reader.exists()


def test_presence_first_refresh_is_spread_over_its_interval():
    from elaunch.rendezvous.etcd.presence import Presence

    presence = Presence(kv=None, key="k", ttl=15)  # type: ignore[arg-type] - no call reaches the client
    firsts = [presence.first_refresh_after() for _ in range(200)]
    assert all(15 / 12 <= f <= 15 / 3 for f in firsts)
    assert max(firsts) - min(firsts) > 2.0  # agents started together do not refresh in step
