"""The job-wide facts of a dynamic rendezvous, as methods of its handler (see ``job.py``).

A mixin of :class:`~elaunch.rendezvous.dynamic.handler.DynamicRendezvousHandler`,
kept apart so the handler's module holds the rounds and this one the job: the
restart count, the failure verdict and its acknowledgements, and stack-dump
requests. It uses the handler's ``_executor``, ``_settings``, ``_node_id``,
``_members``, ``_watched``, ``_stalls``, ``_current``, ``_lock``, ``_cached``, ``_clock``, ``_sleep``, ``_backend``,
``_read()``, ``_start_heartbeats()``, ``_stop_heartbeats()`` and ``_declared_end`` (all set by the
handler's ``__init__``).
Stdlib only.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from typing import Callable

from elaunch.rendezvous.api import (
    FailureRecord,
    JobState,
    RendezvousError,
    RendezvousGracefulExitError,
    RendezvousJobFailedError,
)
from elaunch.rendezvous.dynamic import job, ops
from elaunch.rendezvous.dynamic.state import RendezvousState

log = logging.getLogger("elaunch.rendezvous.dynamic.handler")

#: Seconds a member that answered nothing must stay out of its round (not waiting, not in the
#: next one) before it counts as lost rather than on its way to the next round.
LEFT_FOR_GOOD = 0.5


class JobFacts:
    """The ``RendezvousHandler`` job methods over the shared state (the dynamic backends)."""

    def job_state(self) -> JobState:
        """Return the job's shared facts from the monitor's read (at most ``poll_interval`` s old).

        Raises:
            RendezvousConnectionError: the backend is unreachable.
            RendezvousStateError: the stored state is corrupt.
        """
        state = self._read()
        return job.job_state(state, self._node_id, self._live_others(state), self._settings)

    def _raise_job_end(self, exc: RendezvousError) -> None:
        """Closed while this node joined: raise the job's verdict if there is one (else return)."""
        state, run_id = self._executor.state, self._settings.run_id
        if state.job_failed and state.failure is not None:
            root = job.job_state(state, self._node_id, 0, self._settings).failure
            raise RendezvousJobFailedError(
                f"rendezvous {run_id!r} is closed: the job failed on {root.host} (rank {root.rank})", root) from exc
        if state.job_succeeded:
            self.leave(rejoin=True)  # the node that declared it waits until we are out of the state
            raise RendezvousGracefulExitError(
                f"rendezvous {run_id!r} is closed: the job succeeded while this node waited to join") from exc

    def _live_others(self, state: RendezvousState) -> int:
        """Members of this node's round, besides itself, that ``state`` does not show as lost."""
        if self._current is None:
            return 0
        lost = ops.lost_members(state, self._current.round, self._members, self._node_id, self._settings,
                                self._watched[1:], self._stalls.ended)
        return max(0, len(self._members) - 1 - lost)

    def _update_job(self, transform) -> RendezvousState:
        with self._lock:
            state = self._executor.update(transform, self._settings.close_timeout, "close_timeout")
        self._cached = None
        return state

    def record_failure(self, failure: FailureRecord) -> JobState:
        """Report ``failure`` and count its round once for the job, unless a lost node caused it.

        Reports the failure (``job.note_failure``), asks every agent to heart-beat
        at once, and waits until each other member of the round has answered
        (``job.answers``; about ``probe_timeout / 4`` s for a live agent, however busy its
        main thread). When all have, the round is counted (``job.count_round``).
        When one left or does not answer within ``probe_timeout`` seconds, its loss
        is what broke the workers' collectives (``kill -9`` of its agent closes their
        sockets before any heartbeat lapses): nothing is counted and the returned
        state names it in ``lost``.

        Raises:
            RendezvousTimeoutError: not written within ``close_timeout`` seconds.
            RendezvousConnectionError: the backend is unreachable.
        """
        mine = dataclasses.replace(failure, node=self._node_id)
        others = self._members - {self._node_id}
        since = self._clock()
        state = self._update_job(lambda s: job.note_failure(s, mine, probe_at=since if others else None))
        alive, lost = self._answers(failure.round, others, since) if others and not state.job_failed else ((), ())
        if lost:
            return dataclasses.replace(job.job_state(state, self._node_id, len(alive), self._settings), lost=lost)
        state = self._update_job(lambda s: job.count_round(s, failure.round))
        # the others answered, but may have left the round by now to re-form: they still count as live
        return job.job_state(state, self._node_id, len(alive), self._settings)

    def _answers(self, round: int, others: frozenset[str], since: float) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """Wait until each of ``others`` answered after ``round``'s failure at ``since``; return (alive, lost), sorted."""
        seen: set[str] = set()
        lost: set[str] = set()
        out_since: dict[str, float] = {}  # a node that left the round: when it was first seen out

        def pending(state: RendezvousState) -> list[str]:
            if state.job_failed:
                return []
            # ``others`` ran ``round`` (complete): a silent one is dead after lost_after, also when
            # the state already moved on to an incomplete next round
            dead = set(ops.dead_nodes(state, self._settings, self._clock(), members=others))
            alive, gone = job.answers(state, round, others, since, dead)
            seen.update(alive)
            now = time.monotonic()
            for n in gone - seen:
                # a node re-forming passes through "out of the round" for a write or two before
                # the wait list shows it: only one that stays out (or is dead) is lost
                if n in dead or now - out_since.setdefault(n, now) >= LEFT_FOR_GOOD:
                    lost.add(n)
            return [] if lost else sorted(others - seen)

        left = self._await_others(pending, self._settings.probe_timeout + 0.5, "answers to the failure probe")
        return tuple(sorted(seen)), tuple(sorted(lost | set(left)))

    def fail_job(self, failure: FailureRecord) -> FailureRecord:
        """Declare the job failed and close the rendezvous; return the job's root cause.

        Raises:
            RendezvousTimeoutError: not written within ``close_timeout`` seconds.
            RendezvousConnectionError: the backend is unreachable.
        """
        mine = dataclasses.replace(failure, node=self._node_id)
        state = self._update_job(lambda s: job.fail_job(s, mine))
        self._declared_end = True
        log.warning("node %s: job failed (root cause: rank %d on %s); rendezvous %r closed",
                    self._node_id, mine.rank, mine.host, self._settings.run_id)
        root = job.job_state(state, self._node_id, 0, self._settings).failure
        return root if root is not None else mine

    def succeed_job(self) -> None:
        """Declare the job succeeded and close the rendezvous (a verdict already there is kept).

        Waiting, spare and sitting-out nodes see it and exit 0; :meth:`shutdown` then
        waits (``close_timeout`` s at most) until each live one has left the state.

        Raises:
            RendezvousTimeoutError: not written within ``close_timeout`` seconds.
            RendezvousConnectionError: the backend is unreachable.
        """
        self._update_job(job.succeed_job)
        self._declared_end = True
        log.info("node %s: job succeeded; rendezvous %r closed", self._node_id, self._settings.run_id)

    def sit_out(self) -> None:
        """Leave the round and sit out (bad-node exclusion), still watching the job and heart-beating.

        The others re-form without this node (as after :meth:`leave`); the node
        that ends the job waits for this one to see the end. :meth:`leave` ends
        the sitting out (before rejoining, or once the job ended).

        Raises:
            RendezvousTimeoutError: not written within ``close_timeout`` seconds.
            RendezvousConnectionError: the backend is unreachable.
        """
        self._stop_heartbeats()
        me, backend = self._node_id, self._backend
        if backend.supports_heartbeat_keys:
            backend.put_heartbeat(me, self._clock())  # the key exists before we appear in the state
        self._update_job(lambda s: job.sit_out(s, me, self._clock(), self._settings))
        self._start_heartbeats()
        log.info("node %s sits out of rendezvous %r, watching the job", me, self._settings.run_id)

    def acknowledge_failure(self) -> None:
        """Tell the node that declared the job failed that this one stopped (best effort, logged)."""
        me = self._node_id
        try:
            self._update_job(lambda s: job.acknowledge_failure(s, me))
        except RendezvousError as exc:
            log.debug("node %s could not acknowledge the job's failure: %s", me, exc)

    def _await_acknowledgements(self) -> None:
        """After declaring the job's end: wait (``close_timeout`` s at most) until every live node saw it.

        This node may host the store the others read; leaving before they read the
        verdict would leave them with a lost store instead of the root cause (or of
        the job's success, for the nodes outside its last round: ``job.unacknowledged``).
        """
        def pending(state: RendezvousState) -> list[str]:
            dead = set(ops.dead_nodes(state, self._settings, self._clock()))
            return job.unacknowledged(state, self._members, self._node_id, dead)

        left = self._await_others(pending, self._settings.close_timeout, "acknowledgements")
        if left:
            log.warning("node(s) %s did not acknowledge the job's end within close_timeout=%g s",
                        ", ".join(left), self._settings.close_timeout)

    def publish_node_record(self, kind: str, doc: dict) -> None:
        """Write ``doc`` (JSON) to this node's ``kind`` key beside the state; best effort (logged at DEBUG)."""
        backend = self._backend
        if not backend.supports_node_keys:
            return
        try:
            backend.put_node_key(kind, self._node_id, json.dumps(doc, separators=(",", ":")).encode())
        except (RendezvousError, TypeError, ValueError) as exc:
            log.debug("node %s could not publish its %s record: %s", self._node_id, kind, exc)

    def request_stack_dump(self, by: FailureRecord) -> int:
        """Ask every agent to dump its workers' stacks (``by``: the hung worker); return the request's id.

        Raises:
            RendezvousTimeoutError: not written within ``close_timeout`` seconds.
            RendezvousConnectionError: the backend is unreachable.
        """
        mine = dataclasses.replace(by, node=self._node_id)
        return self._update_job(lambda s: job.request_dump(s, mine)).dump_id

    def acknowledge_dump(self, dump_id: int) -> None:
        """Tell the asking node that this node's stacks for request ``dump_id`` are written (best effort)."""
        me = self._node_id
        try:
            self._update_job(lambda s: job.acknowledge_dump(s, me, dump_id))
        except RendezvousError as exc:
            log.debug("node %s could not acknowledge stack dump %d: %s", me, dump_id, exc)

    def await_dump_acknowledgements(self, dump_id: int, timeout: float) -> list[str]:
        """Wait up to ``timeout`` seconds until the live members of this round answered ``dump_id``.

        Returns:
            The node ids that did not answer in time (lost and dead members are not waited for).
        """
        asked = dump_id

        def pending(state: RendezvousState) -> list[str]:
            nonlocal asked
            if state.dump_id > asked:
                # another node found the hang too and asked again: our stacks are written, so we
                # answer its request and wait for the others' answers to it instead
                asked = state.dump_id
                self.acknowledge_dump(asked)
            gone = set(ops.dead_nodes(state, self._settings, self._clock())) | (self._members - set(state.participants))
            return job.dumps_pending(state, asked, self._members - {self._node_id} - gone)

        return self._await_others(pending, timeout, "stack dumps")

    def _await_others(self, pending: Callable[[RendezvousState], list[str]], timeout: float,
                      what: str) -> list[str]:
        """Read the state until ``pending(state)`` is empty or ``timeout`` seconds passed; return what is left.

        A backend error ends the wait (logged at DEBUG): the caller is on its way out.
        """
        deadline = time.monotonic() + timeout
        left: list[str] = []
        while True:
            try:
                state = self._executor.read()
            except RendezvousError as exc:
                log.debug("waiting for %s: %s", what, exc)
                return left
            left = pending(state)
            if not left or time.monotonic() >= deadline:
                return left
            self._sleep(min(0.05, self._settings.poll_interval))
