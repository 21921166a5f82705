"""``DynamicRendezvousHandler``: the dynamic rendezvous over any compare-and-set backend.

Mirrors torch's ``DynamicRendezvousHandler`` (``dynamic_rendezvous.py``): nodes
join rounds through a shared state, heartbeat while a round runs, and see
late joiners through ``num_nodes_waiting()``. What a round's workers connect to
(MASTER_ADDR/MASTER_PORT and the agent-side store) is decided by a
:class:`RoundStoreFactory` the storage backend supplies. Stdlib only.
"""

from __future__ import annotations

import abc
import itertools
import logging
import os
import random
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from elaunch.rendezvous.api import (
    NodeInfo,
    RendezvousClosedError,
    RendezvousError,
    RendezvousGracefulExitError,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousStateError,
    RendezvousTimeoutError,
)
from elaunch.rendezvous.dynamic import ops
from elaunch.rendezvous.dynamic.backend import RendezvousBackend
from elaunch.rendezvous.dynamic.executor import OpExecutor
from elaunch.rendezvous.dynamic.job_facts import JobFacts
from elaunch.rendezvous.dynamic.keepalive import KeepAlive
from elaunch.rendezvous.dynamic.reading import read_watched
from elaunch.rendezvous.dynamic.settings import RendezvousSettings
from elaunch.rendezvous.dynamic.stalls import StoreStalls, slow_after
from elaunch.rendezvous.dynamic.state import RendezvousState

log = logging.getLogger(__name__)

_local_ids = itertools.count()


@dataclass(frozen=True)
class RoundStores:
    """Where one round's workers meet.

    Attributes:
        master_addr, master_port: the workers' store (MASTER_ADDR/MASTER_PORT).
        use_agent_store: True when an agent hosts it and every worker is a client.
        store: agent-side store namespaced to the round, or None.
    """

    master_addr: str
    master_port: int
    use_agent_store: bool
    store: Any = field(default=None, compare=False)


class RoundStoreFactory(abc.ABC):
    """Supplies each completed round's stores; implemented by each storage backend."""

    @abc.abstractmethod
    def setup_round(self, round: int, rank: int, world_size: int, nodes: tuple[NodeInfo, ...]) -> RoundStores:
        """Return the stores of ``round`` for the node of group rank ``rank``.

        Raises:
            RendezvousConnectionError: the stores cannot be created or reached.
        """

    def exit_barrier(self, round: int, rank: int, world_size: int, timeout: float) -> None:
        """Wait up to ``timeout`` seconds until every node of ``round`` checked in (default: no wait)."""

    def close(self) -> None:
        """Release the stores this node hosts."""


class DynamicRendezvousHandler(JobFacts, RendezvousHandler):
    """Joins rounds through a shared, compare-and-set state (torch ``DynamicRendezvousHandler``).

    Args:
        node: this node's NodeInfo (its ``addr`` also names it in logs and node ids).
        settings: sizes and timeouts (seconds).
        backend: where the shared state lives.
        store_factory: makes each round's workers' store and namespaced agent store.
        clock: seconds since the epoch (injectable for tests).
        sleep: sleeps a number of seconds (injectable for tests).
    """

    def __init__(
        self,
        node: NodeInfo,
        settings: RendezvousSettings,
        backend: RendezvousBackend,
        store_factory: RoundStoreFactory,
        clock: Callable[[], float] = time.time,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self._node = node
        self._node_id = f"{node.addr}_{os.getpid()}_{next(_local_ids)}"
        self._settings = settings
        self._backend = backend
        self._stores = store_factory
        self._clock = clock
        self._sleep = sleep
        self._executor = OpExecutor(backend, self._node_id, node, settings, clock, sleep)
        self._lock = threading.RLock()
        self._stalls = StoreStalls(clock, slow_after(settings))  # when the store last stalled for this node
        self._keep_alive = KeepAlive(self._node_id, settings, backend, clock, self._read, self._beat_through_state,
                                     self._stalls)
        self._state_written = False  # the backend's watch saw a write since the cached read
        self._stop_watch: Callable[[], None] | None = None
        self._current: RendezvousInfo | None = None
        self._members: frozenset[str] = frozenset()
        self._watched: tuple[str, ...] = ()  # this node and the members whose heartbeats it judges
        self._cached: tuple[float, RendezvousState] | None = None
        self._declared_end = False  # this node declared the job failed or succeeded (fail_job, succeed_job)

    @property
    def node_id(self) -> str:
        """This handler's id in the shared state (``addr_pid_localid``, as torch's node descriptor)."""
        return self._node_id

    @property
    def round_members(self) -> frozenset[str]:
        """Node ids of the last round this node joined (empty before the first); a read of local memory only."""
        return self._members

    @property
    def settings(self) -> RendezvousSettings:
        """The settings this handler runs with."""
        return self._settings

    def get_backend(self) -> str:
        """Return the storage backend's name (``"c10d"``, ...)."""
        return self._backend.name

    def can_reform(self) -> bool:
        """Return True: nodes may join or leave, and each membership change forms a new round."""
        return True

    def get_run_id(self) -> str:
        """Return the run id."""
        return self._settings.run_id

    def next_rendezvous(self) -> RendezvousInfo:
        """Leave the current round, join the next one and block until it completes.

        Waits at most ``join_timeout`` seconds for the round (a redundant node, one
        beyond ``max_nodes``, waits without limit until there is room or the
        rendezvous closes, as in torch).

        Raises:
            RendezvousJobFailedError: the job failed on another node (its root cause attached),
                also while this node waited or stood by as a spare.
            RendezvousGracefulExitError: the job succeeded while this node waited or stood
                by as a spare (it left the state: exit 0, as torchrun's surplus nodes do), or
                the rendezvous closed while this node was redundant.
            RendezvousClosedError: the rendezvous was closed (without a verdict).
            RendezvousTimeoutError: the round did not complete within ``join_timeout``.
            RendezvousConnectionError: the backend or a round store is unreachable.
            RendezvousStateError: the stored state is corrupt.
        """
        self._say_if_below_min()
        try:
            return self._next_rendezvous()
        except (RendezvousClosedError, RendezvousGracefulExitError) as exc:
            self._raise_job_end(exc)
            raise

    def _say_if_below_min(self) -> None:
        """One line when the last round's live nodes no longer make ``min_nodes`` (we wait for more)."""
        info, s = self._current, self._settings
        if info is None:
            return
        state = self._cached[1] if self._cached is not None else self._executor.state
        lost = ops.lost_members(state, info.round, self._members, self._node_id, s, self._watched[1:],
                                self._stalls.ended)
        alive = len(self._members) - lost
        if alive < s.min_nodes:
            log.warning("only %d of the job's nodes are left (--nnodes=%d:%d); waiting up to join_timeout=%g s "
                        "for more to join", alive, s.min_nodes, s.max_nodes, s.join_timeout)

    def _next_rendezvous(self) -> RendezvousInfo:
        started = time.monotonic()
        self._stop_heartbeats()
        s = self._settings
        previous_rank = -1 if self._current is None else self._current.rank
        if self._current is None:
            self._sleep(random.uniform(0.0, 0.05))  # tiny jitter: spread first joins
        deadline = self._clock() + s.join_timeout
        while True:
            with self._lock:
                leaving = self._executor.exit(previous_rank, s.join_timeout, "join_timeout")
                # decided on the state the exit just read or wrote: one read fewer per join
                state = self._executor.join(previous_rank, s.join_timeout, "join_timeout", leaving, fresh=False)
            # A member may leave (or be pruned) between the round's completion and our read
            # of it: its ranks then no longer cover 0..n-1, so that round is already broken.
            # COMPLETE -> JOINING: join the next one instead of starting a partial world.
            if sorted(state.participants.values()) == list(range(len(state.participants))):
                break
            if self._clock() > deadline:
                raise RendezvousTimeoutError(
                    f"rendezvous {s.run_id!r}: rounds kept losing members within join_timeout={s.join_timeout:g} s"
                )
            log.info("node %s: round %d lost a member before it started; joining the next", self._node_id, state.round)
        self._cached = None  # a read from before this round must not be judged against it
        if self._node_id not in state.participants:
            raise RendezvousStateError(f"node {self._node_id} finished joining but is not a participant")
        rank, world_size = state.participants[self._node_id], len(state.participants)
        missing = sorted(self._members - set(state.participants))
        if missing and self._current is not None:
            # name who is gone: a node killed outright shows here first (its peers' workers
            # failed on the closed sockets before its heartbeat could be missed)
            log.warning("round %d formed without %d node(s) of round %d: %s (left, stopped or lost)",
                        state.round, len(missing), self._current.round, ", ".join(missing))
        self._members = frozenset(state.participants)
        self._watched = (self._node_id, *ops.ring_neighbours(self._members, self._node_id))
        nodes = state.ranked_nodes()
        self._start_heartbeats()
        stores = self._stores.setup_round(state.round, rank, world_size, nodes)
        self._current = RendezvousInfo(
            round=state.round,
            rank=rank,
            world_size=world_size,
            master_addr=stores.master_addr,
            master_port=stores.master_port,
            use_agent_store=stores.use_agent_store,
            nodes=nodes,
            store=stores.store,
            restart_count=state.restarts,
        )
        log.info(
            "node %s joined round %d of rendezvous %r as rank %d of %d in %.2f s",
            self._node_id, state.round, s.run_id, rank, world_size, time.monotonic() - started,
        )
        return self._current

    def _read(self) -> RendezvousState:
        """Read the state without touching the executor's cache; reuse a read younger than poll_interval.

        The heartbeat keys read are this node's and its ring neighbours' (``reading.read_watched``):
        O(1) keys per read, however many nodes the round has.

        Where the backend watches the state (etcd-v3), a write seen since the cached
        read makes it stale at once: another node's failure or verdict reaches the
        monitor at its next check, not ``poll_interval`` seconds later.
        """
        now = time.monotonic()
        if self._cached is not None and not self._state_written and now - self._cached[0] < self._settings.poll_interval:
            return self._cached[1]
        self._state_written = False  # before the read: a write during it makes the next check read again
        with self._stalls.timing():  # a failed or slow read: the store stalled for this node
            state, _token = read_watched(self._backend, self._watched, self._members,
                                         self._clock() - self._settings.fresh_for)
        self._cached = (now, state)
        if self._keep_alive.running and ops.should_answer_probe(state, self._node_id):
            self._keep_alive.beat_now()  # answer at once, not at the keep-alive thread's next tick
        return state

    def num_nodes_waiting(self) -> int:
        """Return how many live nodes wait for the next round (torch: the wait list's length).

        The read may be up to ``poll_interval`` seconds old. Dead nodes (no
        heartbeat for ``keep_alive_interval * keep_alive_max_attempt`` seconds) do
        not count.

        Raises:
            RendezvousConnectionError: the backend is unreachable.
        """
        return ops.num_live_waiting(self._read(), self._settings, self._clock())

    def num_nodes_lost(self) -> int:
        """Return how many nodes of this node's current round are gone (see ``ops.lost_members``).

        A member is gone when it left or was pruned, the round was superseded, or,
        for the members this node watches (the next ``ops.WATCHED_NEIGHBOURS`` in the
        round's sorted member list), its heartbeat lags ours by more than
        ``lost_after`` seconds (a dead agent, a cut link): the node that finds one
        re-forms, and the others see it leave. The read may be up to ``poll_interval``
        seconds old.

        Raises:
            RendezvousConnectionError: the backend is unreachable.
        """
        info = self._current
        if info is None:
            return 0
        return ops.lost_members(self._read(), info.round, self._members, self._node_id, self._settings,
                                self._watched[1:], self._stalls.ended)

    def num_nodes_new(self) -> int:
        """Return how many nodes that are not in this node's round joined since (see ``ops.new_nodes``).

        Always a fresh read: the agent asks only after a worker failed.

        Raises:
            RendezvousConnectionError: the backend is unreachable.
        """
        info = self._current
        if info is None:
            return 0
        self._cached = None
        return ops.new_nodes(self._read(), info.round, self._members, self._settings, self._clock())

    def is_closed(self) -> bool:
        """Return True once any node closed the rendezvous.

        Raises:
            RendezvousConnectionError: the backend is unreachable.
        """
        self._cached = None
        return self._read().closed

    def set_closed(self) -> None:
        """Close the rendezvous for every node; later joins raise RendezvousClosedError.

        Raises:
            RendezvousTimeoutError: not done within ``close_timeout`` seconds.
            RendezvousConnectionError: the backend is unreachable.
        """
        with self._lock:
            self._executor.run(ops.decide_close, self._settings.close_timeout, "close_timeout")
        self._cached = None

    def exit_barrier(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds until every node of the current round checked in.

        Returns early (with a warning) on timeout or a store error; never raises a
        RendezvousError, mirroring torch's agent, which only logs a failed barrier.
        """
        info = self._current
        if info is None:
            return
        try:
            self._stores.exit_barrier(info.round, info.rank, info.world_size, timeout)
        except RendezvousError as exc:
            log.warning("exit barrier of round %d failed: %s", info.round, exc)

    def shutdown(self) -> bool:
        """Stop heart-beating, close the rendezvous and release hosted round stores.

        Like torch's ``DynamicRendezvousHandler.shutdown``, this closes the
        rendezvous: nodes that try to join afterwards get RendezvousClosedError.

        Returns:
            True when the rendezvous was closed, False when that failed (logged).
        """
        self._stop_heartbeats()
        try:
            if not self._executor.state.closed:  # closed already (it was read): nothing to write
                self.set_closed()
            if self._declared_end:
                self._await_acknowledgements()
            return True
        except RendezvousError as exc:
            log.warning("node %s could not close rendezvous %r: %s", self._node_id, self._settings.run_id, exc)
            return False
        finally:
            self._stores.close()

    def leave(self, rejoin: bool = False) -> None:
        """Leave the job without closing it (a signal stopped this agent, it sits out, or the job ended).

        Removes this node from the round (or the wait, redundancy and sitting-out lists) in one
        write, so the others see a lost member at once and re-form without it when
        they still meet ``min_nodes``; then, unless ``rejoin``, releases the hosted
        round stores. Errors are logged, not raised.
        """
        self._stop_heartbeats()
        me = self._node_id

        def remove_me(state):
            if not (me in state.participants or me in state.wait_list or me in state.redundancy_list
                    or me in state.sitting_out):
                return None
            now = self._clock()
            ctx = ops.OpContext(me, self._node, self._settings, now + self._settings.close_timeout)
            s = ops.apply(ops.Action.REMOVE_FROM_PARTICIPANTS, state, ctx, now)
            s.wait_list.discard(me)
            s.redundancy_list.discard(me)
            s.sitting_out.discard(me)
            s.last_heartbeats.pop(me, None)
            ops.prune_node_infos(s)
            return s

        try:
            with self._lock:
                self._executor.update(remove_me, self._settings.close_timeout, "close_timeout")
            log.info("node %s left rendezvous %r", me, self._settings.run_id)
        except RendezvousError as exc:
            log.warning("node %s could not leave rendezvous %r: %s", me, self._settings.run_id, exc)
        finally:
            self._cached = None
            if not rejoin:
                self._stores.close()

    # -- keep-alive (the thread itself: keepalive.py) -------------------------------------

    def _on_state_written(self) -> None:
        self._state_written = True

    def _start_heartbeats(self) -> None:
        self._stop_watch = self._backend.watch_state(self._on_state_written)
        self._keep_alive.start()

    def _stop_heartbeats(self) -> None:
        if self._stop_watch is not None:
            self._stop_watch()
            self._stop_watch = None
        self._keep_alive.stop()

    def _beat_through_state(self, stop: threading.Event) -> None:
        """One heartbeat written into the shared state (a backend without per-node heartbeat keys)."""
        with self._lock:
            if stop.is_set():
                return
            self._executor.run(ops.decide_keep_alive, self._settings.heartbeat_timeout, "heartbeat_timeout")
