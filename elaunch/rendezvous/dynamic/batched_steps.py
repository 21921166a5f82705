"""The steps of batched joins and exits (``batching.Step``), run by the executor's loop.

Each step does what one ``batching.decide_*`` decision asks, through the
:class:`~elaunch.rendezvous.dynamic.batching.BatchedJoin` of the call (post an
intent, wait for the combiner or the round's notice) or a write of the
executor (:meth:`OpExecutor.commit` / :meth:`OpExecutor.write`, compare-and-set
of a state ``merge.py`` combined); like every step it returns True when the next
decision needs a fresh read. Kept apart from ``executor.py``, whose loop and
plain steps serve every backend. Stdlib only.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Callable, NoReturn

from elaunch.rendezvous.contract import RendezvousTimeoutError
from elaunch.rendezvous.dynamic import merge, ops
from elaunch.rendezvous.dynamic.batching import Step
from elaunch.rendezvous.dynamic.ops import Action, OpContext
from elaunch.rendezvous.dynamic.settings import RendezvousSettings

if TYPE_CHECKING:
    from elaunch.rendezvous.dynamic.executor import Call, OpExecutor

log = logging.getLogger("elaunch.rendezvous.dynamic.executor")


class BatchedSteps:
    """The batched steps of one executor.

    Args:
        executor: the executor whose state, token and writes the steps use.
        node_id: this node's id in the state.
        settings: the rendezvous settings (``keep_alive_interval``, ``poll_interval``, in seconds).
    """

    def __init__(self, executor: OpExecutor, node_id: str, settings: RendezvousSettings) -> None:
        self._x = executor
        self._node_id = node_id
        self._settings = settings

    def table(self) -> dict[Step, Callable[[Call, OpContext, float], bool]]:
        """Return each batched step's method, for the executor's step table."""
        return {
            Step.POST_JOIN: self.post_join,
            Step.AWAIT_COMBINER: self.await_combiner,
            Step.AWAIT_ROUND: self.await_round,
            Step.COMBINE_JOINS: self.combine_joins,
            Step.COMBINE_PENDING: self.combine_pending,
            Step.POST_EXIT: self.post_exit,
            Step.COMBINE_EXITS: self.combine_exits,
            Step.AWAIT_LEAVERS: self.await_leavers,
            Step.LEAVE_ALONE: self.leave_alone,
            Step.LEAVE_TIMEOUT: self.leave_timed_out,
            Step.FORGET_EXIT: self.forget_exit,
        }

    # -- a batched join --------------------------------------------------------------------

    def post_join(self, call: Call, ctx: OpContext, now: float) -> bool:
        """Post our join intent; a non-combiner then waits for the combiner to add it (or for the grace)."""
        assert call.batch is not None
        call.batch.post(self._x.state.round, now, call.deadline, self._x.token)
        if not call.batch.combiner:
            # the combiner adds us; nothing to read until the round's notice (or its grace ends)
            return call.batch.wait(self._x.state, call.batch.grace_left(now, call.deadline))
        return True

    def await_combiner(self, call: Call, ctx: OpContext, now: float) -> bool:
        """Posted (a join or an exit): the combiner adds or removes us; wait for it, at most until the grace ends."""
        assert call.batch is not None
        return call.batch.wait(self._x.state, call.batch.grace_left(now, call.deadline))

    def await_round(self, call: Call, ctx: OpContext, now: float) -> bool:
        """SYNC of a participant of a forming round: block for its notice (the combiner: the next post).

        At most until the last call ends, this node's next heartbeat is due or
        its join deadline passes, and never longer than ``keep_alive_interval``.
        """
        assert call.batch is not None
        s, settings = self._x.state, self._settings
        due = [call.deadline, s.last_heartbeats.get(self._node_id, now) + settings.keep_alive_interval]
        if s.deadline is not None:
            due.append(s.deadline)
        return call.batch.wait(s, min(max(0.01, min(due) - now + 0.005), settings.keep_alive_interval))

    def combine_joins(self, call: Call, ctx: OpContext, now: float) -> bool:
        """ADD_TO_PARTICIPANTS, batched: add ourselves and every pending intent in one write."""
        assert call.batch is not None
        state = self._x.state
        return self._x.commit(call, Step.COMBINE_JOINS, state, merge.combine_joins(state, ctx, call.batch.intents, now))

    def combine_pending(self, call: Call, ctx: OpContext, now: float) -> bool:
        """SYNC of the combiner: add every node that posted since in one write, or wait for the next post."""
        assert call.batch is not None
        combined = merge.combine_pending(self._x.state, call.batch.intents, self._settings, now, self._node_id)
        if combined is None:
            return self.await_round(call, ctx, now)
        return self._x.commit(call, Step.COMBINE_PENDING, self._x.state, combined)

    # -- a batched exit --------------------------------------------------------------------

    def post_exit(self, call: Call, ctx: OpContext, now: float) -> bool:
        """Leave a complete round by posting our join of the next one; its combiner removes us from this one."""
        assert call.batch is not None
        state = self._x.state
        call.batch.post(state.round + 1, now, call.deadline, self._x.token)  # the exit's deadline: the join's is later
        log.debug("node %s: posted its exit from round %d%s", self._node_id, state.round,
                  " (the combiner)" if call.batch.combiner else "")
        return False

    def combine_exits(self, call: Call, ctx: OpContext, now: float) -> bool:
        """The next round's combiner removes every participant that posted its exit, in one write."""
        assert call.batch is not None
        state = self._x.state
        combined = merge.combine_exits(state, call.batch.intents, self._settings)
        assert combined is not None  # decided on merge.leavers
        return not self._x.write(Step.COMBINE_EXITS, state, combined)  # lost the race: read again, with the log

    def await_leavers(self, call: Call, ctx: OpContext, now: float) -> bool:
        """SYNC of the exit combiner: woken by the next node that leaves, to remove it.

        Otherwise every ``poll_interval`` seconds like any waiting node (probes,
        dead members), and by the time this node's next heartbeat is due.
        """
        assert call.batch is not None
        s, settings = self._x.state, self._settings
        due = min(call.deadline, s.last_heartbeats.get(self._node_id, now) + settings.keep_alive_interval)
        call.batch.wait_for_post(min(max(0.01, due - now + 0.005), settings.poll_interval))
        return True

    def leave_alone(self, call: Call, ctx: OpContext, now: float) -> bool:
        """The combiner did not remove us within the grace: leave with our own write (REMOVE_FROM_PARTICIPANTS)."""
        state, remove = self._x.state, Action.REMOVE_FROM_PARTICIPANTS
        return not self._x.write(remove, state, ops.apply(remove, state, ctx, now))  # lost the race: read again

    def leave_timed_out(self, call: Call, ctx: OpContext, now: float) -> NoReturn:
        raise RendezvousTimeoutError(
            f"rendezvous {self._settings.run_id!r} round {self._x.state.round}: could not leave it within "
            f"{call.timeout_name}={call.timeout:g} s")

    def forget_exit(self, call: Call, ctx: OpContext, now: float) -> bool:
        """The combiner moved us to the wait list: our exit post is spent; join the next round anew."""
        assert call.batch is not None
        call.batch.forget()
        return False
