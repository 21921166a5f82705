"""Batched joins: a crowd of nodes joins one round in a bounded number of store round trips.

torch's join (and ours without this) has every node compare-and-set its own
addition into the one state key. When N nodes arrive together only one write
in each wave wins; the N-1 others read again and retry, so a node makes O(N)
round trips and the round O(N^2). With a backend that keeps an intent log
(``RendezvousBackend.supports_intents``; c10d does), a joining node instead:

1. posts a join intent (``state.JoinIntent``) to the round's log;
2. if its post was the round's first it is the round's *combiner*: it writes the
   state with every pending intent added (``merge.combine_joins`` /
   ``merge.combine_pending``), then blocks until the next post, and repeats;
3. any other node blocks until the round's notice (completed or closed), and
   adds itself (with every pending intent) only if the combiner has not added
   it within ``grace`` seconds (the combiner died or stalls). A grace restarts
   whenever the node reads a state that changed since its last look: the combiner
   still works through the crowd, and a thousand nodes writing for themselves
   would only contend with it (and each other). When its grace runs out, the node
   first looks at the state's token alone, and reads the whole log only when the
   state did not change.

Participants of a forming round keep alive without a contended write, in their
heartbeat keys (``RendezvousBackend.put_heartbeat``); an intent's time also
counts as a heartbeat of its node (``merge.fold_intents``). The state machine
(``ops.decide_join``) is unchanged: batching only changes who writes the additions, and when.

Restarts use the same log: a participant leaving a complete round posts its
intent for the next round, and that round's combiner removes every poster in one
write (``merge.combine_exits``).

Deciding apart from doing, as in ``ops.py``: :func:`decide_join` and
:func:`decide_exit` are pure; they refine the state machine's action with what
this node's :class:`BatchedJoin` knows (its post, whether it is the combiner,
the log it last read) into a :class:`Step` where batching changes who writes, or
when. The executor runs one method per action and step. Stdlib only.
"""

from __future__ import annotations

import enum
import time
from typing import Callable

from elaunch.rendezvous.contract import NodeInfo
from elaunch.rendezvous.dynamic import merge, ops
from elaunch.rendezvous.dynamic.backend import RendezvousBackend, Token
from elaunch.rendezvous.dynamic.ops import Action, OpContext
from elaunch.rendezvous.dynamic.reading import read_state_and_intents
from elaunch.rendezvous.dynamic.settings import RendezvousSettings
from elaunch.rendezvous.dynamic.state import JoinIntent, RendezvousState


class Step(enum.Enum):
    """What a batched join or exit does instead of an ``ops.Action`` (the executor has a method for each)."""

    POST_JOIN = "POST_JOIN"  # post our join intent; a non-combiner then waits for the combiner
    AWAIT_COMBINER = "AWAIT_COMBINER"  # posted: the combiner adds (or removes) us; wait, at most the grace
    AWAIT_ROUND = "AWAIT_ROUND"  # SYNC of a participant of a forming round: until its notice or next step
    COMBINE_JOINS = "COMBINE_JOINS"  # ADD_TO_PARTICIPANTS for us and every pending intent, in one write
    COMBINE_PENDING = "COMBINE_PENDING"  # SYNC of the combiner: add who posted since, or wait for a post
    POST_EXIT = "POST_EXIT"  # leave a complete round by posting our join of the next one
    COMBINE_EXITS = "COMBINE_EXITS"  # the next round's combiner removes every leaver, in one write
    AWAIT_LEAVERS = "AWAIT_LEAVERS"  # SYNC of that combiner: until the next leaver posts, or a poll interval
    LEAVE_ALONE = "LEAVE_ALONE"  # the combiner did not remove us within the grace: REMOVE_FROM_PARTICIPANTS
    LEAVE_TIMEOUT = "LEAVE_TIMEOUT"  # ... and the join deadline passed: RendezvousTimeoutError
    FORGET_EXIT = "FORGET_EXIT"  # the combiner moved us to the wait list: post again when the round opens


class BatchedJoin:
    """One node's batched join of one round, or its batched exit (a join of the next round).

    Holds what the node knows of its post and does the batched I/O (post, read
    with the log, wait); the decisions are :func:`decide_join` / :func:`decide_exit`.

    Args:
        backend: a backend with ``supports_intents``.
        node_id, node_info: who joins.
        previous_rank: its rank in its previous round, or -1.
        settings: the rendezvous settings; ``keep_alive_interval`` seconds is the
            grace a non-combiner gives the combiner before adding itself.
        clock: seconds since the epoch (default ``time.time``).
    """

    def __init__(self, backend: RendezvousBackend, node_id: str, node_info: NodeInfo, previous_rank: int,
                 settings: RendezvousSettings, clock: Callable[[], float] = time.time) -> None:
        self._backend = backend
        self._clock = clock
        self._node_id = node_id
        self._info = node_info
        self._previous_rank = previous_rank
        self._settings = settings
        self.round: int | None = None  # the round we posted our join to
        self.first = False  # ours was the round's first join: we are the combiner
        self.posted_at = 0.0
        self.grace_from = 0.0  # the grace runs from here: the post, or the last sign of the combiner's progress
        self.seen: Token | None = None  # the state's token at grace_from
        self.intents: list[JoinIntent] = []
        self.position = 0  # the log's position as of the last read (backend-defined)
        self.notified = False  # the last wait ended with the round's notice

    @property
    def grace(self) -> float:
        """Seconds a non-combiner waits for the combiner's next write before acting on its own."""
        return self._settings.keep_alive_interval

    @property
    def combiner(self) -> bool:
        """True when this node posted the round's first join: it adds everyone who posts."""
        return self.first

    def active(self, state: RendezvousState) -> bool:
        """True when we posted our join to ``state``'s round."""
        return self.round is not None and self.round == state.round

    def forming(self, state: RendezvousState) -> bool:
        """True when we posted our join to ``state``'s round and it is still forming."""
        return self.active(state) and not state.complete and not state.closed

    def leaving(self, state: RendezvousState) -> bool:
        """True when we posted our exit from ``state``'s round (a join of the next), which still runs."""
        return self.round == state.round + 1 and state.complete and not state.closed

    def may_add_self(self, now: float) -> bool:
        """True for the combiner, and for anyone who saw no write to the state for ``grace`` seconds."""
        return self.combiner or now >= self.grace_from + self.grace

    def grace_left(self, now: float, deadline: float) -> float:
        """Seconds (at least 0.01) until the combiner's grace ends, or ``deadline`` if sooner."""
        return max(0.01, min(self.grace_from + self.grace, deadline) - now)

    def saw(self, token: Token | None, now: float) -> None:
        """Note a read of the state (its ``token``) at ``now``: a changed state restarts the grace.

        Someone wrote since our last look (the combiner adding or removing a batch),
        so the round still progresses: waiting costs nothing, while writing for
        ourselves would contend with that writer. A state unchanged for a whole
        grace (the combiner died or stalls) lets the grace run out.
        """
        if token != self.seen:
            self.seen, self.grace_from = token, max(self.grace_from, now)

    def wrote(self, token: Token | None) -> None:
        """Note the token of our own write: a later look that finds it is no sign of the combiner's progress."""
        self.seen = token

    def wants_log(self, known: RendezvousState, now: float) -> bool:
        """True when the next read should include the log (``known``: the state as last read).

        So it is when this node may write the round's additions (the combiner, or a
        poster whose grace ran out, not woken by the notice) or its exits (the combiner
        of a batched exit).
        """
        return ((self.active(known) and not self.notified and self.may_add_self(now))
                or (self.combiner and self.leaving(known)))

    def post(self, round: int, now: float, deadline: float = float("inf"), seen: Token | None = None) -> None:
        """Post our join intent to ``round`` (c10d: 3 store calls, etcd: 1 transaction).

        ``deadline``: when this node gives up the join (seconds since the epoch); the
        combiner does not add it after that (``merge.combine_pending``). ``seen``:
        the token of the state this node last read (the grace starts from it).
        """
        self.first = self._backend.post_intent(round, self._intent(round, now, deadline))
        self.round, self.posted_at, self.notified = round, now, False
        self.grace_from, self.seen = now, seen

    def forget(self) -> None:
        """Our post no longer stands (the combiner moved us to the wait list): post again when the round opens."""
        self.round = None

    def read(self, known: RendezvousState) -> tuple[RendezvousState, Token]:
        """Read the state with the log (1 store call); the log's heartbeats folded in.

        With per-node heartbeat keys, those of ``known``'s nodes are read and
        folded in too (``reading.read_state_and_intents``).

        Raises:
            RendezvousConnectionError, RendezvousStateError: from the backend.
        """
        assert self.round is not None
        read = read_state_and_intents(self._backend, self.round, known,
                                      self._clock() - self._settings.fresh_for)
        self.intents, self.position = read.intents, read.position
        return read.state, read.token

    def wait(self, state: RendezvousState, timeout: float) -> bool:
        """Block up to ``timeout`` seconds: the combiner for the next post, others for the notice.

        A non-combiner whose wait ends without the notice and past its grace first
        looks at the state's token alone (one small read): a new token means the
        combiner still writes, so the grace restarts and there is nothing worth
        reading yet. At 1,024 nodes the alternative was ~1,000 reads of the state with
        the whole log at the moment the graces ran out, slowing the combiner they wait for.

        Returns:
            False when that look restarted the grace (the caller decides again on the
            state it has, which says wait); True when the caller should read.

        Raises:
            RendezvousConnectionError: from the backend.
        """
        assert self.round is not None
        if self.combiner and self._node_id in state.participants:
            self.notified = False
            self._backend.wait_for_arrival(self.round, self.position, timeout)
            return True
        self.notified = self._backend.wait_for_round(self.round, timeout)
        now = self._clock()
        if self.notified or now < self.grace_from + self.grace:
            return True
        seen = self.seen
        self.saw(self._backend.get_state_token(), now)
        return self.seen == seen  # unchanged: the grace ran out, read (with the log) and act

    def wait_for_post(self, timeout: float) -> None:
        """Block up to ``timeout`` seconds until someone posts to our round (or it is announced)."""
        assert self.round is not None
        self._backend.wait_for_arrival(self.round, self.position, timeout)

    def _intent(self, round: int, now: float, deadline: float) -> bytes:
        return JoinIntent(self._node_id, self._info, self._previous_rank, round, now, deadline).to_bytes()


def decide_join(state: RendezvousState, ctx: OpContext, now: float, batch: BatchedJoin) -> Action | Step:
    """Decide the next step of a batched join (``ops.decide_join``, with who writes, and when) (pure).

    ``batch`` is this node's join; after a batched exit, the exit's post (a join of
    the next round), while the round it left still runs.
    """
    me = ctx.node_id
    if batch.leaving(state):
        if batch.combiner:
            if merge.leavers(state, batch.intents):
                return Step.COMBINE_EXITS
        elif me in state.participants:
            if not batch.may_add_self(now):
                return Step.AWAIT_COMBINER  # the combiner removes us: wait for it, or for its round
            if ops.decide_exit(state, ctx, now) is Action.ERROR_TIMEOUT:
                return Step.LEAVE_TIMEOUT
            return Step.LEAVE_ALONE  # it did not within the grace: leave on our own
        else:
            return Step.FORGET_EXIT  # moved to the wait list by the combiner
    action = ops.decide_join(state, ctx, now)
    if action is Action.FINISH or action in ops.ERROR_ACTIONS:
        return action
    if state.complete or state.closed:
        if action is Action.SYNC and batch.combiner and batch.leaving(state):
            return Step.AWAIT_LEAVERS
        return action
    if not batch.active(state):
        if action in (Action.ADD_TO_PARTICIPANTS, Action.REMOVE_DEAD_NODES):
            return Step.POST_JOIN  # post first: the log's heartbeats must be seen before judging anyone dead
        return action
    if action is Action.SYNC and me in state.participants:
        return Step.COMBINE_PENDING if batch.combiner else Step.AWAIT_ROUND
    if action is Action.ADD_TO_PARTICIPANTS:
        return Step.COMBINE_JOINS if batch.may_add_self(now) else Step.AWAIT_COMBINER
    return action


def decide_exit(state: RendezvousState, ctx: OpContext, now: float, batch: BatchedJoin) -> Action | Step:
    """Decide how to leave the current round, batched (``ops.decide_exit``) (pure).

    A participant of a complete, open round posts its join of the next round
    instead of writing (``batch`` then holds that post); that round's combiner
    removes it. Otherwise as ``ops.decide_exit``.
    """
    if batch.round is not None:
        return Action.FINISH  # posted: the next join takes the post over
    if state.complete and not state.closed and ctx.node_id in state.participants and now <= ctx.deadline:
        return Step.POST_EXIT
    return ops.decide_exit(state, ctx, now)
