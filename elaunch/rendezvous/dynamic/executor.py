"""Applies the decisions of ``ops.py`` (and ``batching.py``) to a backend with compare-and-set and retry.

Mirrors torch's ``_DistributedRendezvousOpExecutor``: a flat loop reads the
state, decides, and calls one method per action, until the operation finishes
or fails; a write is a compare-and-set, and a lost race decides again on
whatever is stored now. Where the backend keeps an intent log, joins and exits
are batched (``batching.py`` decides): chosen once, when the executor is made.
Every step, plain or batched, is a method here that does what one decision asks:
a plain step writes the state ``ops.apply`` implies, beats, polls or raises; a
batched one posts an intent, waits for the combiner or the round's notice
(through the call's :class:`~elaunch.rendezvous.dynamic.batching.BatchedJoin`),
or writes a state ``merge.py`` combined. Reading lives in ``reading.py``. Stdlib
only; the clock and sleep are injectable for tests.
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass
from functools import partial
from typing import Callable, NoReturn, Union

from elaunch.rendezvous.contract import (
    NodeInfo,
    RendezvousClosedError,
    RendezvousGracefulExitError,
    RendezvousTimeoutError,
)
from elaunch.rendezvous.dynamic import batching, merge, ops
from elaunch.rendezvous.dynamic.backend import RendezvousBackend, Token
from elaunch.rendezvous.dynamic.batching import BatchedJoin, Step
from elaunch.rendezvous.dynamic.ops import Action, OpContext
from elaunch.rendezvous.dynamic.wait_report import WaitReporter
from elaunch.rendezvous.dynamic.reading import read_state, read_state_only
from elaunch.rendezvous.dynamic.settings import RendezvousSettings
from elaunch.rendezvous.dynamic.state import RendezvousState

log = logging.getLogger(__name__)

Decide = Callable[[RendezvousState, OpContext, float], Union[Action, Step]]


@dataclass
class Call:
    """One call of an operation: how it decides, until when, and its batched post (None: plain writes)."""

    decide: Decide
    timeout: float
    timeout_name: str
    previous_rank: int
    started: float
    deadline: float  # renewed when a redundant node gets room (REDUNDANT -> JOINING)
    batch: BatchedJoin | None = None
    progress: WaitReporter | None = None  # says what a join waits for


#: A step: does what one action asks; returns True when the next decision needs a fresh read.
_Step = Callable[[Call, OpContext, float], bool]


class OpExecutor:
    """Runs rendezvous operations for one node against one backend.

    Not thread-safe: the handler serialises calls with its own lock.

    Args:
        backend: where the state lives.
        node_id: this node's id in the state.
        node_info: this node's NodeInfo, recorded when it joins.
        settings: the rendezvous settings (poll interval, timeouts in seconds).
        clock: seconds since the epoch (default ``time.time``).
        sleep: sleeps a number of seconds (default ``time.sleep``).
    """

    def __init__(
        self,
        backend: RendezvousBackend,
        node_id: str,
        node_info: NodeInfo,
        settings: RendezvousSettings,
        clock: Callable[[], float] = time.time,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self._backend = backend
        self._node_id = node_id
        self._node_info = node_info
        self._settings = settings
        self._clock = clock
        self._sleep = sleep
        self._state = RendezvousState()
        self._token: Token | None = None
        self._reporter = WaitReporter(settings, node_id)
        # chosen once: joins and exits batch where the backend keeps an intent log
        self._batched = backend.supports_intents
        steps: dict[Action | Step, _Step] = {action: partial(self._apply, action) for action in ops.WRITE_ACTIONS}
        steps.update({
            Action.KEEP_ALIVE: self._beat_key,
            Action.SYNC: self._poll,
            Action.ERROR_CLOSED: self._closed,
            Action.ERROR_GRACEFUL_EXIT: self._graceful_exit,
            Action.ERROR_TIMEOUT: self._timed_out,
            Step.POST_JOIN: self._post_join,
            Step.AWAIT_COMBINER: self._await_combiner,
            Step.AWAIT_ROUND: self._await_round,
            Step.COMBINE_JOINS: self._combine_joins,
            Step.COMBINE_PENDING: self._combine_pending,
            Step.POST_EXIT: self._post_exit,
            Step.COMBINE_EXITS: self._combine_exits,
            Step.AWAIT_LEAVERS: self._await_leavers,
            Step.LEAVE_ALONE: self._leave_alone,
            Step.LEAVE_TIMEOUT: self._leave_timed_out,
            Step.FORGET_EXIT: self._forget_exit,
        })
        self._steps = steps

    @property
    def state(self) -> RendezvousState:
        """The state as last read or written by this node (may be stale)."""
        return self._state

    @property
    def token(self) -> Token | None:
        """The backend's token of :attr:`state` (opaque; None before the first read)."""
        return self._token

    def read(self) -> RendezvousState:
        """Read the state from the backend and cache it.

        Raises:
            RendezvousConnectionError: the backend cannot be reached.
            RendezvousStateError: the stored state is corrupt.
        """
        self._state, self._token = read_state(self._backend, self._state,
                                              self._clock() - self._settings.fresh_for)
        return self._state

    # -- operations ---------------------------------------------------------------------

    def exit(self, previous_rank: int, timeout: float, timeout_name: str) -> BatchedJoin | None:
        """Leave this node's round before joining the next (torch ``_RendezvousExitOp``).

        Batched (the backend keeps an intent log): a participant of a complete,
        open round (as this node last read it: no read first) does not write; it
        posts its join of the next round, whose
        combiner removes every node that left (``merge.combine_exits``). The post
        is returned, for :meth:`join` to take over. Otherwise the node removes
        itself with a compare-and-set, as torch does. Arguments as :meth:`join`'s
        (``previous_rank``: this node's rank in the round it leaves).

        Returns:
            The batched exit's post, or None (left with a write, or was in no round).

        Raises:
            RendezvousTimeoutError: ``timeout`` seconds passed.
            RendezvousConnectionError, RendezvousStateError: from the backend.
        """
        if not self._batched:
            self._run(self._call(ops.decide_exit, timeout, timeout_name, previous_rank), fresh=True)
            return None
        post = self._batch(previous_rank)
        # A participant of the complete, open round it last joined posts its exit without
        # reading first: at 1024 nodes, each reading the state and every heartbeat key at
        # once was most of a restart's cost. A stale cache costs at most a grace: the
        # combiner removes only participants, a close wakes the next round's waiters, and
        # their next read shows where the rendezvous is.
        s = self._state
        fresh = not (s.complete and not s.closed and self._node_id in s.participants)
        self._run(self._call(partial(batching.decide_exit, batch=post), timeout, timeout_name, previous_rank, post),
                  fresh=fresh)
        return post if post.round is not None else None

    def join(self, previous_rank: int, timeout: float, timeout_name: str, leaving: BatchedJoin | None = None,
             fresh: bool = True) -> RendezvousState:
        """Join the next round and wait until it completes (torch ``_RendezvousJoinOp``).

        Batched (the backend keeps an intent log; see ``batching.py``): the node
        posts a join intent and the round's first poster (the combiner) adds
        everyone who posted, in one write per wave; the others wait for the
        round's notice, and add themselves only if the combiner has not within
        ``keep_alive_interval`` seconds. After a batched exit (``leaving``), the
        join first waits for that post's combiner to remove this node from the
        round it left, or leaves on its own after the same grace.

        Args:
            previous_rank: this node's rank in its previous round, or -1 (kept when free).
            timeout: seconds the operation may take (renewed when a redundant node
                gets room in the world, as torch does).
            timeout_name: the ``--rdzv-conf`` key of ``timeout``, for error messages.
            leaving: what :meth:`exit` returned.
            fresh: read the state first (False: decide on the state this executor
                last read or wrote; a stale one costs a failed write, not a wrong step).

        Returns:
            The state of the completed round, this node among its participants.

        Raises:
            RendezvousClosedError: the rendezvous is closed.
            RendezvousGracefulExitError: closed while this node was redundant.
            RendezvousTimeoutError: ``timeout`` seconds passed; the message names
                ``timeout_name``, its value and the round's progress.
            RendezvousConnectionError, RendezvousStateError: from the backend.
        """
        batch = (leaving or self._batch(previous_rank)) if self._batched else None
        decide = ops.decide_join if batch is None else partial(batching.decide_join, batch=batch)
        call = self._call(decide, timeout, timeout_name, previous_rank, batch)
        call.progress = self._reporter
        # our heartbeat key exists before we first appear in the state (readers rely on it)
        self._backend.put_heartbeat(self._node_id, self._clock())
        # the exit's combiner reads the log (who left with us, who is alive) before it
        # writes; the others wait for it first, on the state they left
        return self._run(call, fresh or (leaving is not None and leaving.combiner))

    def run(self, decide: Decide, timeout: float, timeout_name: str, previous_rank: int = -1,
            fresh: bool = True) -> RendezvousState:
        """Run an operation with plain writes until ``decide`` returns FINISH.

        For ``ops.decide_close``; joins and exits go through :meth:`join` and
        :meth:`exit`, which batch where they can.
        Arguments, result and errors as :meth:`join`'s (``decide``: an ``ops.decide_*``).
        """
        return self._run(self._call(decide, timeout, timeout_name, previous_rank), fresh)

    def update(self, transform: Callable[[RendezvousState], RendezvousState | None], timeout: float,
               timeout_name: str) -> RendezvousState:
        """Read -> ``transform`` -> compare-and-set until written, or ``transform`` returns None.

        For the job-wide facts (``job_ops.py``): one write, retried on a lost race
        against whatever is stored then.

        Returns:
            The state after the write (or as read, when there was nothing to write).

        Raises:
            RendezvousTimeoutError: not written within ``timeout`` seconds.
            RendezvousConnectionError, RendezvousStateError: from the backend.
        """
        deadline = self._clock() + timeout
        while True:
            state = self.read()
            new_state = transform(state)
            if new_state is None:
                return state
            if self.write(Action.UPDATE_JOB, state, new_state):
                return self._state
            if self._clock() > deadline:
                raise RendezvousTimeoutError(
                    f"rendezvous {self._settings.run_id!r}: could not update the job state within "
                    f"{timeout_name}={timeout:g} s")

    # -- the loop -----------------------------------------------------------------------

    def _call(self, decide: Decide, timeout: float, timeout_name: str, previous_rank: int,
              batch: BatchedJoin | None = None) -> Call:
        started = self._clock()
        return Call(decide, timeout, timeout_name, previous_rank, started, started + timeout, batch)

    def _batch(self, previous_rank: int) -> BatchedJoin:
        return BatchedJoin(self._backend, self._node_id, self._node_info, previous_rank, self._settings,
                           self._clock)

    def _run(self, call: Call, fresh: bool) -> RendezvousState:
        """Read -> decide -> one step per action, until the decision is FINISH."""
        need_read, light_used = fresh, False
        if call.progress is not None:
            call.progress.start()
        try:
            while True:
                light = False
                if need_read:
                    if call.batch is not None and call.batch.wants_log(self._state, self._clock()):
                        self._state, self._token = call.batch.read(self._state)  # with the log: we may combine
                    elif call.batch is not None and call.batch.notified and not light_used:
                        # woken by the round's notice: most likely we only finish, which needs no
                        # heartbeat keys (at 1024 nodes: 1,024 keys per reader, all at once)
                        self._state, self._token = read_state_only(self._backend, self._state)
                        light = light_used = True
                    else:
                        self.read()
                    if call.batch is not None:
                        call.batch.saw(self._token, self._clock())  # a changed state: the combiner works on
                now = self._clock()
                ctx = OpContext(self._node_id, self._node_info, self._settings, call.deadline, call.previous_rank,
                                call.started)
                action = call.decide(self._state, ctx, now)
                if action is Action.FINISH:
                    return self._state
                if light and not self._state.closed:
                    # neither finishing nor closed (the only decisions that ignore heartbeats):
                    # decide again on a read with the heartbeat keys
                    need_read = True
                    continue
                if call.progress is not None:
                    call.progress.update(self._state, now, call.deadline)
                need_read = self._steps[action](call, ctx, now)
        finally:
            if call.progress is not None:
                call.progress.finish()

    # -- steps of any operation ---------------------------------------------------------

    def _apply(self, action: Action, call: Call, ctx: OpContext, now: float) -> bool:
        """A write action: the state ``ops.apply`` implies, compare-and-set."""
        state = self._state
        return self.commit(call, action, state, ops.apply(action, state, ctx, now))

    def _beat_key(self, call: Call, ctx: OpContext, now: float) -> bool:
        """KEEP_ALIVE into this node's own heartbeat key: no contended write, nothing to read."""
        self._backend.put_heartbeat(self._node_id, now)
        self._state = merge.fold_heartbeats(self._state, {self._node_id: now})
        return False

    def _poll(self, call: Call, ctx: OpContext, now: float) -> bool:
        """SYNC: wait ``poll_interval`` seconds, or less where the backend sees a change (etcd: a watch)."""
        if not self._backend.wait_for_change(self._token, self._settings.poll_interval):
            self._sleep(self._settings.poll_interval)  # no watch: poll
        return True

    def _closed(self, call: Call, ctx: OpContext, now: float) -> NoReturn:  # ERROR_* raise
        raise RendezvousClosedError(f"rendezvous {self._settings.run_id!r} is closed")

    def _graceful_exit(self, call: Call, ctx: OpContext, now: float) -> NoReturn:
        raise RendezvousGracefulExitError(
            f"rendezvous {self._settings.run_id!r} closed while this node was redundant "
            f"(world already at max_nodes={self._settings.max_nodes})")

    def _timed_out(self, call: Call, ctx: OpContext, now: float) -> NoReturn:
        s, state = self._settings, self._state
        raise RendezvousTimeoutError(
            f"rendezvous {s.run_id!r} round {state.round}: not done within "
            f"{call.timeout_name}={call.timeout:g} s ({len(state.participants)} node(s) joined, "
            f"--nnodes={s.min_nodes}:{s.max_nodes})")

    # -- steps of a batched join (batching.py) ------------------------------------------

    def _post_join(self, call: Call, ctx: OpContext, now: float) -> bool:
        """Post our join intent; a non-combiner then waits for the combiner to add it (or for the grace)."""
        assert call.batch is not None
        call.batch.post(self._state.round, now, call.deadline, self._token)
        if not call.batch.combiner:
            # the combiner adds us; nothing to read until the round's notice (or its grace ends)
            return call.batch.wait(self._state, call.batch.grace_left(now, call.deadline))
        return True

    def _await_combiner(self, call: Call, ctx: OpContext, now: float) -> bool:
        """Posted (a join or an exit): the combiner adds or removes us; wait for it, at most until the grace ends."""
        assert call.batch is not None
        return call.batch.wait(self._state, call.batch.grace_left(now, call.deadline))

    def _await_round(self, call: Call, ctx: OpContext, now: float) -> bool:
        """SYNC of a participant of a forming round: block for its notice (the combiner: the next post).

        At most until the last call ends, this node's next heartbeat is due or
        its join deadline passes, and never longer than ``keep_alive_interval``.
        """
        assert call.batch is not None
        s, settings = self._state, self._settings
        due = [call.deadline, s.last_heartbeats.get(self._node_id, now) + settings.keep_alive_interval]
        if s.deadline is not None:
            due.append(s.deadline)
        return call.batch.wait(s, min(max(0.01, min(due) - now + 0.005), settings.keep_alive_interval))

    def _combine_joins(self, call: Call, ctx: OpContext, now: float) -> bool:
        """ADD_TO_PARTICIPANTS, batched: add ourselves and every pending intent in one write."""
        assert call.batch is not None
        state = self._state
        return self.commit(call, Step.COMBINE_JOINS, state, merge.combine_joins(state, ctx, call.batch.intents, now))

    def _combine_pending(self, call: Call, ctx: OpContext, now: float) -> bool:
        """SYNC of the combiner: add every node that posted since in one write, or wait for the next post."""
        assert call.batch is not None
        combined = merge.combine_pending(self._state, call.batch.intents, self._settings, now, self._node_id)
        if combined is None:
            return self._await_round(call, ctx, now)
        return self.commit(call, Step.COMBINE_PENDING, self._state, combined)

    # -- steps of a batched exit ----------------------------------------------------------

    def _post_exit(self, call: Call, ctx: OpContext, now: float) -> bool:
        """Leave a complete round by posting our join of the next one; its combiner removes us from this one."""
        assert call.batch is not None
        state = self._state
        call.batch.post(state.round + 1, now, call.deadline, self._token)  # the exit's deadline: the join's is later
        log.debug("node %s: posted its exit from round %d%s", self._node_id, state.round,
                  " (the combiner)" if call.batch.combiner else "")
        return False

    def _combine_exits(self, call: Call, ctx: OpContext, now: float) -> bool:
        """The next round's combiner removes every participant that posted its exit, in one write."""
        assert call.batch is not None
        state = self._state
        combined = merge.combine_exits(state, call.batch.intents, self._settings)
        assert combined is not None  # decided on merge.leavers
        return not self.write(Step.COMBINE_EXITS, state, combined)  # lost the race: read again, with the log

    def _await_leavers(self, call: Call, ctx: OpContext, now: float) -> bool:
        """SYNC of the exit combiner: woken by the next node that leaves, to remove it.

        Otherwise every ``poll_interval`` seconds like any waiting node (probes,
        dead members), and by the time this node's next heartbeat is due.
        """
        assert call.batch is not None
        s, settings = self._state, self._settings
        due = min(call.deadline, s.last_heartbeats.get(self._node_id, now) + settings.keep_alive_interval)
        call.batch.wait_for_post(min(max(0.01, due - now + 0.005), settings.poll_interval))
        return True

    def _leave_alone(self, call: Call, ctx: OpContext, now: float) -> bool:
        """The combiner did not remove us within the grace: leave with our own write (REMOVE_FROM_PARTICIPANTS)."""
        state, remove = self._state, Action.REMOVE_FROM_PARTICIPANTS
        return not self.write(remove, state, ops.apply(remove, state, ctx, now))  # lost the race: read again

    def _leave_timed_out(self, call: Call, ctx: OpContext, now: float) -> NoReturn:
        raise RendezvousTimeoutError(
            f"rendezvous {self._settings.run_id!r} round {self._state.round}: could not leave it within "
            f"{call.timeout_name}={call.timeout:g} s")

    def _forget_exit(self, call: Call, ctx: OpContext, now: float) -> bool:
        """The combiner moved us to the wait list: our exit post is spent; join the next round anew."""
        assert call.batch is not None
        call.batch.forget()
        return False

    # -- writing --------------------------------------------------------------------------

    def commit(self, call: Call, what: Action | Step, state: RendezvousState, new_state: RendezvousState) -> bool:
        """Write ``new_state`` (decided on ``state``) for ``call``; True when the next decision needs a fresh read."""
        written = self.write(what, state, new_state)
        if written is None:
            return True
        if written:
            if call.batch is not None:
                call.batch.wrote(self._token)  # our own write: no sign of the combiner's progress
            if what is Action.REMOVE_FROM_REDUNDANCY_LIST:
                call.deadline = self._clock() + call.timeout  # REDUNDANT -> JOINING: fresh join deadline
            return False
        # lost the race: decide again on what is stored now; a batched joiner of a forming
        # round reads the log too, to add everyone who posted since
        return (call.batch is not None and call.batch.forming(state) and call.batch.active(self._state)
                and not self._state.complete)

    def write(self, what: Action | Step, state: RendezvousState, new_state: RendezvousState) -> bool | None:
        """Compare-and-set ``new_state`` (decided on ``state`` by ``what``); keep what is stored now.

        Returns True (written), False (someone else wrote first; we backed off) or
        None (nothing came back: read again). Announces a round that this write
        completed or closed.
        """
        me = self._node_id
        result = self._backend.set_state(new_state.to_bytes(), self._token)
        if result is None:
            return None
        data, self._token, written = result
        # the stored state's heartbeats can be old (they live in keys): keep what we read
        self._state = merge.fold_heartbeats(RendezvousState.from_bytes(data), new_state.last_heartbeats)
        if written and ((new_state.complete and not state.complete) or (new_state.closed and not state.closed)):
            self._backend.notify_round(new_state.round)
            if new_state.closed and not state.closed:
                # nodes already on their way to the next round wait on its notices: wake them too
                self._backend.notify_round(new_state.round + 1)
            elif new_state.round >= self._backend.FORGET_AFTER:
                # exactly one write completes a round: its writer forgets an old one's keys
                self._backend.forget_round(new_state.round - self._backend.FORGET_AFTER)
        log.debug("node %s: %s %s (round %d)", me, what.value, "written" if written else "lost the race",
                  self._state.round)
        if not written:
            # someone else wrote first: re-decide, after a short random lull
            self._sleep(random.uniform(0.0, 0.01))
        return written
