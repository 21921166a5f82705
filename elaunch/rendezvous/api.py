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
from typing import Any


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


@dataclass(frozen=True)
class NodeInfo:
    """What a node declares when it joins: enough to assign ranks without a store.

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
        nodes: every node of the round in group-rank order, or () when the backend
            does not know them (then all nodes are assumed to run this node's
            role and local world size, as static rendezvous requires).
        store: an agent-side key/value store namespaced to this round, or None.
            Objects here have at least ``set(key, bytes)``, ``get(key) -> bytes``,
            ``add(key, int) -> int`` (torch ``Store`` semantics).
    """

    round: int
    rank: int
    world_size: int
    master_addr: str
    master_port: int
    use_agent_store: bool = False
    nodes: tuple[NodeInfo, ...] = ()
    store: Any = field(default=None, compare=False, repr=False)


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

    def get(self, key: str, default: Any = None) -> Any:
        """Return the raw ``--rdzv-conf`` value of ``key`` or ``default``."""
        return self.config.get(key, default)

    def get_as_bool(self, key: str, default: bool | None = None) -> bool | None:
        """Return ``key`` as a bool (1/0, true/false, yes/no, on/off; any case).

        Raises:
            RendezvousConfigError: the value is none of those.
        """
        value = self.config.get(key)
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
        value = self.config.get(key)
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
        value = self.config.get(key)
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

    def exit_barrier(self, timeout: float) -> None:
        """Wait, up to ``timeout`` seconds, until every node of the round finished.

        Keeps the node that hosts a store alive until the others no longer need it.
        The default does nothing (backends without a hosted store).
        """
