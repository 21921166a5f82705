"""The job channel seam: the agent's JobView over the in-memory and local channels, and who hands out which.

Pure logic: no processes, no stores. The in-memory channel scripts the job's facts
as data; the local one is what static, standalone and plugin handlers hand out.
"""

from __future__ import annotations

import ast
import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from elaunch.agent.decide import Step, Verdict
from elaunch.agent.job import JobView
from elaunch.rendezvous.dynamic.channel import AWAIT_FAST, AWAIT_SCALE, AWAIT_SLOW, await_interval
from elaunch.rendezvous.job_channel import publish
from elaunch.rendezvous.contract import FailureRecord, JobState, NodeInfo
from elaunch.rendezvous.dynamic.exchange import NodeExchange
from elaunch.rendezvous.dynamic.handler import DynamicRendezvousHandler
from elaunch.rendezvous.dynamic.settings import RendezvousSettings
from elaunch.rendezvous.job_channel import LOCAL_NODE, InMemoryJobChannel, JobChannel, LocalJobChannel
from elaunch.rendezvous.standalone import StandaloneRendezvous
from elaunch.spec import WorkerState
from tests.unit.fakes import FakeRoundStores, InMemoryBackend

PACKAGE = Path(__file__).resolve().parents[2] / "elaunch"


class _Handler(StandaloneRendezvous):
    """A standalone handler handing out a given channel (the agent only sees the interface)."""

    def __init__(self, channel: JobChannel) -> None:
        super().__init__("job-channel-test", NodeInfo("127.0.0.1"))
        self._channel = channel

    def job_channel(self) -> JobChannel:
        return self._channel


def _rec(round: int, rank: int = 0) -> FailureRecord:
    return FailureRecord(round=round, at=1.0 + round, host="h", rank=rank, exitcode=3)


def test_handlers_without_job_state_hand_out_the_local_channel():
    channel = StandaloneRendezvous("r", NodeInfo("127.0.0.1")).job_channel()
    assert isinstance(channel, LocalJobChannel) and not channel.keeps_job_state
    assert channel.node_id is None and channel.round_members == frozenset()
    assert channel.state() is None and channel.record_failure(_rec(0)) is None
    assert channel.fail_job(_rec(0)) == _rec(0)
    assert (channel.num_nodes_lost(), channel.num_nodes_new(), channel.request_stack_dump(_rec(0))) == (0, 0, 0)
    assert publish(channel, "agent", {"pid": 1}) is None  # nothing to publish to: no thread


def test_the_dynamic_handler_hands_out_one_channel_named_after_its_node():
    h = DynamicRendezvousHandler(NodeInfo("127.0.0.1"), RendezvousSettings("r", 1, 1), InMemoryBackend(),
                                 FakeRoundStores())
    assert h.job_channel() is h.job_channel() and h.job_channel().keeps_job_state
    assert h.job_channel().node_id == h.node_id and h.can_reform


@pytest.mark.parametrize("max_restarts, step, used", [(1, Step.RESTART, 1), (0, Step.FINISH_FAILED, 0)])
def test_jobview_counts_a_failure_once_through_the_channel(max_restarts, step, used):
    channel = InMemoryJobChannel()
    view = JobView(_Handler(channel), max_restarts)
    got = view.decide(Verdict.FAILED, _rec(0))
    assert (got[0], view.restarts, view.left) == (step, used, max_restarts - used) and channel.job.restarts == 1
    assert channel.job.failed is (step is Step.FINISH_FAILED)


def test_jobview_counts_alone_without_job_state_and_decides_other_stops_on_its_budget():
    view = JobView(StandaloneRendezvous("r", NodeInfo("127.0.0.1")), 1)
    assert view.decide(Verdict.FAILED, _rec(0)) == (Step.RESTART, _rec(0)) and (view.restarts, view.left) == (1, 0)
    view.joined(None)  # a round without the job's count keeps the agent's own
    assert view.decide(Verdict.FAILED, _rec(1)) == (Step.FINISH_FAILED, _rec(1)) and view.restarts == 1
    assert view.decide(Verdict.FAILED, None, fixable=False)[0] is Step.FAIL_AT_ONCE
    assert [view.decide(v)[0] for v in (Verdict.SUCCEEDED, Verdict.MEMBERSHIP_CHANGE, Verdict.JOB_FAILED)] == [
        Step.FINISH_OK, Step.REJOIN, Step.FINISH_FAILED]
    assert view.restarts == 1


def test_jobview_rejoins_uncounted_when_a_lost_member_caused_the_failure():
    channel = InMemoryJobChannel()
    channel.lost = ("b",)
    view = JobView(_Handler(channel), 3)
    assert view.decide(Verdict.FAILED, _rec(0))[0] is Step.REJOIN
    assert channel.job.restarts == view.restarts == 0


def test_jobview_acknowledges_a_job_failed_elsewhere():
    channel = InMemoryJobChannel(job=JobState(failed=True, closed=True, failure=_rec(2, rank=5)))
    step, root = JobView(_Handler(channel), 3).decide(Verdict.FAILED, _rec(2))
    assert (step, root.rank) == (Step.FINISH_FAILED, 5) and channel.calls[-1] == "acknowledge_failure"


def test_jobview_publishes_success_and_reads_the_channel():
    channel = InMemoryJobChannel()
    view = JobView(_Handler(channel), 0)
    view.succeed()
    assert view.read().succeeded and view.state.node == "node0"
    view.joined(1)
    result = view.failed_elsewhere(_rec(0, rank=2))
    assert result.state is WorkerState.FAILED and result.root_rank == 2 and result.restarts == 1


def test_no_capability_is_probed_with_getattr_on_a_handler_or_backend():
    probes = []
    for path in [*PACKAGE.joinpath("agent").glob("*.py"), *PACKAGE.joinpath("rendezvous").rglob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
                    and ast.unparse(node.args[0]) in ("self._rdzv", "rdzv", "self._backend", "backend")):
                probes.append(f"{path.name}:{node.lineno}")
    assert probes == []


# -- exchange: one round's documents between the members ----------------------------------


def test_the_local_channel_exchanges_with_nobody():
    channel = StandaloneRendezvous("r", NodeInfo("127.0.0.1")).job_channel()
    assert channel.exchange("ckpt", 0, {"held": [1]}, timeout=30) == {LOCAL_NODE: {"held": [1]}}


def test_the_in_memory_channel_returns_the_scripted_peers_and_notes_the_call():
    channel = InMemoryJobChannel("a")
    channel.peer_docs["ckpt"] = {"b": {"x": 2}}
    assert channel.exchange("ckpt", 3, {"x": 1}, 1.0) == {"a": {"x": 1}, "b": {"x": 2}}
    assert channel.exchange("other", 3, {}, 1.0) == {"a": {}}
    assert channel.exchanged == [("ckpt", 3, {"x": 1}), ("other", 3, {})]


def test_the_dynamic_channel_before_any_round_exchanges_with_itself():
    backend = InMemoryBackend()
    h = DynamicRendezvousHandler(NodeInfo("127.0.0.1"), RendezvousSettings("r", 1, 1), backend, FakeRoundStores())
    me = h.job_channel().node_id
    assert h.job_channel().exchange("ckpt", 0, {"x": 1}, timeout=5) == {me: {"x": 1}}
    assert json.loads(backend.node_keys["exchange-ckpt", me]) == {"round": 0, "doc": {"x": 1}}


def _exchange_all(backend, calls, timeout=5.0):
    """Run ``(node, round, doc, members)`` exchanges at once, each in its thread; their results in order."""
    with ThreadPoolExecutor(len(calls)) as pool:
        futures = [pool.submit(NodeExchange(backend, node).run, "ckpt", rnd, doc, members, timeout)
                   for node, rnd, doc, members in calls]
        return [f.result(timeout + timeout + 5) for f in futures]


def test_members_exchange_their_documents_of_one_round():
    backend = InMemoryBackend()
    members = {"a", "b", "c"}
    got = _exchange_all(backend, [(n, 4, {"n": n}, members) for n in sorted(members)])
    assert got == [{n: {"n": n} for n in members}] * 3


def test_a_member_that_never_publishes_is_left_out_after_the_timeout():
    backend = InMemoryBackend()
    start = time.monotonic()
    got = _exchange_all(backend, [("a", 1, {}, {"a", "b", "z"}), ("b", 1, {}, {"a", "b", "z"})], timeout=0.3)
    assert got == [{"a": {}, "b": {}}] * 2 and 0.3 <= time.monotonic() - start < 3


def test_a_document_of_an_older_round_is_not_this_rounds():
    backend = InMemoryBackend()
    _exchange_all(backend, [("a", 1, {"old": 1}, {"a", "b"}), ("b", 1, {"old": 1}, {"a", "b"})])
    assert _exchange_all(backend, [("a", 2, {"new": 1}, {"a", "b"})], timeout=0.2) == [{"a": {"new": 1}}]


def test_a_member_that_moved_on_to_a_newer_round_is_not_waited_for():
    backend = InMemoryBackend()
    backend.put_node_key("exchange-ckpt", "b", json.dumps({"round": 3, "doc": {}}).encode())
    start = time.monotonic()
    assert _exchange_all(backend, [("a", 2, {}, {"a", "b"})], timeout=4) == [{"a": {}}]
    assert time.monotonic() - start < 2


def test_everyone_takes_the_leaders_set_when_a_member_comes_late():
    """The leader (lowest id) gave up on b; c, still waiting, then sees b: c and b both drop b, as the leader did."""
    backend = InMemoryBackend()
    members = {"a", "b", "c"}
    with ThreadPoolExecutor(2) as pool:
        c = pool.submit(NodeExchange(backend, "c").run, "ckpt", 5, {"n": "c"}, members, 10.0)
        a = NodeExchange(backend, "a").run("ckpt", 5, {"n": "a"}, members, 0.3)
        assert a == {"a": {"n": "a"}, "c": {"n": "c"}}
        b = NodeExchange(backend, "b").run("ckpt", 5, {"n": "b"}, members, 10.0)
        assert b == a and c.result(20) == a


class _Lagging:
    """A backend view on which ``hidden``'s key is unreadable until the leader ``a``'s agreed list was read."""

    def __init__(self, backend: InMemoryBackend, hidden: str) -> None:
        self._backend, self._hidden = backend, hidden
        self._agreed = False

    def put_node_key(self, kind, node_id, data):
        self._backend.put_node_key(kind, node_id, data)

    def get_node_keys(self, kind, nodes):
        got = self._backend.get_node_keys(kind, nodes)
        if list(nodes) == ["a"] and b'"agreed"' in got.get("a", b""):
            self._agreed = True  # only the wait for the leader's list reads its key alone
            return got
        return got if self._agreed else {n: v for n, v in got.items() if n != self._hidden}


def test_a_member_that_gave_up_on_a_document_the_leader_took_reads_it_again():
    backend = InMemoryBackend()
    members = {"a", "b", "c"}
    with ThreadPoolExecutor(2) as pool:
        c = pool.submit(NodeExchange(_Lagging(backend, "b"), "c").run, "ckpt", 1, {"n": "c"}, members, 0.2)
        b = pool.submit(NodeExchange(backend, "b").run, "ckpt", 1, {"n": "b"}, members, 10.0)
        a = NodeExchange(backend, "a").run("ckpt", 1, {"n": "a"}, members, 10.0)
        assert a == {n: {"n": n} for n in members} and b.result(20) == a and c.result(20) == a


def test_without_the_leaders_list_a_member_keeps_what_it_saw():
    backend = InMemoryBackend()
    start = time.monotonic()
    assert _exchange_all(backend, [("b", 0, {}, {"a", "b"})], timeout=0.2) == [{"b": {}}]
    assert time.monotonic() - start >= 0.4  # its own wait, then the wait for the leader's list


@pytest.mark.parametrize("kind", ["", "a/b", "x y", "ckpt-1"])
def test_a_bad_kind_is_a_value_error(kind):
    with pytest.raises(ValueError, match="exchange kind"):
        NodeExchange(InMemoryBackend(), "a").run(kind, 0, {}, {"a"}, 1.0)


def test_unreadable_documents_count_as_missing():
    backend = InMemoryBackend()
    for node, data in [("b", b"not json"), ("c", b'{"round": 0}'), ("d", b'{"round": "0", "doc": {}}')]:
        backend.put_node_key("exchange-ckpt", node, data)
    assert _exchange_all(backend, [("a", 0, {}, {"a", "b", "c", "d"})], timeout=0.1) == [{"a": {}}]


@pytest.mark.parametrize("members", [2, 3, 8, 16, 17, 64, 1024])
def test_waiting_for_the_others_reads_often_in_small_rounds_and_no_more_often_at_scale(members):
    interval = await_interval(members, poll_interval=1.0)
    # the job's reads a second: never more than every 50 ms (as before), nor than a 16-node job's in a smaller round
    assert members / interval <= max(members, AWAIT_SCALE) / AWAIT_SLOW + 1e-6
    assert AWAIT_FAST <= interval <= AWAIT_SLOW
    if members <= 2:
        assert interval <= 0.01  # an answer written 10 ms later is seen within 10 ms, not 50
    assert await_interval(members, poll_interval=0.002) == 0.002  # never above poll_interval
