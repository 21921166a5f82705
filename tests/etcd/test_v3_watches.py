"""etcd-v3's watches: round notices and state writes on one standing watch, opened again off the caller's thread."""

from __future__ import annotations

import threading
import time

import pytest

from elaunch.rendezvous.etcd.common import parse_conf
from elaunch.rendezvous.etcd.base import EtcdRoundStores
from tests.conftest import wait_for
from tests.etcd.conftest import make_params

pytest.importorskip("pyetcd")

_ids = iter(range(10**6))


@pytest.fixture
def v3(etcd_v3):
    """``(kv, backend, base, creates)`` on a fresh run id; ``creates`` lists every single-key watch create."""
    from elaunch.rendezvous.etcd.v3 import EtcdV3KV, EtcdV3StateBackend

    run_id = f"watches-{next(_ids)}"
    conf = parse_conf(make_params("etcd-v3", etcd_v3.endpoints, run_id, 1, 1))
    base = f"{conf.prefix}/{run_id}"
    kv = EtcdV3KV(conf)
    client = kv._client()
    creates: list[str] = []
    real_add = client.add_watch_callback

    def counted_add(key, *args, **kwargs):  # the real create, recorded
        creates.append(key)
        return real_add(key, *args, **kwargs)

    client.add_watch_callback = counted_add
    yield kv, EtcdV3StateBackend(kv, f"{base}/state", f"{base}/nodes/"), base, creates
    kv.close()


def _other_writer(etcd_v3, base):
    """A second client on the same run (another agent), to write the notices."""
    from elaunch.rendezvous.etcd.v3 import EtcdV3KV, EtcdV3StateBackend

    kv = EtcdV3KV(parse_conf(make_params("etcd-v3", etcd_v3.endpoints, "unused", 1, 1)))
    return kv, EtcdV3StateBackend(kv, f"{base}/state", f"{base}/nodes/")


def test_v3_round_notices_are_waited_for_on_one_standing_watch(etcd_v3, v3):
    kv, backend, base, creates = v3
    kv.keep_watching(f"{base}/round/")
    other_kv, other = _other_writer(etcd_v3, base)
    try:
        timer = threading.Timer(0.3, lambda: other.notify_round(0))
        timer.start()
        start = time.monotonic()
        assert backend.wait_for_round(0, 30.0) is True  # woken by the notice, not after 30 s
        timer.join()
        assert time.monotonic() - start < 20
        assert backend.wait_for_round(0, 30.0) is True  # seen already: at once
        assert backend.wait_for_round(1, 0.3) is False  # no notice: the timeout
        other.notify_round(1)
        wait_for(lambda: backend.wait_for_round(1, 0.1), 10, what="round 1's notice")
        assert creates == [f"{base}/round/"]  # the standing watch only: no wait took a watch of its own
    finally:
        other_kv.close()


def test_v3_notice_written_before_the_wait_is_found(etcd_v3, v3):
    kv, backend, base, creates = v3
    other_kv, other = _other_writer(etcd_v3, base)
    try:
        other.notify_round(3)  # before the standing watch exists: its events never show it
        kv.keep_watching(f"{base}/round/")
        start = time.monotonic()
        assert backend.wait_for_round(3, 30.0) is True
        assert time.monotonic() - start < 20 and creates == [f"{base}/round/"]
    finally:
        other_kv.close()


def test_v3_standing_watch_opens_again_on_a_new_client(etcd_v3, v3):
    kv, backend, base, _creates = v3
    kv.keep_watching(f"{base}/round/")
    standing = kv._standing.watches[0]
    client = kv._client()
    key = f"{base}/round/5/done"
    assert standing.serves(key, client)
    kv._drop_client(0)  # as after a failed call: the client and its channel closed, its streams broken
    wait_for(lambda: not standing.serves(key, client), 10, what="the standing watch to see its stream break")
    assert not standing.serves(key, kv._client())  # the new client has no standing watch yet
    other_kv, other = _other_writer(etcd_v3, base)
    try:
        timer = threading.Timer(0.3, lambda: other.notify_round(5))
        timer.start()
        assert backend.wait_for_round(5, 30.0) is True  # opened again on the next wait
        timer.join()
        assert standing.serves(key, kv._client())
    finally:
        other_kv.close()


def test_v3_workers_address_arrives_on_the_agents_standing_watch(etcd_v3, handlers):
    """setup_round of a non-zero rank: rank 0's address comes as an event of the standing watch the
    agent opened when it started: no watch create and no read after it (one read, before rank 0 wrote)."""
    h = handlers.make("etcd-v3", etcd_v3.endpoints, "address-event", 1, 2)
    stores, kv = h._stores, h._stores.kv
    base = stores._base
    key = f"{base}/round/4/master_endpoint"
    client = kv._client()
    calls: list[tuple[str, str]] = []
    real_add, real_get = client.add_watch_callback, client.get

    def counted_add(k, *args, **kwargs):
        calls.append(("watch", k))
        return real_add(k, *args, **kwargs)

    def counted_get(k, *args, **kwargs):
        calls.append(("get", k))
        return real_get(k, *args, **kwargs)

    client.add_watch_callback, client.get = counted_add, counted_get
    other_kv, _other = _other_writer(etcd_v3, base)
    rank0 = EtcdRoundStores(other_kv, base, "127.0.0.2", read_timeout=30.0)
    try:
        published = []
        timer = threading.Timer(0.3, lambda: published.append(rank0.setup_round(4, 0, 2, ())))
        timer.start()
        start = time.monotonic()
        got = stores.setup_round(4, 1, 2, ())
        timer.join()
        assert time.monotonic() - start < 20
        assert (got.master_addr, got.master_port) == ("127.0.0.2", published[0].master_port)
        assert calls == [("get", key)]
        # the exit barrier's counts are not under round/: the standing watch never carries them
        other_side = threading.Thread(target=rank0.exit_barrier, args=(4, 0, 2, 30.0), daemon=True)
        other_side.start()
        stores.exit_barrier(4, 1, 2, 30.0)
        other_side.join(30)
        assert not [k for k in kv._standing.watches[0]._seen if "exit" in k]
    finally:
        other_kv.close()


def test_v3_state_watch_needs_a_standing_watch(etcd_v3, v3):
    """Without a standing watch (no ``keep_watching``) there is nothing to listen on: the monitor polls."""
    kv, backend, _base, creates = v3
    assert backend.watch_state(lambda: None) is None
    assert creates == [] and kv._opener.idle()  # no watch of its own, none waiting to be opened


def _assert_no_call_after_a_write(writer, waiter, calls: list[float]) -> None:
    """Once the watch is stopped, another write of the state calls nothing."""
    seen = len(calls)
    _, token = writer.get_state()
    writer.set_state(b"two", token)
    assert waiter.wait_for_round(9, 0.5) is False  # a bounded wait for a stray event to arrive
    assert len(calls) == seen


def test_v3_running_member_hears_of_state_writes_on_its_standing_watch(etcd_v3, v3):
    """A write of the state reaches the monitor as a few-byte event on the standing watch: no watch of its own."""
    kv, backend, base, creates = v3
    kv.keep_watching(f"{base}/round/")
    assert creates == [f"{base}/round/"]  # the standing watch, once for the agent's life
    creates.clear()
    other_kv, other = _other_writer(etcd_v3, base)
    calls: list[float] = []
    try:
        stop = backend.watch_state(lambda: calls.append(time.monotonic()))
        assert other.set_state(b"one", None)[2] is True
        wait_for(lambda: calls, 10, what="the write's event")
        assert creates == [] and kv._opener.idle()  # no watch created, none waiting to be
        assert kv._standing.watches[0]._seen[backend.written_key] == b""  # the event was the marker's, not the state's
        stop()
        _assert_no_call_after_a_write(other, backend, calls)
    finally:
        other_kv.close()


def test_v3_standing_watch_opens_again_for_its_listener_after_its_stream_broke(etcd_v3, v3):
    kv, backend, base, _creates = v3
    kv.keep_watching(f"{base}/round/")
    calls: list[float] = []
    stop = backend.watch_state(lambda: calls.append(time.monotonic()))
    try:
        kv._drop_client(0)  # the client and its streams closed, as pyetcd does after a failed request
        # one call for the broken stream, one once it is open again (writes meanwhile went unseen)
        wait_for(lambda: len(calls) >= 2 and kv._opener.idle(), 10, what="the watch to break and open again")
        assert kv._standing.watches[0].serves(backend.written_key, kv._client())
        seen = len(calls)
        backend.set_state(b"after", None)
        wait_for(lambda: len(calls) > seen, 10, what="the write's event on the re-opened watch")
    finally:
        stop()


def test_opener_runs_opens_when_due_in_order_and_stops():
    """The Opener (pure thread logic, no etcd): due order, not submission order; stop drops what waits."""
    from elaunch.rendezvous.etcd.standing import Opener

    opener = Opener(name="test-opener")
    ran: list[str] = []
    opener.run_in(0.3, lambda: ran.append("later"))
    opener.run_in(0.0, lambda: ran.append("now"))
    opener.run_in(0.0, lambda: 1 / 0)  # an error is logged; the thread goes on
    wait_for(lambda: ran == ["now", "later"], 10, what="both opens")
    wait_for(opener.idle, 10, what="the opener to be idle")
    opener.run_in(60.0, lambda: ran.append("never"))
    assert not opener.idle()
    opener.stop()
    thread = next(t for t in threading.enumerate() if t.name == "test-opener")
    thread.join(10)
    assert not thread.is_alive() and ran == ["now", "later"]


def test_v3_handler_starts_its_watch_opener_with_the_agent_and_ends_it(etcd_v3, handlers):
    """No round starts a watch thread: the agent's opener runs from the start."""
    h = handlers.make("etcd-v3", etcd_v3.endpoints, "opener-thread", 1, 1)
    openers = [t for t in threading.enumerate() if t.name == "elaunch-etcd-watch-opener"]
    assert len(openers) == 1 and openers[0].is_alive()
    started: list[str] = []
    real_start = threading.Thread.start

    def counted_start(self, *args, **kwargs):
        started.append(self.name)
        return real_start(self, *args, **kwargs)

    threading.Thread.start = counted_start
    try:
        info = h.next_rendezvous()
        wait_for(h._stores.kv._opener.idle, 10, what="the opener to be idle")
    finally:
        threading.Thread.start = real_start
    assert info.world_size == 1
    assert not [name for name in started if "watch" in name]
    h.shutdown()
    openers[0].join(10)
    assert not openers[0].is_alive()


def test_v3_a_call_whose_client_another_thread_closed_retries_on_a_new_one(etcd_v3, v3):
    """Thread A reads with the client while thread B, which saw the endpoint fail, closes it: A's RPC on the
    closed channel raises grpc's ValueError, which is not an error of the endpoint; A reconnects and reads
    (an agent cut off from etcd died of that ValueError's traceback instead of 'rendezvous failed')."""
    kv, _backend, base, _creates = v3
    kv.put_many([(f"{base}/k", b"v")])
    used = []

    def read(client):
        used.append(client)
        if len(used) == 1:
            kv._drop_client(kv._current)  # what B does, between A's _client() and A's RPC
        return client.get(f"{base}/k")[0]

    assert kv.call("reading k", read) == b"v"
    assert len(used) == 2 and used[0] is not used[1]
