"""The rendezvous contract: handler interface, its parameters, its result, its errors.

Stdlib only: backends import this module, never the reverse, and the agent
knows nothing but this interface. Mirrors ``torch.distributed.elastic.rendezvous.api``
with two deliberate changes:

* ``RendezvousInfo`` carries the round number and each node's role and
  local world size, so rank assignment is a pure function (no extra store
  round trips, heterogeneous ``--nproc-per-node`` supported).
* Every round publishes a fresh workers' store (MASTER_ADDR/MASTER_PORT), so
  nothing written by the workers of round N is read in round N+1.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Any, NamedTuple

# the job-wide records are part of the contract; they live in their own module
from elaunch.rendezvous import job_records
from elaunch.rendezvous.job_records import FailureRecord, JobState

MAX_FAILURE_MESSAGE = job_records.MAX_FAILURE_MESSAGE  # re-exported with the records


class RendezvousError(Exception):
    """Base of every rendezvous error (torch: ``RendezvousError``)."""


class RendezvousConfigError(RendezvousError, ValueError):
    """A parameter or ``--rdzv-conf`` value is invalid; the message names it.

    The CLI turns this into one line on stderr and exit status 2.
    """


class RendezvousClosedError(RendezvousError):
    """The rendezvous is closed: the job is finishing and no new round will form."""


class RendezvousTimeoutError(RendezvousError):
    """A round did not complete in time (join timeout, in seconds, exceeded)."""


class RendezvousConnectionError(RendezvousError):
    """The backend (store host, etcd) cannot be reached; the message names the endpoint."""


class RendezvousStateError(RendezvousError):
    """The rendezvous state is corrupt or this node was dropped from it."""


class RendezvousGracefulExitError(RendezvousError):
    """This node is not needed (e.g. more nodes than MAX); it should exit 0."""


class RendezvousJobFailedError(RendezvousClosedError):
    """The rendezvous was closed because the job failed on some node (an elaunch addition).

    Attributes:
        failure: the job's root cause as that node's agent published it.
    """

    def __init__(self, message: str, failure: "FailureRecord") -> None:
        super().__init__(message)
        self.failure = failure


class NodeInfo(NamedTuple):
    """What a node declares when it joins: enough to assign ranks without a store.

    An immutable named tuple ``(addr, role, local_world_size)``: every agent of a
    1024-node round builds one per node (``RendezvousInfo.nodes``), and a tuple is
    ~3x cheaper to build than a frozen dataclass. torch has no public counterpart
    (its ``_NodeDesc`` names a node, not its workers).

    Attributes:
        addr: the node's address as others reach it.
        role: its workers' role (``--role``).
        local_world_size: its number of workers (``--nproc-per-node``).
    """

    addr: str
    role: str = "default"
    local_world_size: int = 1


@dataclass(frozen=True)
class RendezvousInfo:
    """The result of one completed round, as seen by one node.

    Attributes:
        round: the round number, 0-based, strictly increasing for a run id.
        rank: this node's group rank, 0 .. world_size-1 (``GROUP_RANK``).
        world_size: number of nodes in the round (``GROUP_WORLD_SIZE``).
        master_addr: address of the workers' store for this round (``MASTER_ADDR``).
        master_port: its port (``MASTER_PORT``); fresh each round.
        use_agent_store: True when an agent hosts that store and every worker is a
            client (``TORCHELASTIC_USE_AGENT_STORE=True``); False when worker rank 0
            hosts it.
        host_store: True when this node's agent must host that store itself, at
            ``master_port`` (0: any free port, which the agent then gives its
            workers); standalone and static node rank 0, as torchrun's agent does.
        nodes: every node of the round in group-rank order (every elaunch backend
            fills it), or () when a backend does not know them (then all nodes
            are assumed to run this node's role and local world size).
        store: an agent-side key/value store namespaced to this round, or None.
            Objects here have at least ``set(key, bytes)``, ``get(key) -> bytes``,
            ``add(key, int) -> int`` (torch ``Store`` semantics).
        restart_count: the job's failure restarts before this round, the same on
            every node (``TORCHELASTIC_RESTART_COUNT``); None when the backend keeps
            no job state (static, standalone: the agent counts its own).
    """

    round: int
    rank: int
    world_size: int
    master_addr: str
    master_port: int
    use_agent_store: bool = False
    host_store: bool = False
    nodes: tuple[NodeInfo, ...] = ()
    store: Any = field(default=None, compare=False, repr=False)
    restart_count: int | None = None


@dataclass
class RendezvousParameters:
    """Everything needed to build a handler (torch: ``RendezvousParameters``).

    Attributes:
        backend: registry name (``static``, ``c10d``, ``etcd``, ``etcd-v2``, ``etcd-v3``).
        endpoint: ``host[:port]`` (etcd: comma-separated list), "" for none.
        run_id: the job id (``--rdzv-id``); nodes with different ids never meet.
        min_nodes, max_nodes: bounds on the world, 1 <= min <= max.
        config: ``--rdzv-conf`` entries, string values as given by the user.
        local_addr: this node's address (``--local-addr``) or None for the FQDN.
        role, local_world_size: this node's NodeInfo fields.
        read_keys: the ``config`` keys a backend asked for through ``get``/``get_as_*``
            (shared with copies made by ``dataclasses.replace``), so the registry can
            name the keys the backend did not use (:meth:`unused_keys`).
    """

    backend: str
    endpoint: str
    run_id: str
    min_nodes: int
    max_nodes: int
    config: dict[str, str] = field(default_factory=dict)
    local_addr: str | None = None
    role: str = "default"
    local_world_size: int = 1
    read_keys: set[str] = field(default_factory=set, repr=False, compare=False)

    def get(self, key: str, default: Any = None) -> Any:
        """Return the raw ``--rdzv-conf`` value of ``key`` or ``default`` (the key counts as used)."""
        self.read_keys.add(key)
        return self.config.get(key, default)

    def unused_keys(self, given: Any = None) -> list[str]:
        """Return the keys of ``given`` (default: ``config``) no backend read, in order.

        A backend reads its keys while it is built, so after ``create_handler`` these
        are the keys it ignores: torch's backends ignore unknown keys too.
        """
        return [key for key in (self.config if given is None else given) if key not in self.read_keys]

    def get_as_bool(self, key: str, default: bool | None = None) -> bool | None:
        """Return ``key`` as a bool (1/0, true/false, yes/no, on/off; any case).

        Raises:
            RendezvousConfigError: the value is none of those.
        """
        value = self.get(key)
        if value is None or isinstance(value, bool):
            return default if value is None else value
        low = str(value).strip().lower()
        if low in ("1", "true", "t", "yes", "y", "on"):
            return True
        if low in ("0", "false", "f", "no", "n", "off"):
            return False
        raise RendezvousConfigError(f"--rdzv-conf {key}={value}: expected a boolean (true/false)")

    def get_as_int(self, key: str, default: int | None = None) -> int | None:
        """Return ``key`` as an int.

        Raises:
            RendezvousConfigError: the value is not an integer.
        """
        value = self.get(key)
        if value is None:
            return default
        try:
            return int(value)
        except (TypeError, ValueError):
            raise RendezvousConfigError(f"--rdzv-conf {key}={value}: expected an integer") from None

    def get_as_seconds(self, key: str, default: float) -> float:
        """Return ``key`` as a duration in seconds (float, > 0).

        Raises:
            RendezvousConfigError: not a number, or not positive.
        """
        value = self.get(key)
        if value is None:
            return default
        try:
            seconds = float(value)
        except (TypeError, ValueError):
            raise RendezvousConfigError(f"--rdzv-conf {key}={value}: expected seconds (a number)") from None
        if not seconds > 0:
            raise RendezvousConfigError(f"--rdzv-conf {key}={value}: must be > 0 seconds")
        return seconds


class RendezvousHandler(abc.ABC):
    """Brings the agents of one job together, round after round.

    Mirrors ``torch.distributed.elastic.rendezvous.RendezvousHandler``.
    """

    @abc.abstractmethod
    def get_backend(self) -> str:
        """Return the backend's registry name."""

    @abc.abstractmethod
    def next_rendezvous(self) -> RendezvousInfo:
        """Join the next round and block until it completes.

        Raises:
            RendezvousClosedError: the rendezvous was closed.
            RendezvousTimeoutError: the round did not complete within the join timeout.
            RendezvousConnectionError: the backend is unreachable.
            RendezvousGracefulExitError: the world is full; this node should exit 0.
        """

    @abc.abstractmethod
    def is_closed(self) -> bool:
        """Return True once ``set_closed`` was called by any node."""

    @abc.abstractmethod
    def set_closed(self) -> None:
        """Close the rendezvous: no further round forms (the job is ending)."""

    @abc.abstractmethod
    def num_nodes_waiting(self) -> int:
        """Return how many nodes wait to join the next round (0 for static).

        A running agent polls this every ``monitor_interval`` seconds and, when it is
        positive, restarts its group without counting a restart (membership change).
        """

    def num_nodes_lost(self) -> int:
        """Return how many nodes of this node's running round are gone (0 by default).

        Gone: the node's heartbeat or lease expired (agent killed, link cut) or it
        left to rejoin. A running agent polls this with ``num_nodes_waiting`` and,
        when positive, re-forms the group without counting a restart. torchrun has
        no such check: it waits for the workers to fail, which a cut link can turn
        into a 30-minute collective timeout.
        """
        return 0

    def num_nodes_new(self) -> int:
        """Return how many nodes outside this node's running round joined since it formed (0 by default).

        Asked only after a local worker failed, from a fresh read. When a node
        joins, the agent that sees it first stops its workers to re-form; the
        workers here can then die on the closed sockets before this agent's own
        poll sees the newcomer. A positive count makes that a membership change
        (not a counted restart): torchrun counts it as a failure and, without
        restarts left, ends the job on a scale-up.

        Raises:
            RendezvousConnectionError: the backend is unreachable.
        """
        return 0

    def can_reform(self) -> bool:
        """Return True when a later round may form without a failure restart.

        True for the dynamic backends (c10d, etcd): nodes may join or leave, and a
        membership change re-forms the group. False (the default) for static and
        standalone rendezvous, whose only later rounds are failure restarts. The
        agent asks this instead of comparing backend names (e.g. to decide whether
        to prepare warm spares for another attempt).
        """
        return False

    @abc.abstractmethod
    def get_run_id(self) -> str:
        """Return the run id (``TORCHELASTIC_RUN_ID``)."""

    def shutdown(self) -> bool:
        """Release this node's resources (heartbeats, stores); True on success."""
        return True

    def leave(self, rejoin: bool = False) -> None:
        """Leave the job as a node that goes away, without closing the rendezvous.

        For an agent stopped by a signal, and for a node that sits out a cooldown
        (bad-node exclusion, ``rejoin=True``: a later ``next_rendezvous`` joins
        again). The other nodes see a lost member and re-form without this one
        when they still meet ``min_nodes``. Default: :meth:`shutdown` unless
        ``rejoin`` (backends without membership changes end the job with the node).
        """
        if not rejoin:
            self.shutdown()

    # -- the job, not just the round (elaunch additions; torch's handlers have none) ----

    def job_state(self) -> JobState | None:
        """Return the job's shared facts, or None when the backend keeps none (static, standalone).

        Cheap: the dynamic backends answer from the same read as
        ``num_nodes_waiting`` (at most ``poll_interval`` seconds old), so the agent's
        monitor asks every ``--monitor-interval`` at no extra cost.

        Raises:
            RendezvousConnectionError: the backend is unreachable.
        """
        return None

    def record_failure(self, failure: FailureRecord) -> JobState | None:
        """Count ``failure.round``'s failure once for the whole job; return the job state after it.

        The first record of a round counts one restart; later records of the same
        round (peers whose collectives broke) only replace the round's root cause
        when they happened earlier. Before counting, the handler checks that every
        other member of the round is still there (it may wait up to the backend's
        probe time, seconds): when one left or its agent died, the failure is that
        node's loss, nothing is counted and the returned state lists it in
        ``JobState.lost``. Returns None when the backend keeps no job state.

        Raises:
            RendezvousConnectionError: the backend is unreachable.
        """
        return None

    def fail_job(self, failure: FailureRecord) -> FailureRecord:
        """Declare the job failed with ``failure`` as its root cause, and close the rendezvous.

        Every other agent sees it at its next check and stops. When another node
        already declared it (or recorded an earlier failure of the same round), that
        root cause is kept and returned.

        Returns:
            The job's root cause (``failure`` for backends without job state).

        Raises:
            RendezvousConnectionError: the backend is unreachable.
        """
        return failure

    def succeed_job(self) -> None:
        """Declare the job succeeded and close the rendezvous (after this node's exit barrier).

        Nodes outside the last round -- waiting to join, standing by as spares, or
        sitting out a cooldown (bad-node exclusion) -- see it and exit 0 at once,
        as torchrun's surplus nodes do (``RendezvousGracefulExitError``); the
        declaring node's :meth:`shutdown` waits until they saw it (it may host the
        store they read). A job declared failed stays failed. No-op for backends
        without job state (:meth:`shutdown` closes them).

        Raises:
            RendezvousConnectionError: the backend is unreachable.
        """

    def sit_out(self) -> None:
        """Leave the round to sit out a cooldown (bad-node exclusion), still watching the job.

        The others re-form without this node, as after ``leave(rejoin=True)``; but
        the node stays known to the rendezvous as a watcher, so the node that ends
        the job waits for it to see the end (see :meth:`succeed_job`). A later
        ``leave(rejoin=True)`` ends the sitting out. Default: ``leave(rejoin=True)``.

        Raises:
            RendezvousConnectionError: the backend is unreachable.
        """
        self.leave(rejoin=True)

    def acknowledge_failure(self) -> None:
        """Tell the node that declared the job failed that this node saw it and stopped (best effort).

        That node waits for every live node's acknowledgement before it exits (it
        may host the store the others read): the members of its last round and the
        nodes waiting, standing by or sitting out. No-op for backends without job state.
        """

    def publish_node_record(self, kind: str, doc: dict) -> None:
        """Publish a small JSON document of this node for ``elaunch status`` (best effort, never raises).

        ``kind`` is ``"agent"`` (pid, ranks, budget, written when workers start) or
        ``"stacks"`` (the answer to a status request for stacks). The document lives
        beside the rendezvous state, never in it: no round changes. No-op for
        backends without node keys (static, standalone).
        """

    def request_stack_dump(self, by: FailureRecord) -> int:
        """Ask every agent of the job to dump its workers' Python stacks (``by``: the hung worker).

        Returns:
            The request's id (``JobState.dump_id``); 0 for backends without job state (no-op).

        Raises:
            RendezvousConnectionError: the backend is unreachable.
        """
        return 0

    def acknowledge_dump(self, dump_id: int) -> None:
        """Tell the asking node that this node's stacks for request ``dump_id`` are written (best effort)."""

    def await_dump_acknowledgements(self, dump_id: int, timeout: float) -> list[str]:
        """Wait up to ``timeout`` seconds until every live member of this node's round answered ``dump_id``.

        The asking node kills its hung workers only then: the others' workers are
        still blocked where the hang left them while they are dumped.

        Returns:
            The node ids that did not answer in time ([] for backends without job state).
        """
        return []

    def exit_barrier(self, timeout: float) -> None:
        """Wait, up to ``timeout`` seconds, until every node of the round finished.

        Keeps the node that hosts a store alive until the others no longer need it.
        The default does nothing (backends without a hosted store).
        """
