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

from elaunch.rendezvous.contract import (
    NodeInfo,
    RendezvousClosedError,
    RendezvousError,
    RendezvousGracefulExitError,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousJobFailedError,
    RendezvousStateError,
    RendezvousTimeoutError,
)
from elaunch.rendezvous.dynamic import job_ops, liveness, ops
from elaunch.rendezvous.dynamic.backend import RendezvousBackend
from elaunch.rendezvous.dynamic.channel import DynamicJobChannel, Tolerate, untolerated
from elaunch.rendezvous.dynamic.executor import OpExecutor
from elaunch.rendezvous.dynamic.keepalive import KeepAlive
from elaunch.rendezvous.dynamic.presence import Presence
from elaunch.rendezvous.dynamic.round_view import RoundView
from elaunch.rendezvous.dynamic.settings import RendezvousSettings
from elaunch.rendezvous.dynamic.stalls import StoreStalls, slow_after
from elaunch.supervision import OFF, RENDEZVOUS, Supervisor
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


class DynamicRendezvousHandler(RendezvousHandler):
    """Joins rounds through a shared, compare-and-set state (torch ``DynamicRendezvousHandler``).

    Args:
        node: this node's NodeInfo (its ``addr`` also names it in logs and node ids).
        settings: sizes and timeouts (seconds).
        backend: where the shared state lives.
        store_factory: makes each round's workers' store and namespaced agent store.
        clock: seconds since the epoch (injectable for tests).
        sleep: sleeps a number of seconds (injectable for tests).
        tolerate: how the job channel runs the monitor's reads (``DynamicJobChannel``'s
            ``tolerate``; etcd rides out short outages).
        supervisor: the launch's ``elaunch.supervision.Supervisor``: the keep-alive thread is its
            helper (tier ``RENDEZVOUS``, policy off) while a round runs; None: one of the handler's own.
    """

    can_reform = True  # nodes may join or leave, and each membership change forms a new round

    def __init__(
        self,
        node: NodeInfo,
        settings: RendezvousSettings,
        backend: RendezvousBackend,
        store_factory: RoundStoreFactory,
        clock: Callable[[], float] = time.time,
        sleep: Callable[[float], None] = time.sleep,
        tolerate: Tolerate = untolerated,
        supervisor: Supervisor | None = None,
    ) -> None:
        self._node = node
        self._supervisor = supervisor if supervisor is not None else Supervisor()  # runs the keep-alive
        self._node_id = f"{node.addr}_{os.getpid()}_{next(_local_ids)}"
        self._settings = settings
        self._backend = backend
        self._stores = store_factory
        self._clock = clock
        self._sleep = sleep
        self._executor = OpExecutor(backend, self._node_id, node, settings, clock, sleep)
        self._lock = threading.RLock()
        stalls = StoreStalls(clock, slow_after(settings))  # when the store last stalled for this node
        self._view = RoundView(self._node_id, settings, backend, clock, stalls)
        self._view.on_read = self._answer_probe
        # its port, listening from the first round on, shows peers at once when this agent is gone
        self._presence = Presence(self._node_id, node.addr, backend) if settings.presence else None
        on_tick = None if self._presence is None else (lambda: self._presence.tick(self._view.watched[1:]))
        self._keep_alive = KeepAlive(self._node_id, settings, backend, clock, stalls, on_tick)
        self._stop_watch: Callable[[], None] | None = None
        self._channel = DynamicJobChannel(self._view, self._executor, self._lock, settings, backend,
                                          (self._start_heartbeats, self._stop_heartbeats), clock, sleep, tolerate,
                                          presence=self._presence)

    @property
    def node_id(self) -> str:
        """This handler's id in the shared state (``addr_pid_localid``, as torch's node descriptor)."""
        return self._node_id

    def job_channel(self) -> DynamicJobChannel:
        """Return this node's channel to the job's facts in the shared state (one per handler)."""
        return self._channel

    def get_backend(self) -> str:
        """Return the storage backend's name (``"c10d"``, ...)."""
        return self._backend.name

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
        view, s = self._view, self._settings
        if view.info is None:
            return
        state = view.cached() or self._executor.state
        alive = len(view.members) - view.left(state)  # a member rejoining with us has not left
        if alive < s.min_nodes:
            log.warning("only %d of the job's nodes are left (--nnodes=%d:%d); waiting up to join_timeout=%g s "
                        "for more to join", alive, s.min_nodes, s.max_nodes, s.join_timeout)

    def _raise_job_end(self, exc: RendezvousError) -> None:
        """Closed while this node joined: raise the job's verdict if there is one (else return)."""
        state, run_id = self._executor.state, self._settings.run_id
        if state.job_failed and state.failure is not None:
            root = job_ops.job_state(state, self._node_id, 0, self._settings).failure
            raise RendezvousJobFailedError(
                f"rendezvous {run_id!r} is closed: the job failed on {root.host} (rank {root.rank})", root) from exc
        if state.job_succeeded:
            self.leave(rejoin=True)  # the node that declared it waits until we are out of the state
            raise RendezvousGracefulExitError(
                f"rendezvous {run_id!r} is closed: the job succeeded while this node waited to join") from exc

    def _next_rendezvous(self) -> RendezvousInfo:
        started = time.monotonic()
        self._stop_heartbeats()
        self._open_presence()
        s = self._settings
        view = self._view
        previous_rank = -1 if view.info is None else view.info.rank
        if view.info is None:
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
        view.invalidate()  # a read from before this round must not be judged against it
        if self._node_id not in state.participants:
            raise RendezvousStateError(f"node {self._node_id} finished joining but is not a participant")
        rank, world_size = state.participants[self._node_id], len(state.participants)
        missing = sorted(view.members - set(state.participants))
        if missing and view.info is not None:
            # name who is gone: a node killed outright shows here first (its peers' workers
            # failed on the closed sockets before its heartbeat could be missed)
            log.warning("round %d formed without %d node(s) of round %d: %s (left, stopped or lost)",
                        state.round, len(missing), view.info.round, ", ".join(missing))
        view.enter(frozenset(state.participants))
        nodes = state.ranked_nodes()
        self._start_heartbeats()
        stores = self._stores.setup_round(state.round, rank, world_size, nodes)
        view.info = RendezvousInfo(
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
        return view.info

    def _answer_probe(self, state: RendezvousState) -> None:
        """A read saw a probe: answer at once, not at the keep-alive thread's next tick."""
        if self._keep_alive.running and liveness.should_answer_probe(state, self._node_id):
            self._keep_alive.beat_now()

    def num_nodes_waiting(self) -> int:
        """Return how many live nodes wait for the next round (torch: the wait list's length).

        The read may be up to ``poll_interval`` seconds old. Dead nodes (no
        heartbeat for ``keep_alive_interval * keep_alive_max_attempt`` seconds) do
        not count.

        Raises:
            RendezvousConnectionError: the backend is unreachable.
        """
        return liveness.num_live_waiting(self._view.read(), self._settings, self._clock())

    def is_closed(self) -> bool:
        """Return True once any node closed the rendezvous.

        Raises:
            RendezvousConnectionError: the backend is unreachable.
        """
        self._view.invalidate()
        return self._view.read().closed

    def set_closed(self) -> None:
        """Close the rendezvous for every node; later joins raise RendezvousClosedError.

        Raises:
            RendezvousTimeoutError: not done within ``close_timeout`` seconds.
            RendezvousConnectionError: the backend is unreachable.
        """
        with self._lock:
            self._executor.run(ops.decide_close, self._settings.close_timeout, "close_timeout")
        self._view.invalidate()

    def exit_barrier(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds until every node of the current round checked in.

        Returns early (with a warning) on timeout or a store error; never raises a
        RendezvousError, mirroring torch's agent, which only logs a failed barrier.
        """
        info = self._view.info
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
        self._close_presence()
        if self._backend.never_reached():
            return False  # its error is the run's: nothing was written, nothing to close
        try:
            if not self._executor.state.closed:  # closed already (it was read): nothing to write
                self.set_closed()
            if self._channel.declared_end:
                self._channel.await_acknowledgements()
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
        if self._backend.never_reached():
            return  # this node wrote nothing yet: nothing to leave
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
            ops.prune_node_infos(s)
            return s

        try:
            with self._lock:
                self._executor.update(remove_me, self._settings.close_timeout, "close_timeout")
            log.info("node %s left rendezvous %r", me, self._settings.run_id)
        except RendezvousError as exc:
            log.warning("node %s could not leave rendezvous %r: %s", me, self._settings.run_id, exc)
        finally:
            self._view.invalidate()
            if not rejoin:
                self._close_presence()
                self._stores.close()

    # -- keep-alive (the thread itself: keepalive.py) -------------------------------------

    def _start_heartbeats(self) -> None:
        self._stop_watch = self._backend.watch_state(self._view.state_written)
        self._supervisor.add(self._keep_alive, RENDEZVOUS, on_death=OFF, wakes=False, start=True,
                             note="this node's heartbeat is no longer written: the others will find it lost")

    def _open_presence(self) -> None:
        """Listen on the presence port from the first round on (``presence.py``), a helper of the supervisor.

        The port is published by the keep-alive's first tick, off the join's path (no extra store call there).
        """
        presence = self._presence
        if presence is not None and not self._supervisor.has(presence) and presence.open():
            self._supervisor.add(presence, RENDEZVOUS, watched=False, wakes=False)

    def _close_presence(self) -> None:
        if self._presence is not None:
            self._supervisor.stop(self._presence)  # it closes the port (one that never opened is not there)

    def _stop_heartbeats(self) -> None:
        if self._stop_watch is not None:
            self._stop_watch()
            self._stop_watch = None
        self._supervisor.stop(self._keep_alive)
