"""Batched joins and exits (``batching.py``) as tables: one node against ``IntentBackend``, and the pure decisions.

Each row seeds the stored state and other nodes' intents, scripts what other
nodes do while this node waits (hooks), runs the handler's next-round sequence
(leave the current round, then join the next) in simulated time, and names the
backend calls this node made and the state it ends with. The same paths run on a
real TCPStore in ``tests/integration/test_c10d_batched_join.py``.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from elaunch.rendezvous.contract import NodeInfo, RendezvousClosedError
from elaunch.rendezvous.dynamic.batching import BatchedJoin, Step, decide_exit, decide_join
from elaunch.rendezvous.dynamic.executor import OpExecutor
from elaunch.rendezvous.dynamic.handler import DynamicRendezvousHandler
from elaunch.rendezvous.dynamic.ops import Action, OpContext
from elaunch.rendezvous.dynamic.settings import RendezvousSettings
from elaunch.rendezvous.dynamic.state import JoinIntent, RendezvousState
from tests.unit.fakes import FakeRoundStores, IntentBackend, SimClock

T0 = 1_000_000.0
ME = "me"
GRACE = 5.0  # keep_alive_interval: how long a poster waits for the combiner


def settings(min_nodes: int, max_nodes: int) -> RendezvousSettings:
    return RendezvousSettings("job", min_nodes, max_nodes, keep_alive_interval=GRACE, keep_alive_max_attempt=3,
                              last_call_timeout=30, settle_timeout=1.0, poll_interval=0.2)


def running(*nodes: str, round: int = 0, hb: float = T0) -> RendezvousState:
    """A complete round of ``nodes`` (ranks in order), each heart-beating at ``hb``."""
    infos = {n: NodeInfo(n, "trainer", 1) for n in nodes}
    return RendezvousState(round=round, complete=True, participants={n: r for r, n in enumerate(nodes)},
                           node_infos=infos, last_heartbeats={n: hb for n in nodes})


def forming(*nodes: str, hb: float = T0) -> RendezvousState:
    """Round 0, not complete, with ``nodes`` joined."""
    infos = {n: NodeInfo(n, "trainer", 1) for n in nodes}
    return RendezvousState(participants={n: -1 for n in nodes}, node_infos=infos,
                           last_heartbeats={n: hb for n in nodes})


def seed(b: IntentBackend, state: RendezvousState) -> None:
    """Store ``state`` and its nodes' heartbeat keys (every node has one before it appears in a state)."""
    b.put(state.to_bytes())
    b.beats.update(state.last_heartbeats)


# -- what other nodes do meanwhile (hooks) ------------------------------------------------

def posts(*nodes: str, round: int = 0):
    """Each of ``nodes`` posts its intent for ``round`` (previous rank: its index + 1), at the current time."""
    def hook(b: IntentBackend) -> None:
        for i, node in enumerate(nodes):
            b.post(node, round, b.clock.time(), previous_rank=i + 1)
    return hook


def combiner_forms(round: int, *nodes: str):
    """The round's combiner (another node) writes ``round`` complete with ``nodes`` and announces it."""
    def hook(b: IntentBackend) -> None:
        seed(b, running(*nodes, round=round, hb=b.clock.time()))
        b.announce(round)
    return hook


def combiner_adds(*nodes: str):
    """The round's combiner (another node) writes round 0, still forming, with ``nodes`` (not announced)."""
    def hook(b: IntentBackend) -> None:
        seed(b, forming(*nodes, hb=b.clock.time()))
    return hook


def then(method: str, first, *rest):
    """``first`` at this call of ``method``, each of ``rest`` at the next calls of ``method``, in order."""
    def hook(b: IntentBackend) -> None:
        first(b)
        if rest:
            b.on(method, then(method, *rest))
    return hook


#: the backend calls in a row's trace, by short name
SHORT = {"get_state": "read", "get_stored_state": "read-stored", "get_state_token": "probe", "get_state_and_heartbeats": "read", "get_heartbeats": "read-keys",
         "get_state_and_intents": "read+log", "set_state": "write", "put_heartbeat": "beat", "post_intent": "post",
         "wait_for_arrival": "await-post", "wait_for_round": "await-round", "notify_round": "notify"}


def trace(calls: list[str]) -> str:
    """``calls`` by short name, a run of k equal calls as ``name*k``."""
    out: list[list] = []
    for call in calls:
        name = SHORT[call]
        if out and out[-1][0] == name:
            out[-1][1] += 1
        else:
            out.append([name, 1])
    return " ".join(name if k == 1 else f"{name}*{k}" for name, k in out)


def next_round(ex: OpExecutor, previous_rank: int) -> RendezvousState:
    """What ``DynamicRendezvousHandler.next_rendezvous`` asks of its executor: leave the round, join the next."""
    leaving = ex.exit(previous_rank, 600, "join_timeout")
    return ex.join(previous_rank, 600, "join_timeout", leaving, fresh=False)


ROWS = [
    # name, (min, max), stored state, others' posts before ours (node, round, age s),
    # hooks (backend call -> what others do then), our previous rank,
    # -> our backend calls, seconds it took, the round we end in and its ranks
    ("alone: the combiner adds itself", (1, 1), None, [], [], -1,
     "read beat post read+log write notify", 0.0, 0, {ME: 0}),
    ("the combiner adds who posted after it, in one write", (3, 3), None, [],
     [("post_intent", posts("n2", "n3"))], -1,
     "read beat post read+log write notify", 0.0, 0, {ME: 0, "n2": 1, "n3": 2}),
    ("the combiner adds a late post while the last call runs", (2, 3), None, [],
     [("post_intent", posts("n2")), ("wait_for_arrival", posts("n3"))], -1,
     "read beat post read+log write await-post read+log write notify", 0.0, 0, {ME: 0, "n2": 1, "n3": 2}),
    ("a poster waits for the combiner, who adds it: no write of its own", (2, 2), None, [("n0", 0, 0.0)],
     [("wait_for_round", combiner_forms(0, "n0", ME))], -1,
     "read beat post await-round read-stored", 0.0, 0, {"n0": 0, ME: 1}),
    ("the combiner never combines: the poster adds itself after the grace, not the stale combiner", (1, 2), None,
     [("ghost", 0, 100.0)], [], -1,
     "read beat post await-round probe read+log write await-round probe read+log write notify", 6.01, 0, {ME: 0}),
    ("the combiner never combines: a fresh combiner is added with the poster", (1, 2), None, [("n0", 0, 0.0)], [],
     -1, "read beat post await-round probe read+log write notify", GRACE, 0, {ME: 0, "n0": 1}),
    ("the combiner works through a crowd: past the grace the poster sees its progress and waits on", (3, 3), None,
     [("n0", 0, 0.0)],
     [("wait_for_round", then("wait_for_round", combiner_adds("n0", "n2"), combiner_forms(0, "n0", "n2", ME)))], -1,
     "read beat post await-round probe await-round read-stored", GRACE, 0, {"n0": 0, "n2": 1, ME: 2}),
    ("the combiner stalls after a batch: a whole grace without progress, the poster adds itself", (3, 3), None,
     [("n0", 0, 0.0)], [("wait_for_round", combiner_adds("n0", "n2"))], -1,
     "read beat post await-round probe await-round probe read+log read-keys write notify", 2 * GRACE, 0,
     {ME: 0, "n0": 1, "n2": 2}),
    ("a dead member: the joiner posts first, then prunes it", (1, 1), forming("n0", hb=T0 - 100), [], [], -1,
     "read read-keys beat post read+log write*2 notify", 0.0, 0, {ME: 0}),
    ("restart, all leave: the combiner removes all, then adds all", (3, 3), running(ME, "n2", "n3"), [],
     [("post_intent", posts("n2", "n3", round=1))], 0,
     "read post beat read+log write*2 notify", 0.0, 1, {ME: 0, "n2": 1, "n3": 2}),
    ("restart while a member runs: the leavers wait, the last one out opens the round", (3, 3),
     running(ME, "n2", "n3"), [],
     [("post_intent", posts("n2", round=1)), ("wait_for_arrival", lambda b: b.post("n3", 1, b.clock.time(), 2))], 0,
     "read post beat read+log write await-post read+log write*2 notify", 0.0, 1, {ME: 0, "n2": 1, "n3": 2}),
    ("a leaver waits for the exit combiner, who removes it and adds it", (2, 2), running(ME, "n2"), [("n2", 1, 0.0)],
     [("wait_for_round", combiner_forms(1, ME, "n2"))], 0,
     "read post beat await-round read-stored", 0.0, 1, {ME: 0, "n2": 1}),
    ("the exit combiner never acts: the leaver leaves on its own after the grace", (1, 2), running(ME, "n2"),
     [("n2", 1, 10.0)], [], 0,
     "read post beat await-round probe read write*3 read*16 write post await-round probe read+log write "
     "await-round probe read+log write notify", 14.2, 1, {ME: 0}),
    ("exit from a round still forming: a plain removal, then a batched join", (1, 2), forming(ME), [], [], -1,
     "read write beat post read+log write await-post read+log write notify", 1.0, 0, {ME: 0}),
]


@pytest.mark.parametrize("name, sizes, stored, posted, hooks, previous_rank, calls, took, round, ranks", ROWS,
                         ids=[row[0] for row in ROWS])
def test_one_node_batched(name, sizes, stored, posted, hooks, previous_rank, calls, took, round, ranks):
    clock = SimClock(T0)
    b = IntentBackend(clock)
    if stored is not None:
        seed(b, stored)
    for node, log_round, age in posted:
        b.post(node, log_round, T0 - age)
    for method, hook in hooks:
        b.on(method, hook)
    ex = OpExecutor(b, ME, NodeInfo(ME, "trainer", 1), settings(*sizes), clock.time, clock.sleep)
    state = next_round(ex, previous_rank)
    assert (trace(b.calls), clock.now - T0) == (calls, pytest.approx(took, abs=0.02))
    assert (state.round, state.complete, state.participants) == (round, True, ranks)
    assert RendezvousState.from_bytes(b.get_state()[0]).participants == ranks  # what we ended on is stored


def test_a_participant_of_the_round_it_joined_posts_its_exit_without_reading():
    clock = SimClock(T0)
    b = IntentBackend(clock)
    seed(b, running(ME, "n2"))
    ex = OpExecutor(b, ME, NodeInfo(ME, "trainer", 1), settings(2, 2), clock.time, clock.sleep)
    ex.read()  # the round as this node saw it complete
    b.post("n2", 1, T0)  # n2 left first: it removes us (the exit's combiner)
    b.calls.clear()
    b.on("wait_for_round", combiner_forms(1, ME, "n2"))
    state = next_round(ex, 0)
    assert (trace(b.calls), state.round, state.participants) == ("post beat await-round read-stored", 1, {ME: 0, "n2": 1})


def test_a_stale_round_the_exit_posts_into_a_closed_rendezvous_then_fails_closed_at_once():
    clock = SimClock(T0)
    b = IntentBackend(clock)
    seed(b, running(ME, "n2"))
    ex = OpExecutor(b, ME, NodeInfo(ME, "trainer", 1), settings(2, 2), clock.time, clock.sleep)
    ex.read()
    closed = running(ME, "n2")
    closed.closed = True
    seed(b, closed)  # another node closed it; the close also announces the next round
    b.announce(1)
    b.calls.clear()
    with pytest.raises(RendezvousClosedError):
        next_round(ex, 0)
    assert (trace(b.calls), clock.now) == ("post beat await-round read-stored", T0)


def test_a_crowd_of_handlers_joins_and_restarts_in_a_few_writes():
    # the same paths in threads, in real time: 16 handlers join, then all restart at once
    backend = IntentBackend()
    s = RendezvousSettings("job", 16, 16, poll_interval=0.05)
    hs = [DynamicRendezvousHandler(NodeInfo(f"10.0.0.{i}", "trainer", 1), s, backend, FakeRoundStores())
          for i in range(16)]
    with ThreadPoolExecutor(max_workers=16) as pool:
        try:
            first = {h.node_id: i.rank for h, i in zip(hs, pool.map(lambda h: h.next_rendezvous(), hs))}
            assert sorted(first.values()) == list(range(16))
            before = backend.writes
            infos = list(pool.map(lambda h: h.next_rendezvous(), hs))
            assert {(i.round, i.world_size) for i in infos} == {(1, 16)}
            assert {h.node_id: i.rank for h, i in zip(hs, infos)} == first  # ranks kept across the restart
            # unbatched, each node writes its exit and its wait-list entry (32 writes at least)
            assert backend.writes - before < 16, backend.writes - before
        finally:
            for h in hs:
                h._stop_heartbeats()


def batch(round=None, combiner=False, posted=T0, intents=(), progress_at=None):
    """This node's BatchedJoin as it stands after posting to ``round`` (None: not posted).

    ``progress_at``: when it last read a state changed since its previous look (None: never since posting).
    """
    b = BatchedJoin(IntentBackend(), ME, NodeInfo(ME, "trainer", 1), -1, settings(2, 3))
    b.round, b.first, b.posted_at, b.grace_from = round, combiner, posted, posted
    if progress_at is not None:
        b.saw(b"changed", progress_at)
    b.intents = [JoinIntent(n, NodeInfo(n, "trainer", 1), -1, r, T0) for n, r in intents]
    return b


def ctx(deadline=T0 + 600):
    return OpContext(ME, NodeInfo(ME, "trainer", 1), settings(2, 3), deadline, -1, T0)


DECISIONS = [
    # name, decide, state, our batch, now -> what the executor is asked to do
    ("join: not posted, the round forms", decide_join, forming("n0"), batch(), T0, Step.POST_JOIN),
    ("join: not posted, a dead member", decide_join, forming("n0", hb=T0 - 100), batch(), T0, Step.POST_JOIN),
    ("join: the combiner adds itself and the log", decide_join, forming("n0"), batch(0, True), T0,
     Step.COMBINE_JOINS),
    ("join: a poster within the grace", decide_join, forming("n0"), batch(0), T0 + 1, Step.AWAIT_COMBINER),
    ("join: a poster past the grace", decide_join, forming("n0"), batch(0), T0 + GRACE, Step.COMBINE_JOINS),
    ("join: the combiner, joined, adds who posted since", decide_join, forming(ME), batch(0, True), T0,
     Step.COMBINE_PENDING),
    ("join: a participant waits for the notice", decide_join, forming(ME), batch(0), T0, Step.AWAIT_ROUND),
    ("join: the round completed", decide_join, running(ME, "n0"), batch(0), T0, Action.FINISH),
    ("exit: a participant of a running round posts", decide_exit, running(ME, "n0"), batch(), T0, Step.POST_EXIT),
    ("exit: posted", decide_exit, running(ME, "n0"), batch(1), T0, Action.FINISH),
    ("exit: a forming round: a plain removal", decide_exit, forming(ME), batch(), T0,
     Action.REMOVE_FROM_PARTICIPANTS),
    ("leaving: the combiner removes who posted", decide_join, running(ME, "n0"), batch(1, True, intents=[(ME, 1)]),
     T0, Step.COMBINE_EXITS),
    ("leaving: the combiner, nobody left to remove, waits on the wait list", decide_join,
     RendezvousState(complete=True, participants={"n0": 0}, wait_list={ME}, last_heartbeats={"n0": T0, ME: T0},
                     node_infos={n: NodeInfo(n, "trainer", 1) for n in ("n0", ME)}),
     batch(1, True, intents=[(ME, 1)]), T0 + 0.5, Step.AWAIT_LEAVERS),
    ("join: past the grace since the post, within it since the combiner's last write", decide_join, forming("n0"),
     batch(0, posted=T0 - GRACE, progress_at=T0 - 1), T0, Step.AWAIT_COMBINER),
    ("leaving: past the grace since the post, within it since the combiner's last write", decide_join,
     running(ME, "n0"), batch(1, posted=T0 - GRACE, progress_at=T0 - 1), T0, Step.AWAIT_COMBINER),
    ("leaving: within the grace", decide_join, running(ME, "n0"), batch(1), T0 + 1, Step.AWAIT_COMBINER),
    ("leaving: past the grace, on our own", decide_join, running(ME, "n0"), batch(1), T0 + GRACE, Step.LEAVE_ALONE),
    ("leaving: past the grace and the deadline", decide_join, running(ME, "n0"), batch(1), T0 + 700,
     Step.LEAVE_TIMEOUT),
    ("leaving: moved to the wait list by the combiner", decide_join, running("n0"), batch(1), T0, Step.FORGET_EXIT),
]


@pytest.mark.parametrize("name, decide, state, our_batch, now, expected", DECISIONS, ids=[d[0] for d in DECISIONS])
def test_batched_decisions(name, decide, state, our_batch, now, expected):
    assert decide(state, ctx(), now, our_batch) is expected
