"""The presence port: a member whose agent is gone is lost at its neighbours' next failure, at once.

Real sockets on loopback; the rendezvous state in the in-memory backend, the handlers in
threads of this process. The heartbeat rules are set far out of reach (``lost_after`` and
``probe_timeout`` 60 s, torch's rule at 90 s): only a refused presence port can make a
failure name a lost member within these tests' deadlines.
"""

from __future__ import annotations

import errno
import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from elaunch.rendezvous.contract import FailureRecord, NodeInfo
from elaunch.rendezvous.dynamic import presence as presence_mod
from elaunch.rendezvous.dynamic.handler import DynamicRendezvousHandler
from elaunch.rendezvous.dynamic.presence import Presence, connect_all, judgeable
from elaunch.rendezvous.dynamic.settings import RendezvousSettings
from elaunch.rendezvous.dynamic.state import RendezvousState
from tests.conftest import wait_for
from tests.unit.fakes import FakeRoundStores, InMemoryBackend

SLOW = dict(join_timeout=20, last_call_timeout=30, settle_timeout=0.05, keep_alive_interval=2,
            keep_alive_max_attempt=45, lost_after=60, poll_interval=0.02, probe_delay=0.1, probe_timeout=60)


def _closed_port() -> int:
    """A loopback port nothing listens on (bound once, then closed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_connect_all_tells_a_listener_from_a_closed_port():
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(4)
        open_port = listener.getsockname()[1]
        got = connect_all({"up": ("127.0.0.1", open_port), "gone": ("127.0.0.1", _closed_port())}, 2.0)
    assert got == {"up": 0, "gone": errno.ECONNREFUSED}


def test_a_loopback_port_is_judged_only_from_the_same_address():
    assert judgeable("192.168.77.2", "192.168.77.3")
    assert judgeable("127.0.0.1", "127.0.0.1")
    assert not judgeable("127.0.1.1", "192.168.77.3")  # another host's /etc/hosts loopback name
    assert not judgeable("not-an-address", "127.0.0.1")
    assert not judgeable("127.0.0.1", "127.0.1.1")  # loopback, but not where this node's port is bound


def test_a_tick_that_raises_does_not_stop_the_heartbeats():
    # the presence port's upkeep runs in the keep-alive thread: a bug there must not silence the node
    from elaunch.rendezvous.dynamic.keepalive import KeepAlive
    from elaunch.rendezvous.dynamic.stalls import StoreStalls, slow_after

    settings = RendezvousSettings("job", 1, 1, lost_after=0.4)  # a beat every 0.05 s
    backend = InMemoryBackend()
    ticks: list[float] = []

    def tick() -> None:
        ticks.append(time.time())
        raise RuntimeError("a bug in the tick")

    keep = KeepAlive("n", settings, backend, time.time, StoreStalls(time.time, slow_after(settings)), tick)
    keep.start()
    try:
        wait_for(lambda: len(ticks) >= 3, 10, what="three ticks, each raising")
        first = backend.beats["n"]
        wait_for(lambda: backend.beats["n"] > first, 10, what="a beat after the ticks raised")
        assert keep.thread.is_alive()
    finally:
        keep.close()


def test_a_refused_port_counts_only_once_it_was_reached():
    backend = InMemoryBackend()
    a, b = Presence("a", "127.0.0.1", backend), Presence("b", "127.0.0.1", backend)
    try:
        assert a.open() and b.open()
        a.publish()
        # c published a port nothing ever listened on (a firewall that rejects it looks the same)
        backend.put_node_key(presence_mod.KIND, "c", json.dumps({"addr": "127.0.0.1", "port": _closed_port()}).encode())
        b.tick(["a", "c"])
        assert b.refused({"a", "c"}) == set()  # a answers; c was never reached, so it is not judged
        a.close()
        assert b.refused({"a", "c"}) == {"a"}
        b.tick(["c"])  # a new round (other neighbours): a's port is no longer known here
        assert b.refused({"a", "c"}) == set()
    finally:
        a.close()
        b.close()


def test_a_port_that_does_not_answer_is_left_to_the_heartbeats():
    # a full listen queue drops SYNs, as a host that is gone sends nothing back: the try times out
    backend = InMemoryBackend()
    b = Presence("b", "127.0.0.1", backend)
    clogged = socket.socket()
    held: list[socket.socket] = []
    try:
        assert b.open()
        clogged.bind(("127.0.0.1", 0))
        clogged.listen(0)
        port = clogged.getsockname()[1]
        for _ in range(8):  # fill the queue (never accepted)
            c = socket.socket()
            c.setblocking(False)
            c.connect_ex(("127.0.0.1", port))
            held.append(c)
        assert connect_all({"x": ("127.0.0.1", port)}, 0.3) == {"x": None}
        b._verified = {"x": ("127.0.0.1", port)}  # as if reached when the round began
        b._round = ("x",)
        assert b.refused({"x"}, 0.3) == set()
        assert "x" not in b._verified  # not tried again this round
    finally:
        for c in held:
            c.close()
        clogged.close()
        b.close()


def test_malformed_published_ports_are_ignored():
    backend = InMemoryBackend()
    b = Presence("b", "127.0.0.1", backend)
    try:
        assert b.open()
        bad = {"x": b"not json", "y": b'{"addr": 1, "port": 2}', "z": b'{"addr": "127.0.0.1", "port": 0}'}
        for node, raw in bad.items():
            backend.put_node_key(presence_mod.KIND, node, raw)
        b.tick(["x", "y", "z"])
        assert b.refused({"x", "y", "z"}) == set()
    finally:
        b.close()


def test_the_listener_reads_nothing_and_empties_its_queue():
    backend = InMemoryBackend()
    p = Presence("a", "127.0.0.1", backend)
    conns: list[socket.socket] = []
    try:
        assert p.open()
        for _ in range(presence_mod.BACKLOG // 2):
            c = socket.create_connection(p.endpoint, timeout=5)
            c.sendall(b"\x80\x04junk" * 100)
            conns.append(c)
        p.tick([])
        for c in conns:  # each was accepted and closed unread: an EOF (or a reset: unread data) at once
            try:
                assert c.recv(16) == b""
            except ConnectionResetError:
                pass
        assert connect_all({"a": p.endpoint}, 2.0) == {"a": 0}  # still listening
    finally:
        for c in conns:
            c.close()
        p.close()


def _pair(backend, **conf):
    settings = RendezvousSettings("job", 2, 2, **{**SLOW, **conf})
    a = DynamicRendezvousHandler(NodeInfo("127.0.0.1"), settings, backend, FakeRoundStores())
    b = DynamicRendezvousHandler(NodeInfo("127.0.0.1"), settings, backend, FakeRoundStores())
    with ThreadPoolExecutor(2) as pool:
        infos = [f.result(30) for f in [pool.submit(a.next_rendezvous), pool.submit(b.next_rendezvous)]]
    assert [i.world_size for i in infos] == [2, 2]
    return a, b, infos[1].round


def _stop(*handlers: DynamicRendezvousHandler) -> None:
    """Stop the handlers' keep-alives and close their ports (what their agents' ends would do)."""
    for h in handlers:
        h._stop_heartbeats()
        h._close_presence()


def _record(handler, round: int, box: list) -> None:
    box.append(handler.job_channel().record_failure(
        FailureRecord(round=round, at=time.time(), host="127.0.0.1", rank=0, exitcode=1, message="peer gone")))


def _watched_pair(backend):
    """A round of two (``_pair``) once b reached a's presence port."""
    a, b, round = _pair(backend)
    try:
        wait_for(lambda: a.node_id in b._presence._verified, 10, what="b reached a's presence port")
    except AssertionError:
        _stop(a, b)
        raise
    return a, b, round


def _failure_seen(b, round: int, box: list) -> None:
    """b's agent reports its workers' failure, in a thread: its verdict lands in ``box``."""
    threading.Thread(target=_record, args=(b, round, box), daemon=True).start()


def test_a_member_whose_agent_is_gone_is_lost_at_once_and_removed():
    backend = InMemoryBackend()
    a, b, round = _watched_pair(backend)
    box: list = []
    try:
        a._stop_heartbeats()  # a's agent dies: no heartbeat, no leave, and its port closes
        a._close_presence()
        _failure_seen(b, round, box)
        wait_for(lambda: box, 15, what="b's verdict on the failure (60 s by the heartbeat rules)")
        job = box[0]
        assert job.lost == (a.node_id,) and job.restarts == 0  # a loss, not a counted failure
        state = RendezvousState.from_bytes(backend.get_state()[0])
        assert a.node_id not in state.participants and a.node_id not in state.last_heartbeats
        assert b.node_id in state.participants
    finally:
        _stop(a, b)


def test_a_port_that_closes_after_the_failure_was_seen_is_tried_again():
    # on a loaded host a killed agent may run its exit (closing its port) after its workers' sockets
    # closed, so after the failure was seen: the wait for the probe's answers tries the ports again
    backend = InMemoryBackend()
    a, b, round = _watched_pair(backend)
    box: list = []
    try:
        a._stop_heartbeats()  # a's agent is dying: no more heartbeats, its port still open
        tries: list = []
        refused = b._presence.refused
        b._presence.refused = lambda nodes, *args: tries.append(refused(nodes, *args)) or tries[-1]  # a spy
        _failure_seen(b, round, box)
        wait_for(lambda: tries, 10, what="b's first try of a's port after the failure")
        assert not box and tries[0] == set()  # a's port still accepts: no verdict yet
        a._close_presence()
        wait_for(lambda: box, 15, what="b's verdict once a's port closed (60 s by the heartbeat rules)")
        assert box[0].lost == (a.node_id,) and tries[-1] == {a.node_id}
    finally:
        _stop(a, b)


def _monitor(handler: DynamicRendezvousHandler, stop: threading.Event) -> None:
    """The agent's monitor loop: it reads the state (here every 0.05 s) and so answers probes."""
    while not stop.wait(0.05):
        handler.num_nodes_waiting()


@pytest.mark.parametrize("presence", [True, False])
def test_a_live_member_is_not_lost_and_the_failure_counts(presence):
    backend = InMemoryBackend()
    a, b, round = _pair(backend, presence=presence)
    stop = threading.Event()
    box: list = []
    watcher = threading.Thread(target=_monitor, args=(a, stop), daemon=True)
    try:
        if presence:
            wait_for(lambda: a.node_id in b._presence._verified, 10, what="b reached a's presence port")
        else:
            assert b._presence is None and a._presence is None
        watcher.start()
        _record(b, round, box)
        assert box[0].lost == () and box[0].restarts == 1
        assert a.node_id in RendezvousState.from_bytes(backend.get_state()[0]).participants
    finally:
        stop.set()
        watcher.join(5)
        _stop(a, b)


def test_the_port_is_a_private_descriptor_of_the_launch_from_the_first_round_to_the_leave():
    from elaunch.supervision import Supervisor

    supervisor = Supervisor()
    settings = RendezvousSettings("job", 1, 1, **SLOW)
    h = DynamicRendezvousHandler(NodeInfo("127.0.0.1"), settings, InMemoryBackend(), FakeRoundStores(),
                                 supervisor=supervisor)
    try:
        assert h.next_rendezvous().world_size == 1
        fd = h._presence.private_fds()
        assert fd and set(fd) <= set(supervisor.private_fds())  # a worker forked from the agent closes it
        port = h._presence.endpoint
        h.leave()
        assert h._presence.endpoint is None and not set(fd) & set(supervisor.private_fds())
        assert connect_all({"h": port}, 2.0) == {"h": errno.ECONNREFUSED}
    finally:
        _stop(h)
