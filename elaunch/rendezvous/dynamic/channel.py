"""The job channel of a dynamic rendezvous: the job's facts in the shared state (see ``job_ops.py``).

:class:`DynamicJobChannel` is the ``JobChannel`` the dynamic handler hands out
(``DynamicRendezvousHandler.job_channel()``): the restart count, the failure
verdict and its acknowledgements, stack-dump requests, the running round's lost
and new members, and the per-node records beside the state. It writes through
the handler's executor (under the handler's lock) and reads through the
:class:`~elaunch.rendezvous.dynamic.round_view.RoundView` the handler shares with it.
Stdlib only.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time
from typing import Any, Callable

from elaunch.rendezvous.contract import FailureRecord, JobState, RendezvousError
from elaunch.rendezvous.dynamic import job_ops, liveness, ops
from elaunch.rendezvous.dynamic.backend import RendezvousBackend
from elaunch.rendezvous.dynamic.executor import OpExecutor
from elaunch.rendezvous.dynamic.exchange import NodeExchange
from elaunch.rendezvous.dynamic.presence import Presence
from elaunch.rendezvous.dynamic.round_view import RoundView
from elaunch.rendezvous.dynamic.settings import RendezvousSettings
from elaunch.rendezvous.dynamic.state import RendezvousState
from elaunch.rendezvous.job_channel import JobChannel

log = logging.getLogger("elaunch.rendezvous.dynamic.handler")

#: Seconds a member that answered nothing must stay out of its round (not waiting, not in the
#: next one) before it counts as lost rather than on its way to the next round.
LEFT_FOR_GOOD = 0.5

#: Seconds between two tries of the presence ports of the members that have not answered a failure's
#: probe yet (``presence.py``; each try takes at most ``presence.PROBE_TIMEOUT``).
PRESENCE_EVERY = 0.05

#: Seconds between two reads of an agent waiting for the other members (:func:`await_interval`): the
#: shortest, and the longest (a round of ``AWAIT_SCALE`` members or more).
AWAIT_FAST, AWAIT_SLOW, AWAIT_SCALE = 0.005, 0.05, 16

Tolerate = Callable[[Callable[[], Any], Any], Any]


def await_interval(members: int, poll_interval: float) -> float:
    """Seconds between two state reads of an agent that waits for the other members of its round (pure).

    In proportion to the round's size, from ``AWAIT_FAST`` (5 ms) to ``AWAIT_SLOW`` (50 ms, every agent's
    interval before; reached at ``AWAIT_SCALE`` = 16 members), never above ``poll_interval``: in a round
    under 16 members the reads a second of all its agents waiting at once (``members / interval``) stay
    within what 16 agents reading every 50 ms make, and an answer another agent wrote a few milliseconds
    later is seen then, not up to 50 ms later (at an in-process restart each node's decision waits for
    the others' answers); larger rounds read as before.
    """
    return min(poll_interval, AWAIT_SLOW, max(AWAIT_FAST, AWAIT_SLOW * members / AWAIT_SCALE))


def untolerated(read: Callable[[], Any], fallback: Any) -> Any:
    """The default ``tolerate``: ``read()``, errors raised as they come (``fallback`` unused)."""
    return read()


class DynamicJobChannel(JobChannel):
    """The job's facts over the shared state of a dynamic rendezvous (c10d, etcd).

    Args:
        view: the handler's view of this node's round and its cached read.
        executor: writes the state (compare-and-set), under ``lock``.
        lock: the handler's lock around the executor.
        settings: timeouts (seconds) and the job's rules (``exclude_after``, ...).
        backend: the node keys of :meth:`publish_node_record`; the heartbeat key of :meth:`sit_out`.
        heartbeats: ``(start, stop)`` of the handler's keep-alive (a node sitting out keeps beating).
        clock: seconds since the epoch; sleep: sleeps seconds (injectable for tests).
        tolerate: ``tolerate(read, fallback)`` runs a monitor read (state, lost, new counts); a
            backend that rides out short outages returns ``fallback`` instead of raising
            (etcd: ``outage_timeout``). Default: the read itself.
        presence: the handler's presence ports (``presence.py``): at a failure, a member whose
            port is refused is lost at once; None: the heartbeat rules alone.

    Attributes:
        declared_end: this node declared the job failed or succeeded (its handler's
            ``shutdown`` then waits for the others to see it: :meth:`await_acknowledgements`).
    """

    keeps_job_state = True

    def __init__(self, view: RoundView, executor: OpExecutor, lock: threading.RLock, settings: RendezvousSettings,
                 backend: RendezvousBackend, heartbeats: tuple[Callable[[], None], Callable[[], None]],
                 clock: Callable[[], float], sleep: Callable[[float], None], tolerate: Tolerate = untolerated,
                 presence: Presence | None = None) -> None:
        self.node_id = view.node_id
        self._presence = presence
        self._view = view
        self._executor = executor
        self._lock = lock
        self._settings = settings
        self._backend = backend
        self._start_heartbeats, self._stop_heartbeats = heartbeats
        self._clock = clock
        self._sleep = sleep
        self._tolerate = tolerate
        self._last: JobState | None = None
        self.declared_end = False

    @property
    def round_members(self) -> frozenset[str]:
        """Node ids of the last round this node joined (empty before the first); a read of local memory only."""
        return self._view.members

    def state(self) -> JobState | None:
        """Return the job's shared facts from the monitor's read (at most ``poll_interval`` s old).

        Where ``tolerate`` rides out an outage, the facts last read (None before any).

        Raises:
            RendezvousConnectionError: the backend is unreachable.
            RendezvousStateError: the stored state is corrupt.
        """
        state = self._tolerate(self._job_state, None)
        if state is not None:
            self._last = state
        return self._last

    def _job_state(self) -> JobState:
        state = self._view.read()
        return job_ops.job_state(state, self.node_id, self._live_others(state), self._settings)

    def num_nodes_lost(self) -> int:
        """Return how many nodes of this node's current round are gone (see ``liveness.lost_members``).

        A member is gone when it left or was pruned, the round was superseded, or,
        for the members this node watches (the next ``liveness.WATCHED_NEIGHBOURS`` in the
        round's sorted member list), its heartbeat lags ours by more than
        ``lost_after`` seconds (a dead agent, a cut link): the node that finds one
        re-forms, and the others see it leave. The read may be up to ``poll_interval``
        seconds old.

        Raises:
            RendezvousConnectionError: the backend is unreachable.
        """
        view = self._view
        return self._tolerate(lambda: 0 if view.info is None else view.lost(view.read()), 0)

    def num_nodes_new(self) -> int:
        """Return how many nodes that are not in this node's round joined since (see ``liveness.new_nodes``).

        Always a fresh read: the agent asks only after a worker failed.

        Raises:
            RendezvousConnectionError: the backend is unreachable.
        """
        return self._tolerate(self._new_nodes, 0)

    def _new_nodes(self) -> int:
        view = self._view
        if view.info is None:
            return 0
        view.invalidate()
        return liveness.new_nodes(view.read(), view.info.round, view.members, self._settings, self._clock())


    def _live_others(self, state: RendezvousState) -> int:
        """Members of this node's round, besides itself, that ``state`` does not show as lost."""
        if self._view.info is None:
            return 0
        return max(0, len(self._view.members) - 1 - self._view.lost(state))

    def _update_job(self, transform) -> RendezvousState:
        with self._lock:
            state = self._executor.update(transform, self._settings.close_timeout, "close_timeout")
        self._view.invalidate()
        return state

    def record_failure(self, failure: FailureRecord) -> JobState:
        """Report ``failure`` and count its round once for the job, unless a lost node caused it.

        Reports the failure (``job_ops.note_failure``), asks every agent to heart-beat
        at once, and waits until each other member of the round has answered
        (``job_ops.answers``; about ``probe_timeout / 4`` s for a live agent, however busy its
        main thread). When all have, the round is counted (``job_ops.count_round``).
        When one left or does not answer within ``probe_timeout`` seconds, its loss
        is what broke the workers' collectives (``kill -9`` of its agent closes their
        sockets before any heartbeat lapses): nothing is counted and the returned
        state names it in ``lost``. A ring neighbour whose presence port is refused
        (``presence.py``: its agent is gone, its host is up) is lost at once: it is
        removed from the state first, so no one waits for its heartbeat to lapse.

        Raises:
            RendezvousTimeoutError: not written within ``close_timeout`` seconds.
            RendezvousConnectionError: the backend is unreachable.
        """
        mine = dataclasses.replace(failure, node=self.node_id)
        others = self._view.members - {self.node_id}
        since = self._clock()
        state = self._update_job(lambda s: job_ops.note_failure(s, mine, probe_at=since if others else None))
        alive, lost = self._answers(failure.round, others, since) if others and not state.job_failed else ((), ())
        if lost:
            return dataclasses.replace(job_ops.job_state(state, self.node_id, len(alive), self._settings), lost=lost)
        state = self._update_job(lambda s: job_ops.count_round(s, failure.round))
        # the others answered, but may have left the round by now to re-form: they still count as live
        return job_ops.job_state(state, self.node_id, len(alive), self._settings)

    def _refused(self, nodes: list[str], round: int) -> set[str]:
        """Members among ``nodes`` whose presence port is refused now, removed from the state (they are gone)."""
        gone = self._presence.refused(nodes) if self._presence is not None else set()
        if not gone:
            return gone

        def remove(state: RendezvousState) -> RendezvousState | None:
            if state.round != round:
                return None  # the round moved on: its re-form judges them
            s = state.copy()
            if not ops.remove_nodes(s, gone, self._settings):
                return None
            ops.prune_node_infos(s)
            return s

        log.warning("node %s: node(s) %s of round %d refused their presence port: their agents are gone",
                    self.node_id, ", ".join(sorted(gone)), round)
        try:
            self._update_job(remove)
        except RendezvousError as exc:  # they are still lost for this node; the others find it by heartbeats
            log.warning("node %s could not remove %s from the rendezvous: %s", self.node_id,
                        ", ".join(sorted(gone)), exc)
        return gone

    def _answers(self, round: int, others: frozenset[str], since: float) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """Wait until each of ``others`` answered after ``round``'s failure at ``since``; return (alive, lost), sorted.

        Meanwhile, every ``PRESENCE_EVERY`` seconds, the presence ports of those that have not
        answered yet are tried (:meth:`_refused`): a killed agent's port closes only once its
        process has run its exit, which on a loaded host can come after its workers' sockets closed.
        """
        seen: set[str] = set()
        lost: set[str] = set()
        out_since: dict[str, float] = {}  # a node that left the round: when it was first seen out
        next_try = 0.0  # time.monotonic() of the next try of the presence ports

        def pending(state: RendezvousState) -> list[str]:
            nonlocal next_try
            if state.job_failed:
                return []
            # ``others`` ran ``round`` (complete): a silent one is dead after lost_after, also when
            # the state already moved on to an incomplete next round
            dead = set(liveness.dead_nodes(state, self._settings, self._clock(), members=others))
            alive, gone = job_ops.answers(state, round, others, since, dead)
            seen.update(alive)
            now = time.monotonic()
            for n in gone - seen:
                # a node re-forming passes through "out of the round" for a write or two before
                # the wait list shows it: only one that stays out (or is dead) is lost
                if n in dead or now - out_since.setdefault(n, now) >= LEFT_FOR_GOOD:
                    lost.add(n)
            left = [] if lost else sorted(others - seen)
            if left and now >= next_try:
                next_try = now + PRESENCE_EVERY
                lost.update(self._refused(left, round))
            return [] if lost else left

        left = self._await_others(pending, self._settings.probe_timeout + 0.5, "answers to the failure probe")
        return tuple(sorted(seen)), tuple(sorted(lost | set(left)))

    def fail_job(self, failure: FailureRecord) -> FailureRecord:
        """Declare the job failed and close the rendezvous; return the job's root cause.

        Raises:
            RendezvousTimeoutError: not written within ``close_timeout`` seconds.
            RendezvousConnectionError: the backend is unreachable.
        """
        mine = dataclasses.replace(failure, node=self.node_id)
        state = self._update_job(lambda s: job_ops.fail_job(s, mine))
        self.declared_end = True
        log.warning("node %s: job failed (root cause: rank %d on %s); rendezvous %r closed",
                    self.node_id, mine.rank, mine.host, self._settings.run_id)
        root = job_ops.job_state(state, self.node_id, 0, self._settings).failure
        return root if root is not None else mine

    def succeed_job(self) -> None:
        """Declare the job succeeded and close the rendezvous (a verdict already there is kept).

        Waiting, spare and sitting-out nodes see it and exit 0; :meth:`shutdown` then
        waits (``close_timeout`` s at most) until each live one has left the state.

        Raises:
            RendezvousTimeoutError: not written within ``close_timeout`` seconds.
            RendezvousConnectionError: the backend is unreachable.
        """
        self._update_job(job_ops.succeed_job)
        self.declared_end = True
        log.info("node %s: job succeeded; rendezvous %r closed", self.node_id, self._settings.run_id)

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
        me = self.node_id
        self._backend.put_heartbeat(me, self._clock())  # the key exists before we appear in the state
        self._update_job(lambda s: job_ops.sit_out(s, me, self._clock(), self._settings))
        self._start_heartbeats()
        log.info("node %s sits out of rendezvous %r, watching the job", me, self._settings.run_id)

    def acknowledge_failure(self) -> None:
        """Tell the node that declared the job failed that this one stopped (best effort, logged)."""
        me = self.node_id
        try:
            self._update_job(lambda s: job_ops.acknowledge_failure(s, me))
        except RendezvousError as exc:
            log.debug("node %s could not acknowledge the job's failure: %s", me, exc)

    def await_acknowledgements(self) -> None:
        """After declaring the job's end: wait (``close_timeout`` s at most) until every live node saw it.

        This node may host the store the others read; leaving before they read the
        verdict would leave them with a lost store instead of the root cause (or of
        the job's success, for the nodes outside its last round: ``job_ops.unacknowledged``).
        """
        def pending(state: RendezvousState) -> list[str]:
            dead = set(liveness.dead_nodes(state, self._settings, self._clock()))
            return job_ops.unacknowledged(state, self._view.members, self.node_id, dead)

        left = self._await_others(pending, self._settings.close_timeout, "acknowledgements")
        if left:
            log.warning("node(s) %s did not acknowledge the job's end within close_timeout=%g s",
                        ", ".join(left), self._settings.close_timeout)

    def publish_node_record(self, kind: str, doc: dict) -> None:
        """Write ``doc`` (JSON) to this node's ``kind`` key beside the state; best effort (logged at DEBUG)."""
        try:
            self._backend.put_node_key(kind, self.node_id, json.dumps(doc, separators=(",", ":")).encode())
        except (RendezvousError, TypeError, ValueError) as exc:
            log.debug("node %s could not publish its %s record: %s", self.node_id, kind, exc)

    def exchange(self, kind: str, round: int, doc: dict, timeout: float) -> dict[str, dict]:
        """Publish ``doc`` for ``round`` on this node's ``exchange-<kind>`` key; return the round's members' docs.

        See ``JobChannel.exchange`` and ``dynamic/exchange.py`` (the keys, the
        round tags, the leader's agreement). The members are those of the round
        this node joined last (:attr:`round_members`; this node alone before one).

        Raises:
            ValueError: a bad ``kind``; TypeError, ValueError: ``doc`` is not JSON-serialisable.
        """
        members = self._view.members or frozenset({self.node_id})
        return NodeExchange(self._backend, self.node_id, self._sleep).run(kind, round, doc, members, timeout)

    def request_stack_dump(self, by: FailureRecord) -> int:
        """Ask every agent to dump its workers' stacks (``by``: the hung worker); return the request's id.

        Raises:
            RendezvousTimeoutError: not written within ``close_timeout`` seconds.
            RendezvousConnectionError: the backend is unreachable.
        """
        mine = dataclasses.replace(by, node=self.node_id)
        return self._update_job(lambda s: job_ops.request_dump(s, mine)).dump_id

    def acknowledge_dump(self, dump_id: int) -> None:
        """Tell the asking node that this node's stacks for request ``dump_id`` are written (best effort)."""
        me = self.node_id
        try:
            self._update_job(lambda s: job_ops.acknowledge_dump(s, me, dump_id))
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
            dead = liveness.dead_nodes(state, self._settings, self._clock())
            gone = set(dead) | (self._view.members - set(state.participants))
            return job_ops.dumps_pending(state, asked, self._view.members - {self.node_id} - gone)

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
            self._sleep(await_interval(len(self._view.members), self._settings.poll_interval))
