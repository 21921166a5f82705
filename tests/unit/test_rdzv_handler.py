"""DynamicRendezvousHandler + OpExecutor against the in-memory backend, in threads."""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor, wait

import pytest

from elaunch.rendezvous.contract import (
    FailureRecord,
    NodeInfo,
    RendezvousClosedError,
    RendezvousGracefulExitError,
    RendezvousJobFailedError,
    RendezvousTimeoutError,
)
from elaunch.rendezvous.dynamic import ops
from elaunch.rendezvous.dynamic.handler import DynamicRendezvousHandler
from elaunch.rendezvous.dynamic.ops import Action, OpContext
from elaunch.rendezvous.dynamic.settings import RendezvousSettings
from elaunch.rendezvous.dynamic.state import RendezvousState
from tests.conftest import wait_for
from tests.unit.fakes import FakeRoundStores, InMemoryBackend


def settings(min_nodes, max_nodes, **kw) -> RendezvousSettings:
    kw.setdefault("poll_interval", 0.02)
    kw.setdefault("join_timeout", 20)
    return RendezvousSettings("job", min_nodes, max_nodes, **kw)


class World:
    """Handlers sharing one backend; shut down (heartbeats stopped) at the end."""

    def __init__(self, s: RendezvousSettings):
        self.settings, self.backend, self.handlers = s, InMemoryBackend(), []
        self.pool = ThreadPoolExecutor(max_workers=8)

    def handler(self, addr: str, lws: int = 1) -> DynamicRendezvousHandler:
        h = DynamicRendezvousHandler(NodeInfo(addr, "trainer", lws), self.settings, self.backend, FakeRoundStores())
        self.handlers.append(h)
        return h

    def join(self, *handlers):
        return self.pool.map(lambda h: h.next_rendezvous(), handlers)

    def state(self) -> RendezvousState:
        return RendezvousState.from_bytes(self.backend.get_state()[0])

    def close(self):
        for h in self.handlers:
            h._stop_heartbeats()
        self.pool.shutdown(wait=True, cancel_futures=True)


@pytest.fixture
def world_factory():
    worlds = []

    def make(*args, **kw):
        worlds.append(World(settings(*args, **kw)))
        return worlds[-1]

    yield make
    for w in worlds:
        w.close()


def test_three_handlers_form_a_world(world_factory):
    w = world_factory(3, 3)
    hs = [w.handler(f"10.0.0.{i}", lws=i + 1) for i in range(3)]
    infos = list(w.join(*hs))
    assert sorted(i.rank for i in infos) == [0, 1, 2]
    assert {(i.round, i.world_size, i.master_addr, i.master_port) for i in infos} == {(0, 3, "fake-master", 20000)}
    nodes = infos[0].nodes
    assert all(i.nodes == nodes for i in infos) and len(nodes) == 3
    for info, h in zip(infos, hs):
        assert nodes[info.rank] == h._node  # nodes are in group-rank order


def test_min_max_completes_after_last_call(world_factory):
    w = world_factory(2, 3, last_call_timeout=0.3)
    infos = list(w.join(w.handler("a"), w.handler("b")))
    assert sorted(i.rank for i in infos) == [0, 1] and {i.world_size for i in infos} == {2}


def test_late_joiner_waits_and_next_round_includes_it(world_factory):
    w = world_factory(2, 3, last_call_timeout=1)  # long enough for c's join to land on a loaded machine
    a, b, c = w.handler("a"), w.handler("b"), w.handler("c")
    first = list(w.join(a, b))
    assert a.num_nodes_waiting() == 0
    late = w.pool.submit(c.next_rendezvous)
    wait_for(lambda: a.num_nodes_waiting() == 1 and b.num_nodes_waiting() == 1, 5, what="waiting node")
    assert not late.done()
    assert w.state().wait_list == {c.node_id}
    assert a.job_channel().num_nodes_new() == 1 and b.job_channel().num_nodes_new() == 1  # c is not of their round
    # running nodes see the waiter, restart: round 1 forms with all three
    again = list(w.join(a, b))
    third = late.result(timeout=10)
    assert {i.round for i in again + [third]} == {1}
    assert {i.world_size for i in again + [third]} == {3}
    # a and b keep their previous ranks, the newcomer takes the free one
    assert [i.rank for i in again] == [i.rank for i in first]
    assert third.rank == 2


def test_a_member_that_stops_heart_beating_is_pruned_by_the_next_join(world_factory):
    w = world_factory(1, 2, last_call_timeout=0.3, keep_alive_interval=0.1, keep_alive_max_attempt=2)
    a, b = w.handler("a"), w.handler("b")
    assert {i.world_size for i in w.join(a, b)} == {2}
    b._stop_heartbeats()  # b "dies": its heartbeat key stops moving; a's monitor sees it lost
    wait_for(lambda: a.job_channel().num_nodes_lost() == 1, 5, what="b seen as lost")
    assert b.node_id in w.state().participants  # a keep-alive prunes nobody (torch: the join does)
    info = a.next_rendezvous()
    state = w.state()
    assert (info.round, info.world_size) == (1, 1)
    assert b.node_id not in state.participants and b.node_id not in state.node_infos
    assert b.node_id not in state.last_heartbeats


def test_dead_waiter_is_not_counted_and_gets_pruned(world_factory):
    w = world_factory(1, 2, last_call_timeout=0.05, keep_alive_interval=0.1, keep_alive_max_attempt=2)
    a = w.handler("a")
    list(w.join(a))
    # a ghost node waited once and never heart-beat again
    ghost = OpContext("ghost", NodeInfo("ghost"), w.settings, deadline=1e12)
    w.backend.put(ops.apply(Action.ADD_TO_WAIT_LIST, w.state(), ghost, now=1.0).to_bytes())
    assert a.num_nodes_waiting() == 0 or wait_for(lambda: a.num_nodes_waiting() == 0, 2, what="cache expiry")
    assert "ghost" in w.state().wait_list  # a keep-alive prunes nobody: the next join does
    assert a.next_rendezvous().round == 1
    state = w.state()
    assert "ghost" not in state.wait_list and "ghost" not in state.node_infos


def test_closed_rendezvous_rejects_later_joiners(world_factory):
    w = world_factory(1, 2, last_call_timeout=0.05)
    a, late = w.handler("a"), w.handler("late")
    list(w.join(a))
    assert not late.is_closed()
    a.set_closed()
    assert late.is_closed()
    with pytest.raises(RendezvousClosedError, match="'job' is closed"):
        late.next_rendezvous()


def test_join_timeout_rolls_back_and_names_the_key(world_factory):
    w = world_factory(2, 2, join_timeout=0.3)
    a = w.handler("a")
    with pytest.raises(RendezvousTimeoutError, match=r"round 0: not done within join_timeout=0.3 s .*--nnodes=2:2"):
        a.next_rendezvous()
    assert w.state().participants == {}


def test_redundant_node_waits_then_exits_gracefully_on_close(world_factory):
    w = world_factory(1, 1)
    a, extra = w.handler("a"), w.handler("extra")
    list(w.join(a))
    pending = w.pool.submit(extra.next_rendezvous)
    wait_for(lambda: extra.node_id in w.state().redundancy_list, 5, what="redundant node")
    assert a.num_nodes_waiting() == 0  # a full world does not restart for it
    a.set_closed()
    with pytest.raises(RendezvousGracefulExitError):
        pending.result(timeout=5)


def test_shutdown_stops_heartbeats_closes_and_releases_stores(world_factory):
    w = world_factory(1, 1, keep_alive_interval=0.05)
    a = w.handler("a")
    list(w.join(a))
    thread = a._keep_alive.thread
    assert thread is not None and thread.is_alive()
    assert a.shutdown() is True
    assert not thread.is_alive() and a._stores.closed and w.state().closed


def test_concurrent_writers_never_lose_an_update(world_factory):
    """Five nodes race for a world of 5: compare-and-set must keep every join."""
    w = world_factory(5, 5)
    hs = [w.handler(f"n{i}") for i in range(5)]
    infos = list(w.join(*hs))
    assert sorted(i.rank for i in infos) == list(range(5))


def test_running_members_see_a_silent_member_as_lost(world_factory):
    # dead after 1 s of silence: a scheduling stall of the heartbeat threads is not a death
    w = world_factory(1, 3, keep_alive_interval=0.2, keep_alive_max_attempt=5, last_call_timeout=1)
    a, b, c = w.handler("a"), w.handler("b"), w.handler("c")
    assert {i.world_size for i in w.join(a, b, c)} == {3}
    assert [h.job_channel().num_nodes_lost() for h in (a, b, c)] == [0, 0, 0]
    c._stop_heartbeats()  # c's link is cut: a and b must notice without any worker failing
    wait_for(lambda: [h.job_channel().num_nodes_lost() for h in (a, b)] == [1, 1], 10, what="c seen as lost")
    # the survivors re-form a world of 2 without c
    infos = list(w.join(a, b))
    assert sorted(i.rank for i in infos) == [0, 1] and {i.world_size for i in infos} == {2}
    assert a.job_channel().num_nodes_lost() == 0


def test_a_member_leaving_to_rejoin_is_lost_for_the_others(world_factory):
    w = world_factory(2, 2)
    a, b = w.handler("a"), w.handler("b")
    list(w.join(a, b))
    fut = w.pool.submit(a.next_rendezvous)  # a's workers failed: it rejoins
    wait_for(lambda: b.job_channel().num_nodes_lost() == 1, 5, what="b to see a leave")
    assert b.job_channel().num_nodes_new() == 0  # a rejoining member is not a newcomer: b's failures still count
    b.next_rendezvous()
    assert fut.result(timeout=20).round == 1


def test_a_member_leaving_to_rejoin_has_not_left_the_job(world_factory, caplog):
    # seen on namespace hosts: at a worker's failure the node that left second said "only 1 of the job's nodes
    # are left ... waiting up to join_timeout" when the other had left first to rejoin, every node alive
    w = world_factory(2, 2)
    a, b = w.handler("a"), w.handler("b")
    list(w.join(a, b))
    fut = w.pool.submit(a.next_rendezvous)
    wait_for(lambda: b.job_channel().num_nodes_lost() == 1, 5, what="b to see a leave")
    with caplog.at_level(logging.WARNING, logger="elaunch"):
        b.next_rendezvous()
    assert fut.result(timeout=20).round == 1
    assert "nodes are left" not in caplog.text


def test_a_member_gone_for_good_is_said_when_the_next_round_waits(world_factory, caplog):
    w = world_factory(2, 3, keep_alive_interval=0.2, keep_alive_max_attempt=5, last_call_timeout=0.5, join_timeout=2)
    a, b, c = w.handler("a"), w.handler("b"), w.handler("c")
    list(w.join(a, b, c))
    b._stop_heartbeats()
    c._stop_heartbeats()  # b and c die: a waits for one more node
    wait_for(lambda: a.job_channel().num_nodes_lost() == 2, 10, what="b and c seen as lost")
    with caplog.at_level(logging.WARNING, logger="elaunch"), pytest.raises(RendezvousTimeoutError):
        a.next_rendezvous()
    assert "only 1 of the job's nodes are left (--nnodes=2:3)" in caplog.text


def test_heartbeats_in_keys_keep_members_alive_though_the_stored_state_is_old():
    s = settings(2, 3, last_call_timeout=0.1, keep_alive_interval=0.1, keep_alive_max_attempt=2)  # dead after 0.2 s
    backend = InMemoryBackend()
    hs = [DynamicRendezvousHandler(NodeInfo(f"n{i}", "trainer", 1), s, backend, FakeRoundStores()) for i in range(3)]
    a, b, c = hs
    pool = ThreadPoolExecutor(max_workers=3)
    try:
        infos = list(pool.map(lambda h: h.next_rendezvous(), (a, b)))
        assert {i.world_size for i in infos} == {2}
        stored = lambda: RendezvousState.from_bytes(backend.get_state()[0])  # noqa: E731
        writes = backend.writes
        # the heartbeats go to the keys: the stored ones age past dead_after, untouched
        wait_for(lambda: time.time() - max(stored().last_heartbeats.values()) > 1.0, 5, what="stored beats to age")
        assert backend.writes == writes
        assert a.job_channel().num_nodes_lost() == 0 and b.job_channel().num_nodes_lost() == 0
        late = pool.submit(c.next_rendezvous)  # a joiner must judge a and b by their keys, not prune them
        wait_for(lambda: a.num_nodes_waiting() == 1, 5, what="c on the wait list")
        assert set(stored().participants) == {a.node_id, b.node_id}
        assert not late.done()
        a.set_closed()
        with pytest.raises(RendezvousClosedError):
            late.result(timeout=10)
    finally:
        for h in hs:
            h._stop_heartbeats()
        pool.shutdown(wait=True)


# ---------------------------------------------------------------- the job's end, seen from outside its round


@pytest.mark.parametrize("max_nodes, where", [(1, "redundancy_list"), (2, "wait_list")])
def test_a_node_outside_the_round_exits_gracefully_when_the_job_succeeds(world_factory, max_nodes, where):
    w = world_factory(1, max_nodes, last_call_timeout=0.05)
    a, late = w.handler("a"), w.handler("late")
    list(w.join(a))
    pending = w.pool.submit(late.next_rendezvous)
    wait_for(lambda: late.node_id in getattr(w.state(), where), 5, what=f"late on the {where}")
    a.job_channel().succeed_job()
    with pytest.raises(RendezvousGracefulExitError, match="the job succeeded"):
        pending.result(timeout=5)
    state = w.state()
    assert state.job_succeeded and state.closed
    assert late.node_id not in state.wait_list | state.redundancy_list  # it left: a need not wait for it
    assert a.shutdown() is True


@pytest.mark.parametrize("max_nodes", [1, 2])
def test_a_node_outside_the_round_gets_the_root_cause_when_the_job_fails(world_factory, max_nodes):
    w = world_factory(1, max_nodes, last_call_timeout=0.05)
    a, late = w.handler("a"), w.handler("late")
    list(w.join(a))
    pending = w.pool.submit(late.next_rendezvous)
    wait_for(lambda: late.node_id in w.state().wait_list | w.state().redundancy_list, 5, what="late waiting")
    a.job_channel().fail_job(FailureRecord(round=0, at=1.0, host="ha", rank=0, exitcode=5))
    with pytest.raises(RendezvousJobFailedError) as failed:
        pending.result(timeout=5)
    assert (failed.value.failure.host, failed.value.failure.exitcode) == ("ha", 5)


def test_the_node_that_ends_the_job_waits_for_a_node_sitting_out(world_factory):
    w = world_factory(1, 2, last_call_timeout=0.05)
    a, b = w.handler("a"), w.handler("b")
    list(w.join(a, b))
    b.job_channel().sit_out()
    state = w.state()
    assert state.sitting_out == {b.node_id} and b.node_id not in state.participants
    assert b.job_channel().state().closed is False
    a.job_channel().succeed_job()
    done = w.pool.submit(a.shutdown)
    assert not wait([done], timeout=0.5).done  # b has not seen the end yet
    job = b.job_channel().state()
    assert job.succeeded and job.closed
    b.leave(rejoin=True)
    assert done.result(timeout=5) is True
    assert w.state().sitting_out == set()


def test_the_job_channel_publishes_node_records_beside_the_state(world_factory):
    """Node keys are part of every backend: a record lands in the node's key, the state is not written."""
    w = world_factory(1, 1)
    a = w.handler("ha")
    a.job_channel().publish_node_record("agent", {"pid": 7, "round": 0})
    assert w.backend.get_node_keys("agent", [a.node_id, "other"]) == {a.node_id: b'{"pid":7,"round":0}'}
    assert w.backend.writes == 0
