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
from elaunch.rendezvous.job_channel import JobChannel, LocalJobChannel
from elaunch.rendezvous.job_records import FailureRecord, JobState

MAX_FAILURE_MESSAGE = job_records.MAX_FAILURE_MESSAGE  # re-exported with the records
_LOCAL = LocalJobChannel()  # stateless: one for every handler without job state


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


#: The longest duration an ``--rdzv-conf`` key takes, in seconds (about 3 years): within the bounds of a
#: store's timeout (milliseconds, 64-bit) and of ``threading``'s waits (``threading.TIMEOUT_MAX``).
MAX_SECONDS = 1e8


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
        """Return ``key`` as a duration in seconds (float, > 0 and at most :data:`MAX_SECONDS`).

        Raises:
            RendezvousConfigError: not a number, not positive, or larger than :data:`MAX_SECONDS` (``inf``
                too: a store's timeout and a thread's wait have upper bounds, past which they fail mid-run).
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
        if not seconds <= MAX_SECONDS:
            raise RendezvousConfigError(f"--rdzv-conf {key}={value}: must be at most {MAX_SECONDS:.0e} seconds")
        return seconds


class RendezvousHandler(abc.ABC):
    """Brings the agents of one job together, round after round.

    Mirrors ``torch.distributed.elastic.rendezvous.RendezvousHandler``; the job's
    facts beside the rounds go through :meth:`job_channel`.

    Attributes:
        can_reform: True when a later round may form without a failure restart:
            the dynamic backends (c10d, etcd), where nodes may join or leave and a
            membership change re-forms the group. False (the default) for static and
            standalone rendezvous, whose only later rounds are failure restarts. The
            agent asks this instead of comparing backend names (e.g. to decide
            whether to prepare warm spares for another attempt).
    """

    can_reform: bool = False

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

        A running agent polls this every ``--monitor-interval`` seconds and, when it is
        positive, restarts its group without counting a restart (membership change).
        """

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

    def job_channel(self) -> JobChannel:
        """Return this node's channel to the job's facts (an elaunch addition; torch's handlers have none).

        Failures and the job's verdict, their acknowledgements, stack-dump
        requests, the running round's lost and new members, the node records of
        ``elaunch status``: see :mod:`elaunch.rendezvous.job_channel`. The same
        object on every call. Default: a :class:`LocalJobChannel` (no job state:
        this agent counts alone, as torchrun's does).
        """
        return _LOCAL

    def exit_barrier(self, timeout: float) -> None:
        """Wait, up to ``timeout`` seconds, until every node of the round finished.

        Keeps the node that hosts a store alive until the others no longer need it.
        The default does nothing (backends without a hosted store).
        """
