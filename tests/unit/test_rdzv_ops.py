"""Table-driven tests of the dynamic rendezvous' pure decisions and state changes."""

from __future__ import annotations

import pytest

from elaunch.rendezvous.contract import NodeInfo
from elaunch.rendezvous.dynamic import liveness, merge, ops
from elaunch.rendezvous.dynamic.ops import Action, OpContext
from elaunch.rendezvous.dynamic.settings import RendezvousSettings
from elaunch.rendezvous.dynamic.state import JoinIntent, RendezvousState

NOW = 1_000_000.0
#: torch's fixed last call (settle_timeout=None); ADAPTIVE adds the settle window.
SETTINGS = RendezvousSettings(
    "job", 2, 3, last_call_timeout=30, settle_timeout=None, keep_alive_interval=5, keep_alive_max_attempt=3
)
ADAPTIVE = RendezvousSettings("job", 2, 4, last_call_timeout=30, settle_timeout=1.0)
ME = "n1"


def mk(participants=(), complete=False, deadline=None, wait=(), redundant=(), closed=False, hb=None, round=0,
       hard=None):
    """A state; every listed node heart-beat at NOW unless ``hb`` overrides."""
    parts = dict(participants) if isinstance(participants, dict) else {n: -1 for n in participants}
    nodes = set(parts) | set(wait) | set(redundant)
    beats = {n: NOW for n in nodes}
    beats.update(hb or {})
    infos = {n: NodeInfo(n, "default", 1) for n in nodes}
    return RendezvousState(round, complete, deadline, closed, parts, infos, set(wait), set(redundant), beats, hard)


def ctx(deadline=NOW + 600, previous_rank=-1, settings=SETTINGS, started=NOW):
    return OpContext(ME, NodeInfo(ME, "default", 2), settings, deadline, previous_rank, started)


JOIN_CASES = [
    ("first node joins", mk(), ctx(), Action.ADD_TO_PARTICIPANTS),
    ("closed", mk(closed=True), ctx(), Action.ERROR_CLOSED),
    ("closed while redundant", mk(closed=True, redundant=[ME]), ctx(), Action.ERROR_GRACEFUL_EXIT),
    ("dead node pruned first", mk(["n0"], hb={"n0": NOW - 16}), ctx(), Action.REMOVE_DEAD_NODES),
    ("heartbeat at the limit is alive", mk(["n0"], hb={"n0": NOW - 15}), ctx(), Action.ADD_TO_PARTICIPANTS),
    ("below min: wait", mk([ME]), ctx(), Action.SYNC),
    ("below min, stale heartbeat", mk([ME], hb={ME: NOW - 6}), ctx(), Action.KEEP_ALIVE),
    ("min reached, last call running", mk([ME, "n0"], deadline=NOW + 10), ctx(), Action.SYNC),
    ("last call expired", mk([ME, "n0"], deadline=NOW - 1), ctx(), Action.MARK_COMPLETE),
    ("complete and in it", mk({ME: 0, "n0": 1}, complete=True), ctx(), Action.FINISH),
    ("complete and in it, a member silent past dead_after: finish, the monitors find it",
     mk({ME: 0, "n0": 1}, complete=True, hb={"n0": NOW - 16}), ctx(), Action.FINISH),
    ("join after complete: room", mk({"n0": 0, "n2": 1}, complete=True), ctx(), Action.ADD_TO_WAIT_LIST),
    ("already waiting", mk({"n0": 0, "n2": 1}, complete=True, wait=[ME]), ctx(), Action.SYNC),
    ("join after complete: full", mk({"n0": 0, "n2": 1, "n3": 2}, complete=True), ctx(), Action.ADD_TO_REDUNDANCY_LIST),
    ("redundant, still full", mk({"n0": 0, "n2": 1, "n3": 2}, complete=True, redundant=[ME]), ctx(), Action.SYNC),
    ("redundant ignores join timeout", mk({"n0": 0, "n2": 1, "n3": 2}, complete=True, redundant=[ME]),
     ctx(deadline=NOW - 100), Action.SYNC),
    ("redundant, room again", mk({"n0": 0, "n2": 1}, complete=True, redundant=[ME]), ctx(),
     Action.REMOVE_FROM_REDUNDANCY_LIST),
    ("timeout as participant: roll back", mk([ME]), ctx(deadline=NOW - 1), Action.REMOVE_FROM_PARTICIPANTS),
    ("timeout while waiting: roll back", mk({"n0": 0}, complete=True, wait=[ME]), ctx(deadline=NOW - 1),
     Action.REMOVE_FROM_WAIT_LIST),
    ("timeout past rollback period", mk([ME]), ctx(deadline=NOW - 10), Action.ERROR_TIMEOUT),
    ("join timeout, not in state", mk(["n0"]), ctx(deadline=NOW - 1), Action.ERROR_TIMEOUT),
]


@pytest.mark.parametrize("name,state,context,expected", JOIN_CASES, ids=[c[0] for c in JOIN_CASES])
def test_decide_join(name, state, context, expected):
    assert ops.decide_join(state, context, NOW) is expected


OTHER_CASES = [
    ("exit: participant leaves", ops.decide_exit, mk({ME: 0}, complete=True), ctx(), Action.REMOVE_FROM_PARTICIPANTS),
    ("exit: not in round", ops.decide_exit, mk({"n0": 0}, complete=True), ctx(), Action.FINISH),
    ("exit: timed out", ops.decide_exit, mk({ME: 0}), ctx(deadline=NOW - 1), Action.ERROR_TIMEOUT),
    ("close: open", ops.decide_close, mk(), ctx(), Action.MARK_CLOSED),
    ("close: already closed", ops.decide_close, mk(closed=True), ctx(), Action.FINISH),
    ("close: timed out", ops.decide_close, mk(), ctx(deadline=NOW - 1), Action.ERROR_TIMEOUT),

]


@pytest.mark.parametrize("name,decide,state,context,expected", OTHER_CASES, ids=[c[0] for c in OTHER_CASES])
def test_decide_exit_and_close(name, decide, state, context, expected):
    assert decide(state, context, NOW) is expected


def test_first_node_joins_without_last_call():
    s = ops.apply(Action.ADD_TO_PARTICIPANTS, mk(), ctx(), NOW)
    assert s.participants == {ME: -1} and not s.complete and s.deadline is None
    assert s.last_heartbeats == {ME: NOW}
    assert s.node_infos[ME] == NodeInfo(ME, "default", 2)


def test_reaching_min_starts_last_call():
    s = ops.apply(Action.ADD_TO_PARTICIPANTS, mk(["n0"]), ctx(), NOW)
    assert s.deadline == NOW + 30 and not s.complete


def test_reaching_max_completes_at_once_the_writer_first_then_by_node_id():
    s = ops.apply(Action.ADD_TO_PARTICIPANTS, mk(["n2", "n0"], deadline=NOW + 5), ctx(), NOW)
    assert s.complete and s.deadline is None
    assert s.participants == {ME: 0, "n0": 1, "n2": 2}  # the completing writer hosts the workers' store


def test_last_call_expiry_completes():
    s = ops.apply(Action.MARK_COMPLETE, mk([ME, "n0"], deadline=NOW - 1), ctx(), NOW)
    assert s.complete and s.deadline is None and s.participants == {ME: 0, "n0": 1}


@pytest.mark.parametrize(
    "desc, hints, writer, ranks",
    [
        ("first round: the writer, then node id", {"b": -1, "c": -1, "a": -1}, "c", {"c": 0, "a": 1, "b": 2}),
        ("no writer (as torch): node id", {"b": -1, "c": -1, "a": -1}, None, {"a": 0, "b": 1, "c": 2}),
        ("a kept rank 0 wins over the writer", {"a": -1, "b": 0, "c": -1}, "c", {"b": 0, "a": 1, "c": 2}),
        ("the writer keeps its own previous rank", {"a": -1, "b": -1, "c": 2}, "c", {"c": 2, "a": 0, "b": 1}),
        ("rank 0 left: the writer takes it", {"a": 1, "b": -1, "c": -1}, "c", {"a": 1, "c": 0, "b": 2}),
        ("a writer outside the round changes nothing", {"a": -1, "b": -1}, "z", {"a": 0, "b": 1}),
    ],
)
def test_mark_complete_ranks(desc, hints, writer, ranks):
    s = mk(hints)
    ops._mark_complete(s, writer)
    assert s.complete and s.participants == ranks, desc


def test_previous_ranks_are_kept_when_free():
    # n1 keeps its rank 2; n0's old rank 5 is out of range; the rest fill 0, 1 by node id
    state = mk({"n0": 5, "n2": -1})
    s = ops.apply(Action.ADD_TO_PARTICIPANTS, state, ctx(previous_rank=2), NOW)
    assert s.participants == {ME: 2, "n0": 0, "n2": 1}


def test_join_after_complete_lands_on_wait_list_and_counts_as_waiting():
    s = ops.apply(Action.ADD_TO_WAIT_LIST, mk({"n0": 0}, complete=True), ctx(), NOW)
    assert s.wait_list == {ME} and ME not in s.participants and ME in s.node_infos
    assert liveness.num_live_waiting(s, SETTINGS, NOW) == 1
    assert liveness.num_live_waiting(s, SETTINGS, NOW + 16) == 0  # dead waiters do not count


def test_more_than_max_goes_to_redundancy_list():
    s = ops.apply(Action.ADD_TO_REDUNDANCY_LIST, mk({"n0": 0, "n2": 1, "n3": 2}, complete=True), ctx(), NOW)
    assert s.redundancy_list == {ME} and s.wait_list == set()


def test_dead_nodes_are_pruned_everywhere():
    state = mk({ME: 0, "n0": 1}, complete=True, wait=["n4"], redundant=["n5"],
               hb={"n0": NOW - 16, "n4": NOW - 16, "n5": NOW - 16})
    s = ops.apply(Action.REMOVE_DEAD_NODES, state, ctx(), NOW)
    assert s.participants == {ME: 0} and s.wait_list == set() and s.redundancy_list == set()
    assert set(s.last_heartbeats) == {ME} and set(s.node_infos) == {ME}
    assert s.complete and s.round == 0


def test_last_participant_leaving_opens_next_round():
    s = ops.apply(Action.REMOVE_FROM_PARTICIPANTS, mk({ME: 0}, complete=True, wait=["n0"]), ctx(), NOW)
    assert s.round == 1 and not s.complete and s.participants == {} and s.wait_list == {"n0"}


def test_dropping_below_min_cancels_last_call():
    s = ops.apply(Action.REMOVE_FROM_PARTICIPANTS, mk([ME, "n0"], deadline=NOW + 5), ctx(), NOW)
    assert s.deadline is None and s.participants == {"n0": -1}


def test_close_and_keep_alive():
    assert ops.apply(Action.MARK_CLOSED, mk(), ctx(), NOW).closed
    # a heartbeat is a write of the node's own key (the executor's), never of the state
    assert Action.KEEP_ALIVE not in ops.WRITE_ACTIONS
    with pytest.raises(ValueError, match="KEEP_ALIVE"):
        ops.apply(Action.KEEP_ALIVE, mk([ME], hb={ME: NOW - 6}), ctx(), NOW)


def test_apply_does_not_mutate_its_input():
    state = mk(["n0"])
    before = state.to_bytes()
    ops.apply(Action.ADD_TO_PARTICIPANTS, state, ctx(), NOW)
    assert state.to_bytes() == before


@pytest.mark.parametrize("action", [Action.SYNC, Action.FINISH, Action.ERROR_TIMEOUT])
def test_apply_refuses_non_write_actions(action):
    with pytest.raises(ValueError, match=action.value):
        ops.apply(action, mk(), ctx(), NOW)


# -- adaptive last call (settle_timeout) ---------------------------------------------------

#: (name, settings, state before ME joins, expected deadline, expected last_call_deadline)
SETTLE_JOIN_CASES = [
    ("below min: no last call", ADAPTIVE, mk(), None, None),
    ("reaching min opens the settle window", ADAPTIVE, mk(["n0"]), NOW + 1, NOW + 30),
    ("a later join moves the window", ADAPTIVE, mk(["n0", "n2"], deadline=NOW + 0.2, hard=NOW + 25), NOW + 1, NOW + 25),
    ("the window never passes the hard deadline", ADAPTIVE, mk(["n0", "n2"], deadline=NOW + 0.2, hard=NOW + 0.5),
     NOW + 0.5, NOW + 0.5),
    ("state without a hard deadline (older writer)", ADAPTIVE, mk(["n0", "n2"], deadline=NOW + 0.2), NOW + 0.2, None),
    ("fixed last call: reaching min", SETTINGS, mk(["n0"]), NOW + 30, NOW + 30),
    ("fixed last call: a later join changes nothing",
     RendezvousSettings("job", 1, 3, last_call_timeout=30, settle_timeout=None), mk(["n0"], deadline=NOW + 7, hard=NOW + 7),
     NOW + 7, NOW + 7),
    ("settle longer than the last call", RendezvousSettings("job", 1, 3, last_call_timeout=2, settle_timeout=5), mk(),
     NOW + 2, NOW + 2),
]


@pytest.mark.parametrize("name,settings,state,deadline,hard", SETTLE_JOIN_CASES, ids=[c[0] for c in SETTLE_JOIN_CASES])
def test_join_sets_the_last_call(name, settings, state, deadline, hard):
    s = ops.apply(Action.ADD_TO_PARTICIPANTS, state, ctx(settings=settings), NOW)
    assert not s.complete
    assert (s.deadline, s.last_call_deadline) == (deadline, hard)


def test_settle_window_completes_only_after_quiet_period():
    """min 2 of 4: n0 joins, ME joins at +0 (window to +1), n2 at +0.8 (window to +1.8)."""
    settings = ADAPTIVE
    s = ops.apply(Action.ADD_TO_PARTICIPANTS, mk(["n0"]), ctx(settings=settings), NOW)
    other = OpContext("n2", NodeInfo("n2", "default", 1), settings, NOW + 600)
    s = ops.apply(Action.ADD_TO_PARTICIPANTS, s, other, NOW + 0.8)
    assert s.deadline == NOW + 1.8 and s.last_call_deadline == NOW + 30
    assert ops.decide_join(s, ctx(settings=settings), NOW + 1.5) is Action.SYNC  # old window passed, new one not
    assert ops.decide_join(s, ctx(settings=settings), NOW + 1.9) is Action.MARK_COMPLETE
    done = ops.apply(Action.MARK_COMPLETE, s, ctx(settings=settings), NOW + 1.9)
    assert done.complete and done.deadline is None and done.last_call_deadline is None


def test_dropping_below_min_cancels_both_deadlines():
    s = ops.apply(Action.REMOVE_FROM_PARTICIPANTS, mk([ME, "n0"], deadline=NOW + 1, hard=NOW + 30),
                  ctx(settings=ADAPTIVE), NOW)
    assert s.deadline is None and s.last_call_deadline is None


def test_reaching_max_completes_at_once_despite_settle_window():
    s = ops.apply(Action.ADD_TO_PARTICIPANTS, mk(["n0", "n2", "n3"], deadline=NOW + 1, hard=NOW + 30),
                  ctx(settings=ADAPTIVE), NOW)
    assert s.complete and s.deadline is None and s.last_call_deadline is None



S = RendezvousSettings("job", 1, 4, keep_alive_interval=5, keep_alive_max_attempt=3)  # dead after 15 s
ROUND = frozenset({"a", "b", "c"})


@pytest.mark.parametrize(
    "desc, state, expected",
    [
        ("all beating", RendezvousState(round=2, complete=True, participants={"a": 0, "b": 1, "c": 2},
                                        last_heartbeats={"a": 100.0, "b": 99.0, "c": 95.0}), 0),
        ("c lags by more than dead_after", RendezvousState(round=2, complete=True, participants={"a": 0, "b": 1, "c": 2},
                                                           last_heartbeats={"a": 100.0, "b": 99.0, "c": 80.0}), 1),
        ("after an outage all are old, none lags", RendezvousState(round=2, complete=True,
                                                                   participants={"a": 0, "b": 1, "c": 2},
                                                                   last_heartbeats={"a": 10.0, "b": 9.0, "c": 8.0}), 0),
        ("b left to rejoin", RendezvousState(round=2, complete=True, participants={"a": 0, "c": 2},
                                             last_heartbeats={"a": 100.0, "c": 99.0}), 1),
        ("round superseded", RendezvousState(round=3, participants={"b": -1},
                                             last_heartbeats={"a": 100.0, "b": 100.0}), 1),
        ("a stale read of the previous round", RendezvousState(round=1, complete=True,
                                                               participants={"a": 0, "x": 1},
                                                               last_heartbeats={"a": 100.0}), 0),
        ("closed: the job is ending", RendezvousState(round=2, complete=True, closed=True, participants={"a": 0},
                                                      last_heartbeats={"a": 100.0}), 0),
    ],
)
def test_lost_members(desc, state, expected):
    assert liveness.lost_members(state, 2, ROUND, "a", S) == expected, desc


@pytest.mark.parametrize("members, me, expected", [
    ({"a"}, "a", ()),  # alone: nobody to judge
    ({"a", "b"}, "a", ("b",)),  # 2 nodes: the other, once
    ({"a", "b"}, "b", ("a",)),  # ... wrapping
    ({"a", "b", "c"}, "c", ("a", "b")),  # 3 nodes: both others
    ({"a", "b", "c", "d", "e"}, "b", ("c", "d")),  # the next two in sorted order
    ({"a", "b", "c", "d", "e"}, "d", ("e", "a")),  # wrapping around the end
    ({"a", "b", "c", "d", "e"}, "x", ()),  # not a member
    ({f"n{i:04d}" for i in range(1024)}, "n1023", ("n0000", "n0001")),
])
def test_ring_neighbours(members, me, expected):
    assert liveness.ring_neighbours(frozenset(members), me) == expected


def test_every_member_is_watched_by_two_others():
    members = frozenset(f"10.0.0.{i}_1_0" for i in range(7))
    watchers = {n: [m for m in members if n in liveness.ring_neighbours(members, m)] for n in members}
    assert all(len(w) == 2 and n not in w for n, w in watchers.items())


@pytest.mark.parametrize(
    "desc, beats, participants, watched, expected",
    [
        # a's monitor read only b's and c's keys: d's and e's stored heartbeats are as old as the round
        ("unwatched members' stale stored beats are not a loss", dict(a=100, b=99.5, c=99.8, d=10, e=10),
         "abcde", ("b", "c"), 0),
        ("a watched member that lags (by more than 15 s) is lost", dict(a=100, b=80, c=99.8, d=10, e=10), "abcde", ("b", "c"), 1),
        ("a watched member whose beat was not read at all is lost", dict(a=100, c=99.8), "abcde", ("b", "c"), 1),
        ("an unwatched member that left the participants is still lost", dict(a=100, b=99.5, c=99.8),
         "abce", ("b", "c"), 1),
        ("watched None judges everyone (the old rule)", dict(a=100, b=99.5, c=99.8, d=10, e=10), "abcde", None, 2),
    ],
)
def test_lost_members_judges_only_the_watched_beats(desc, beats, participants, watched, expected):
    state = RendezvousState(round=2, complete=True, participants={n: i for i, n in enumerate(participants)},
                            last_heartbeats={n: float(t) for n, t in beats.items()})
    assert liveness.lost_members(state, 2, frozenset("abcde"), "a", S, watched) == expected, desc


@pytest.mark.parametrize(
    "desc, state, expected",
    [
        ("nobody waits", RendezvousState(round=2, complete=True, participants={"a": 0, "b": 1, "c": 2},
                                         last_heartbeats={"a": 100.0, "b": 100.0, "c": 100.0}), 0),
        ("a newcomer waits", RendezvousState(round=2, complete=True, participants={"a": 0, "b": 1, "c": 2},
                                             wait_list={"d"}, last_heartbeats=dict.fromkeys("abcd", 100.0)), 1),
        ("a member left to rejoin after its failure: not new",
         RendezvousState(round=2, complete=True, participants={"a": 0, "c": 2}, wait_list={"b"},
                         last_heartbeats=dict.fromkeys("abc", 100.0)), 0),
        ("member and newcomer wait", RendezvousState(round=2, complete=True, participants={"a": 0},
                                                     wait_list={"b", "d"},
                                                     last_heartbeats=dict.fromkeys("abd", 100.0)), 1),
        ("a dead newcomer does not count", RendezvousState(round=2, complete=True, participants={"a": 0, "b": 1},
                                                           wait_list={"d"},
                                                           last_heartbeats={"a": 100.0, "b": 100.0, "d": 10.0}), 0),
        ("a newer round formed with a newcomer", RendezvousState(round=3, participants={"b": -1, "d": -1},
                                                                 last_heartbeats=dict.fromkeys("bd", 100.0)), 1),
        ("a stale read of the previous round", RendezvousState(round=1, complete=True, participants={"x": 0},
                                                               wait_list={"y"},
                                                               last_heartbeats=dict.fromkeys("xy", 100.0)), 0),
        ("closed", RendezvousState(round=2, complete=True, closed=True, participants={"a": 0}, wait_list={"d"},
                                   last_heartbeats=dict.fromkeys("ad", 100.0)), 0),
    ],
)
def test_new_nodes(desc, state, expected):
    assert liveness.new_nodes(state, 2, ROUND, S, now=101.0) == expected, desc


# -- liveness probe: a waiting node asks a running round's participants to heart-beat -----

PROBING = RendezvousSettings("job", 1, 4, keep_alive_interval=5, keep_alive_max_attempt=3, probe_delay=1,
                             probe_timeout=3)
RUNNING = {"n0": 0, "n2": 1}

PROBE_CASES = [
    ("waiting less than probe_delay", mk(RUNNING, complete=True, wait=[ME]), ctx(settings=PROBING), Action.SYNC),
    ("waited probe_delay: probe", mk(RUNNING, complete=True, wait=[ME]), ctx(settings=PROBING, started=NOW - 1),
     Action.PROBE),
]


def _probed(probe_at, **kw):
    s = mk(RUNNING, complete=True, wait=[ME], **kw)
    s.probe_at = probe_at
    return s


PROBE_STATE_CASES = [
    ("fresh probe: wait", _probed(NOW - 1, hb={ME: NOW - 1, "n0": NOW - 2}), ctx(settings=PROBING, started=NOW - 5),
     Action.SYNC),
    ("probe unanswered past probe_timeout: prune", _probed(NOW - 3.5, hb={ME: NOW - 3.5, "n0": NOW - 4}),
     ctx(settings=PROBING, started=NOW - 5), Action.REMOVE_DEAD_NODES),
    ("probe answered: alive", _probed(NOW - 3.5, hb={ME: NOW - 3.5, "n0": NOW - 3, "n2": NOW - 3}),
     ctx(settings=PROBING, started=NOW - 5), Action.SYNC),
    ("expired probe answered: probe again", _probed(NOW - 4.5, hb={ME: NOW - 4.5, "n0": NOW - 4, "n2": NOW - 4}),
     ctx(settings=PROBING, started=NOW - 9), Action.PROBE),
    ("probed participant joining answers", _probed(NOW - 0.5, hb={ME: NOW - 1}), ctx(settings=PROBING),
     Action.KEEP_ALIVE),
]


@pytest.mark.parametrize("name,state,context,expected", PROBE_CASES + PROBE_STATE_CASES,
                         ids=[c[0] for c in PROBE_CASES + PROBE_STATE_CASES])
def test_decide_join_probes(name, state, context, expected):
    assert ops.decide_join(state, context, NOW) is expected


def test_keep_alive_answers_a_probe_at_once():
    s = mk({ME: 0, "n0": 1}, complete=True)
    s.probe_at = NOW - 0.1
    s.last_heartbeats[ME] = NOW - 1  # fresh by the interval rule, older than the probe
    assert liveness.should_answer_probe(s, ME)
    after = merge.fold_heartbeats(s, {ME: NOW})  # the beat, in our key, as the next read sees it
    assert not liveness.should_answer_probe(after, ME)


def test_probe_write_and_reset_with_the_round():
    state = mk(RUNNING, complete=True, wait=[ME], hb={ME: NOW - 2, "n0": NOW - 1, "n2": NOW - 1})
    s = ops.apply(Action.PROBE, state, ctx(settings=PROBING), NOW)
    assert s.probe_at == NOW and s.last_heartbeats[ME] == NOW
    assert liveness.dead_nodes(s, PROBING, NOW + 3) == []  # within probe_timeout nobody is dead yet
    assert liveness.dead_nodes(s, PROBING, NOW + 3.1) == ["n0", "n2"]
    s = ops.apply(Action.REMOVE_DEAD_NODES, s, ctx(settings=PROBING), NOW + 3.1)
    assert s.participants == {} and s.round == 1 and not s.complete and s.probe_at is None


# -- batched joins: intents combined into one write; heartbeats folded in ----------------

BATCH = RendezvousSettings("job", 1, 3, keep_alive_interval=5, keep_alive_max_attempt=3)  # dead after 15 s


def intent(node, at=NOW - 1, round=0, prev=-1, until=float("inf")):
    return JoinIntent(node, NodeInfo(node, "default", 1), prev, round, at, until)


@pytest.mark.parametrize(
    "desc, state, intents, added",
    [
        ("fresh intents join, in log order", mk(), [intent("a"), intent("b")], ["a", "b"]),
        ("room for max_nodes only: the round completes", mk(), [intent("a"), intent("b"), intent("c")],
         ["a", "b"]),
        ("a stale intent does not bring a node back", mk(), [intent("a", at=NOW - 20), intent("b")], ["b"]),
        ("an intent from the future beyond dead_after is refused", mk(), [intent("a", at=NOW + 60)], []),
        ("an intent of another round is ignored", mk(), [intent("a", round=1)], []),
        ("a participant is not added twice", mk(["a"]), [intent("a"), intent("b")], ["b"]),
        ("a redundant node stays redundant", mk(redundant=["r"]), [intent("r")], []),
        ("a waiting node that posted joins", mk(wait=["w"]), [intent("w")], ["w"]),
        # join_timeout < dead_after: a fresh intent whose poster gave up is no phantom
        ("a poster past its join deadline is not added", mk(), [intent("a", until=NOW - 0.5), intent("b")], ["b"]),
        ("... nor one within DEADLINE_MARGIN of it", mk(), [intent("a", until=NOW + merge.DEADLINE_MARGIN / 2)],
         []),
        ("a poster with time left joins", mk(), [intent("a", until=NOW + 2 * merge.DEADLINE_MARGIN)], ["a"]),
    ],
)
def test_combine_joins(desc, state, intents, added):
    c = OpContext(ME, NodeInfo(ME, "default", 2), BATCH, NOW + 600, -1, NOW)
    s = merge.combine_joins(state, c, intents, NOW)
    assert sorted(n for n in s.participants if n != ME and n not in state.participants) == sorted(added), desc
    assert ME in s.participants
    assert s.complete == (len(s.participants) == BATCH.max_nodes), desc
    assert not (s.wait_list & set(s.participants)), desc
    assert ME not in state.participants  # pure


def test_combined_node_heartbeat_is_its_newest_post_and_its_previous_rank_is_kept():
    s = merge.combine_pending(mk(["x"]), [intent("a", at=NOW - 9, prev=1), intent("a", at=NOW - 2, prev=1)], BATCH, NOW)
    assert s.last_heartbeats["a"] == NOW - 2 and s.participants["a"] == 1
    assert s.node_infos["a"][0] == "a"
    assert merge.combine_pending(s, [intent("a")], BATCH, NOW) is None  # nothing pending: no write


def test_the_combiner_whose_write_completes_the_round_gets_rank_0():
    # BATCH: max 3 nodes; x (the combiner, a participant) adds the last two posters
    s = merge.combine_pending(mk(["x"]), [intent("a"), intent("b")], BATCH, NOW, writer="x")
    assert s.complete and s.participants == {"x": 0, "a": 1, "b": 2}
    joined = merge.combine_joins(mk(["a", "b"]), ctx(), [], NOW)  # ME adds itself: the world is full
    assert joined.complete and joined.participants == {ME: 0, "a": 1, "b": 2}


ROUND_OF_THREE = {"a": 0, "b": 1, "c": 2}  # a complete round of three


@pytest.mark.parametrize(
    "desc, state, intents, expected",
    [
        ("a forming round is not left this way", mk(ROUND_OF_THREE), [intent("a", round=1)], None),
        ("a closed round is not left", mk(ROUND_OF_THREE, complete=True, closed=True), [intent("a", round=1)], None),
        ("nobody posted for the next round", mk(ROUND_OF_THREE, complete=True), [intent("a", round=0)], None),
        ("a node outside the round is not a leaver", mk(ROUND_OF_THREE, complete=True), [intent("z", round=1)], None),
        ("leavers wait while others run", mk(ROUND_OF_THREE, complete=True),
         [intent("a", round=1, at=NOW - 4), intent("b", round=1)], (0, {"c"}, {"a", "b"})),
        ("an old post still leaves (a complete round takes no one back)", mk(ROUND_OF_THREE, complete=True),
         [intent("a", round=1, at=NOW - 600)], (0, {"b", "c"}, {"a"})),
        ("the last ones out open the next round", mk(ROUND_OF_THREE, complete=True, wait=["w"]),
         [intent(n, round=1) for n in "abc"], (1, set(), {"w"})),
    ],
)
def test_combine_exits(desc, state, intents, expected):
    s = merge.combine_exits(state, intents, BATCH)
    if expected is None:
        assert s is None, desc
        return
    round, participants, waiting = expected
    assert (s.round, set(s.participants), s.wait_list) == (round, participants, waiting), desc
    assert s.complete == bool(participants), desc
    for i in intents:  # a waiting leaver's heartbeat is its post; its info is kept
        if i.node_id in s.wait_list:
            assert s.last_heartbeats[i.node_id] == i.at and s.node_infos[i.node_id][0] == i.node_id, desc
        else:
            assert i.node_id not in s.last_heartbeats and i.node_id not in s.node_infos, desc
    assert set(state.participants) == set(ROUND_OF_THREE)  # pure


@pytest.mark.parametrize(
    "desc, beats, expected",
    [
        ("newer beats are taken", {"a": NOW + 3}, {"a": NOW + 3, "b": NOW}),
        ("older ones are not", {"a": NOW - 3}, {"a": NOW, "b": NOW}),
        ("unknown nodes are not added", {"z": NOW + 3}, {"a": NOW, "b": NOW}),
    ],
)
def test_fold_heartbeats(desc, beats, expected):
    state = mk(["a", "b"])
    folded = merge.fold_heartbeats(state, beats)
    assert folded.last_heartbeats == expected, desc
    assert state.last_heartbeats == {"a": NOW, "b": NOW}  # pure


def test_intent_log_round_trip_skips_malformed_lines():
    good = [intent("a"), intent("b", prev=2, round=3), intent("c", until=NOW + 5)]
    log = good[0].to_bytes() + b"not json\n" + b'{"node": "x"}\n' + good[1].to_bytes() + b"\n" + good[2].to_bytes()
    assert JoinIntent.parse_log(log) == good
    assert JoinIntent.parse_log(b"".join(i.to_bytes() for i in good)) == good
    assert JoinIntent.parse_log(None) == [] and JoinIntent.parse_log(b"") == []


def test_a_running_member_is_dead_after_lost_after_a_joiner_after_torchs_rule():
    s = RendezvousSettings("job", 1, 3, lost_after=3.0)  # dead_after stays 5 x 3 = 15 s
    running = RendezvousState(round=2, complete=True, participants={"a": 0, "b": 1},
                              last_heartbeats={"a": 100.0, "b": 96.5, "w": 90.0}, wait_list={"w"})
    # b, a member of the complete round, went 3.5 s without a beat; w waits and is judged by 15 s
    assert liveness.dead_nodes(running, s, 100.0) == ["b"]
    assert liveness.lost_members(running, 2, frozenset({"a", "b"}), "a", s) == 1
    frozen_2s = RendezvousState(round=2, complete=True, participants={"a": 0, "b": 1},
                                last_heartbeats={"a": 100.0, "b": 97.625})  # a 2 s freeze + one 0.375 s interval
    assert liveness.dead_nodes(frozen_2s, s, 100.0) == [] and liveness.lost_members(frozen_2s, 2, frozenset({"a", "b"}), "a", s) == 0
    forming = RendezvousState(round=2, complete=False, participants={"a": -1, "b": -1},
                              last_heartbeats={"a": 100.0, "b": 90.0})
    assert liveness.dead_nodes(forming, s, 100.0) == []  # a joining participant: torch's 15 s


def test_a_member_of_a_round_that_ran_is_dead_after_lost_after_once_the_next_round_forms():
    """A survivor that found its neighbour lost starts round 3; a third member's failure probe judges round 2."""
    s = RendezvousSettings("job", 1, 4, lost_after=3.0)
    reforming = RendezvousState(round=3, complete=False, participants={"a": -1},
                                last_heartbeats={"a": 100.0, "c": 99.9, "f": 96.5})
    assert liveness.dead_nodes(reforming, s, 100.0) == []  # f is judged as a joiner: torch's 15 s
    assert liveness.dead_nodes(reforming, s, 100.0, members={"c", "f"}) == ["f"]  # it ran round 2 with c
    assert liveness.dead_nodes(reforming, s, 100.0, members={"c", "f"}, exclude="f") == []


class _CountingKeys:
    """Wraps an ``InMemoryBackend`` and records which heartbeat keys each read asked for."""

    def __init__(self, backend) -> None:
        self.backend, self.asked = backend, []

    def __getattr__(self, name):
        return getattr(self.backend, name)

    def get_state_and_heartbeats(self, nodes):
        self.asked.append(("with the state", sorted(nodes)))
        return self.backend.get_state_and_heartbeats(nodes)

    def get_heartbeats(self, nodes):
        self.asked.append(("alone", sorted(nodes)))
        return self.backend.get_heartbeats(nodes)


@pytest.mark.parametrize(
    "desc, wait_list, stored, second_read",
    [
        ("a round running undisturbed: the state and 3 keys, nothing more", set(), {}, None),
        ("a newcomer waits (stored beat stale): its key too", {"x"}, {"x": 50.0}, ["x"]),
        ("a newcomer that just wrote the state: its stored beat is fresh", {"x"}, {"x": 99.0}, None),
        ("a member rejoining long ago: its key too", {"e"}, {"e": 50.0}, ["e"]),
    ],
)
def test_the_monitor_reads_its_neighbours_keys_and_only_the_waiting_nodes_besides(desc, wait_list, stored,
                                                                                  second_read):
    from elaunch.rendezvous.dynamic.reading import read_watched
    from tests.unit.fakes import InMemoryBackend

    members = frozenset("abcdefgh")
    beats = dict.fromkeys(members, 40.0) | stored  # stored in the state when the round formed
    keys = InMemoryBackend()
    keys.put(RendezvousState(round=2, complete=True, participants={n: i for i, n in enumerate(sorted(members))},
                             wait_list=wait_list, last_heartbeats=beats).to_bytes())
    for n in sorted(members | wait_list):
        keys.put_heartbeat(n, 99.5)
    backend = _CountingKeys(keys)
    watched = ("a", *liveness.ring_neighbours(members, "a"))
    state, _token = read_watched(backend, watched, members, fresh_after=100.0 - 3.0)
    assert backend.asked[0] == ("with the state", ["a", "b", "c"]), desc
    assert backend.asked[1:] == ([] if second_read is None else [("alone", second_read)]), desc
    assert {n: state.last_heartbeats[n] for n in "abc"} == dict.fromkeys("abc", 99.5)
    assert state.last_heartbeats["d"] == 40.0  # not read: as stored, and never judged
    assert liveness.lost_members(state, 2, members, "a", S, watched[1:]) == 0
    assert liveness.num_live_waiting(state, S, 100.0) == len(wait_list), desc
