"""Applies the decisions of ``ops.py`` to a backend with compare-and-set and retry.

Mirrors torch's ``_DistributedRendezvousOpExecutor`` + ``_BackendRendezvousStateHolder``:
read the state, decide, write the implied state if the token still matches,
decide again on whatever is stored now, until the op finishes or fails.
Stdlib only; the clock and sleep are injectable for tests.
"""

from __future__ import annotations

import logging
import random
import time
from typing import Callable

from elaunch.rendezvous.api import (
    NodeInfo,
    RendezvousClosedError,
    RendezvousGracefulExitError,
    RendezvousTimeoutError,
)
from elaunch.rendezvous.dynamic import merge, ops
from elaunch.rendezvous.dynamic.backend import RendezvousBackend, Token
from elaunch.rendezvous.dynamic.ops import Action, OpContext
from elaunch.rendezvous.dynamic.settings import RendezvousSettings
from elaunch.rendezvous.dynamic.batching import BatchedJoin
from elaunch.rendezvous.dynamic.reading import read_state
from elaunch.rendezvous.dynamic.state import RendezvousState

log = logging.getLogger(__name__)

Decide = Callable[[RendezvousState, OpContext, float], Action]


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
        self._leaving: BatchedJoin | None = None  # a batched exit's post, taken over by the next join

    @property
    def state(self) -> RendezvousState:
        """The state as last read or written by this node (may be stale)."""
        return self._state

    def read(self) -> RendezvousState:
        """Read the state from the backend and cache it.

        Raises:
            RendezvousConnectionError: the backend cannot be reached.
            RendezvousStateError: the stored state is corrupt.
        """
        self._state, self._token = read_state(self._backend, self._state,
                                              self._clock() - self._settings.keep_alive_interval)
        return self._state

    def run(self, decide: Decide, timeout: float, timeout_name: str, previous_rank: int = -1,
            fresh: bool = True) -> RendezvousState:
        """Loop read -> ``decide`` -> compare-and-set until ``decide`` returns FINISH.

        Joins are batched when the backend keeps an intent log: before adding
        itself the node posts an intent, and each write adds every fresh intent
        read with the state (``merge.combine_joins``). A participant waiting for its
        round to complete blocks in ``backend.wait_for_round`` (woken by the write
        that completes or closes the round) rather than polling, where the backend
        can. Together these make a join cost a bounded number of round trips,
        however many nodes join at once. Leaving a complete round (a restart) is
        batched the same way: the exit posts this node's intent for the next round
        and returns; the join that follows waits for that round's combiner to
        remove it (``merge.combine_exits``), or leaves on its own after the grace.

        Args:
            decide: one of the ``ops.decide_*`` functions.
            timeout: seconds the operation may take (renewed when a redundant node
                gets room in the world, as torch does).
            timeout_name: the ``--rdzv-conf`` key of ``timeout``, for error messages.
            previous_rank: this node's rank in its previous round, or -1.
            fresh: read the state first (False: decide on the state this executor
                last read or wrote; a stale one costs a failed write, not a wrong step).

        Returns:
            The state after the operation finished.

        Raises:
            RendezvousClosedError: the rendezvous is closed (ERROR_CLOSED).
            RendezvousGracefulExitError: closed while this node was redundant.
            RendezvousTimeoutError: ``timeout`` seconds passed; the message names
                ``timeout_name``, its value and the round's progress.
            RendezvousConnectionError, RendezvousStateError: from the backend.
        """
        settings = self._settings
        started = self._clock()
        deadline = started + timeout
        need_read = fresh
        batch = None
        if decide is ops.decide_join and self._backend.supports_intents:
            batch = self._leaving or BatchedJoin(self._backend, self._node_id, self._node_info, previous_rank,
                                                 settings, self._clock)
            need_read |= self._leaving is not None  # the log holds who left with us
        self._leaving = None
        me = self._node_id
        if decide is ops.decide_join and self._backend.supports_heartbeat_keys:
            # our heartbeat key exists before we first appear in the state (readers rely on it)
            self._backend.put_heartbeat(me, self._clock())
        while True:
            if need_read:
                if batch is not None and ((batch.active(self._state) and not batch.notified
                                           and batch.may_add_self(self._clock()))
                                          or (batch.combiner and _leaving(batch, self._state))):
                    self._state, self._token = batch.read(self._state)  # with the log: we may combine
                else:
                    self.read()
            now = self._clock()
            ctx = OpContext(me, self._node_info, settings, deadline, previous_rank, started)
            state = self._state
            if (decide is ops.decide_exit and self._backend.supports_intents and state.complete
                    and not state.closed and me in state.participants and now <= deadline):
                # batched exit: post our join of the next round; its combiner removes us from this one
                self._leaving = BatchedJoin(self._backend, me, self._node_info, previous_rank, settings, self._clock)
                self._leaving.post(state.round + 1, now)
                log.debug("node %s: posted its exit from round %d%s", me, state.round,
                          " (the combiner)" if self._leaving.combiner else "")
                return state
            leaving = batch is not None and _leaving(batch, state)
            if leaving and batch.combiner:
                combined = merge.combine_exits(state, batch.intents, settings)
                if combined is not None:
                    need_read = not self._write(Action.REMOVE_FROM_PARTICIPANTS, state, combined)
                    continue
            elif leaving and me in state.participants:
                if not batch.may_add_self(now):  # the combiner removes us: wait for it, or for its round
                    batch.wait(state, max(0.01, min(batch.posted_at + batch.grace, deadline) - now))
                    need_read = True
                    continue
                action = ops.decide_exit(state, ctx, now)  # it did not within grace: leave on our own
                if action is Action.ERROR_TIMEOUT:
                    raise RendezvousTimeoutError(
                        f"rendezvous {settings.run_id!r} round {state.round}: could not leave it within "
                        f"{timeout_name}={timeout:g} s")
                need_read = not self._write(action, state, ops.apply(action, state, ctx, now))
                continue
            elif leaving:
                batch.round = None  # moved to the wait list by the combiner: post again when the round opens
            action = decide(state, ctx, now)
            if action is Action.FINISH:
                return state
            if action is Action.ERROR_CLOSED:
                raise RendezvousClosedError(f"rendezvous {settings.run_id!r} is closed")
            if action is Action.ERROR_GRACEFUL_EXIT:
                raise RendezvousGracefulExitError(
                    f"rendezvous {settings.run_id!r} closed while this node was redundant "
                    f"(world already at max_nodes={settings.max_nodes})"
                )
            if action is Action.ERROR_TIMEOUT:
                raise RendezvousTimeoutError(
                    f"rendezvous {settings.run_id!r} round {state.round}: not done within "
                    f"{timeout_name}={timeout:g} s ({len(state.participants)} node(s) joined, "
                    f"--nnodes={settings.min_nodes}:{settings.max_nodes})"
                )
            # batched join (batching.py) while the round forms
            forming = batch is not None and not state.complete and not state.closed
            batched = forming and batch.active(state)
            if forming and not batched and action in (Action.ADD_TO_PARTICIPANTS, Action.REMOVE_DEAD_NODES):
                # post first: the log's heartbeats must be seen before judging anyone dead
                batch.post(state.round, now)
                if not batch.combiner:
                    # the combiner adds us; nothing to read until the round's notice (or its grace ends)
                    batch.wait(state, max(0.01, min(batch.posted_at + batch.grace, deadline) - now))
                need_read = True
                continue
            if action is Action.SYNC:
                combined = None
                if batched and batch.combiner and me in state.participants:
                    combined = merge.combine_pending(state, batch.intents, settings, now)
                if combined is None:
                    self._wait(ctx, now, batch if batched else None, batch if leaving else None)
                    need_read = True
                    continue
                new_state = combined
            elif action is Action.ADD_TO_PARTICIPANTS and batched:
                if not batch.may_add_self(now):
                    batch.wait(state, max(0.01, min(batch.posted_at + batch.grace, deadline) - now))
                    need_read = True
                    continue
                new_state = merge.combine_joins(state, ctx, batch.intents, now)
            elif action is Action.KEEP_ALIVE and self._backend.supports_heartbeat_keys:
                self._backend.put_heartbeat(me, now)  # no contended write
                self._state = merge.fold_heartbeats(state, {me: now})
                need_read = False
                continue
            else:
                new_state = ops.apply(action, state, ctx, now)
            written = self._write(action, state, new_state)
            need_read = written is None
            if written is False and batched and batch.active(self._state) and not self._state.complete:
                need_read = True  # re-read the log too, to add everyone who posted since
            elif written and action is Action.REMOVE_FROM_REDUNDANCY_LIST:
                deadline = self._clock() + timeout  # REDUNDANT -> JOINING: fresh join deadline

    def update(self, transform: Callable[[RendezvousState], RendezvousState | None], timeout: float,
               timeout_name: str) -> RendezvousState:
        """Read -> ``transform`` -> compare-and-set until written, or ``transform`` returns None.

        For the job-wide facts (``job.py``): one write, retried on a lost race
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
            if self._write(Action.UPDATE_JOB, state, new_state):
                return self._state
            if self._clock() > deadline:
                raise RendezvousTimeoutError(
                    f"rendezvous {self._settings.run_id!r}: could not update the job state within "
                    f"{timeout_name}={timeout:g} s")

    def _write(self, action: Action, state: RendezvousState, new_state: RendezvousState) -> bool | None:
        """Compare-and-set ``new_state`` (decided on ``state`` by ``action``); keep what is stored now.

        Returns True (written), False (someone else wrote first; we backed off) or
        None (nothing came back: read again). Announces a round that this write
        completed or closed.
        """
        settings, me = self._settings, self._node_id
        result = self._backend.set_state(new_state.to_bytes(), self._token)
        if result is None:
            return None
        data, self._token, written = result
        # the stored state's heartbeats can be old where they live in keys: keep what we read
        self._state = merge.fold_heartbeats(RendezvousState.from_bytes(data), new_state.last_heartbeats)
        if written and ((new_state.complete and not state.complete) or (new_state.closed and not state.closed)):
            self._backend.notify_round(new_state.round)
            if new_state.closed and not state.closed:
                # nodes already on their way to the next round wait on its notices: wake them too
                self._backend.notify_round(new_state.round + 1)
        what = "COMBINE_JOINS" if action is Action.SYNC else action.value  # the combiner adding others
        log.debug("node %s: %s %s (round %d)", me, what, "written" if written else "lost the race", self._state.round)
        if not written:
            # someone else wrote first: re-decide; a heartbeat is not urgent, so it backs off
            # further (spreading a crowd of heartbeats instead of retrying them in lockstep)
            lull = settings.keep_alive_interval / 20 if action is Action.KEEP_ALIVE else 0.01
            self._sleep(random.uniform(0.0, lull))
        return written

    def _wait(self, ctx: OpContext, now: float, batch: BatchedJoin | None,
              leaving: BatchedJoin | None = None) -> None:
        """Wait before reading again (SYNC): until a notice, a change, or the next timed step.

        A participant of a forming round joined through ``batch`` blocks in
        ``batch.wait`` (the round's notice, or the combiner's next joiner), at most
        until its last call ends, its next heartbeat is due or its join deadline
        passes. Anything else polls: ``backend.wait_for_change`` (etcd: a watch)
        when the backend has it, else a sleep of ``poll_interval`` seconds.
        """
        s, settings = self._state, self._settings
        if leaving is not None and leaving.combiner:
            # combiner of a batched exit: woken at once by the next node that leaves, to remove
            # it, and otherwise every poll_interval like any waiting node (probes, dead members)
            due = min(ctx.deadline, s.last_heartbeats.get(ctx.node_id, now) + settings.keep_alive_interval)
            self._backend.wait_for_arrival(leaving.round, leaving.position,
                                           min(max(0.01, due - now + 0.005), settings.poll_interval))
            return
        if batch is not None and ctx.node_id in s.participants:
            due = [ctx.deadline, s.last_heartbeats.get(ctx.node_id, now) + settings.keep_alive_interval]
            if s.deadline is not None:
                due.append(s.deadline)
            batch.wait(s, min(max(0.01, min(due) - now + 0.005), settings.keep_alive_interval))
            return
        wait_for_change = getattr(self._backend, "wait_for_change", None)
        if wait_for_change is not None:  # optional hook (etcd: a watch), bounded by poll_interval
            wait_for_change(self._token, settings.poll_interval)
        else:
            self._sleep(settings.poll_interval)


def _leaving(batch: BatchedJoin, state: RendezvousState) -> bool:
    """True when ``batch`` posted a batched exit from ``state``'s round, which still runs."""
    return batch.round == state.round + 1 and state.complete and not state.closed
