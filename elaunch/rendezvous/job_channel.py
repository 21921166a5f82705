"""The job channel: the job's facts beside the rendezvous (an elaunch addition; torch has none).

A rendezvous handler forms rounds (``contract.RendezvousHandler``, torch's contract).
What one agent learns that the whole job must act on -- a failure and its root
cause, the job's verdict, the acknowledgements of it, stack-dump requests, the
running round's lost and new members, the per-node records ``elaunch status``
reads -- goes through the :class:`JobChannel` the handler hands out
(``RendezvousHandler.job_channel()``), as Horovod keeps its notification
service apart from its rendezvous server.

Three implementations: the dynamic backends' (``dynamic/channel.py``, over the
shared state), :class:`LocalJobChannel` for handlers that keep no job state
(static, standalone, torch plugin handlers: this agent counts alone, as under
torchrun), and :class:`InMemoryJobChannel`, a test double whose facts are data.
Stdlib only.
"""

from __future__ import annotations

import abc
import logging
import threading
from dataclasses import replace

from elaunch.rendezvous.job_records import FailureRecord, JobState

log = logging.getLogger("elaunch.agent")

#: The node id :meth:`LocalJobChannel.exchange` files this node's document under (it names no nodes).
LOCAL_NODE = "local"


class JobChannel(abc.ABC):
    """One agent's channel to the job's shared facts.

    Attributes:
        keeps_job_state: True when the facts are shared by every agent of the job
            (the dynamic backends); False when this agent counts alone (then
            :meth:`state` and :meth:`record_failure` return None and the writes do nothing).
        node_id: this node's id in the job (None where the backend names no nodes).
    """

    keeps_job_state: bool = False
    node_id: str | None = None

    @property
    def round_members(self) -> frozenset[str]:
        """Node ids of the last round this node joined (empty: not known); a read of local memory only."""
        return frozenset()

    @abc.abstractmethod
    def state(self) -> JobState | None:
        """Return the job's shared facts, or None when no job state is kept.

        Cheap: the dynamic backends answer from the same read as
        ``num_nodes_waiting`` (at most ``poll_interval`` seconds old), so the agent's
        monitor asks every ``--monitor-interval`` at no extra cost.

        Raises:
            RendezvousConnectionError: the backend is unreachable.
        """

    @abc.abstractmethod
    def num_nodes_lost(self) -> int:
        """Return how many nodes of this node's running round are gone (0 without membership changes).

        Gone: the node's heartbeat or lease expired (agent killed, link cut) or it
        left to rejoin. A running agent polls this with ``num_nodes_waiting`` and,
        when positive, re-forms the group without counting a restart. torchrun has
        no such check: it waits for the workers to fail, which a cut link can turn
        into a 30-minute collective timeout.

        Raises:
            RendezvousConnectionError: the backend is unreachable.
        """

    @abc.abstractmethod
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

    @abc.abstractmethod
    def record_failure(self, failure: FailureRecord) -> JobState | None:
        """Count ``failure.round``'s failure once for the whole job; return the job state after it.

        The first record of a round counts one restart; later records of the same
        round (peers whose collectives broke) only replace the round's root cause
        when they happened earlier. Before counting, the channel checks that every
        other member of the round is still there (it may wait up to the backend's
        probe time, seconds): when one left or its agent died, the failure is that
        node's loss, nothing is counted and the returned state lists it in
        ``JobState.lost``. Returns None when no job state is kept.

        Raises:
            RendezvousConnectionError: the backend is unreachable.
        """

    @abc.abstractmethod
    def fail_job(self, failure: FailureRecord) -> FailureRecord:
        """Declare the job failed with ``failure`` as its root cause, and close the rendezvous.

        Every other agent sees it at its next check and stops. When another node
        already declared it (or recorded an earlier failure of the same round), that
        root cause is kept and returned.

        Returns:
            The job's root cause (``failure`` without job state).

        Raises:
            RendezvousConnectionError: the backend is unreachable.
        """

    @abc.abstractmethod
    def succeed_job(self) -> None:
        """Declare the job succeeded and close the rendezvous (after this node's exit barrier).

        Nodes outside the last round -- waiting to join, standing by as spares, or
        sitting out a cooldown (bad-node exclusion) -- see it and exit 0 at once,
        as torchrun's surplus nodes do (``RendezvousGracefulExitError``); the
        declaring node's handler ``shutdown`` waits until they saw it (it may host
        the store they read). A job declared failed stays failed. No-op without job state.

        Raises:
            RendezvousConnectionError: the backend is unreachable.
        """

    @abc.abstractmethod
    def sit_out(self) -> None:
        """Leave the round to sit out a cooldown (bad-node exclusion), still watching the job.

        The others re-form without this node, as after the handler's
        ``leave(rejoin=True)``; but the node stays known to the rendezvous as a
        watcher, so the node that ends the job waits for it to see the end (see
        :meth:`succeed_job`). A later ``leave(rejoin=True)`` ends the sitting out.
        No-op without job state (the handler's ``leave(rejoin=True)`` does nothing there either).

        Raises:
            RendezvousConnectionError: the backend is unreachable.
        """

    @abc.abstractmethod
    def acknowledge_failure(self) -> None:
        """Tell the node that declared the job failed that this node saw it and stopped (best effort).

        That node waits for every live node's acknowledgement before it exits (it
        may host the store the others read): the members of its last round and the
        nodes waiting, standing by or sitting out. No-op without job state.
        """

    @abc.abstractmethod
    def publish_node_record(self, kind: str, doc: dict) -> None:
        """Publish a small JSON document of this node for ``elaunch status`` (best effort, never raises).

        ``kind`` is ``"agent"`` (pid, ranks, budget, written when workers start) or
        ``"stacks"`` (the answer to a status request for stacks). The document lives
        beside the rendezvous state, never in it: no round changes. No-op without
        job state or without node keys.
        """

    @abc.abstractmethod
    def exchange(self, kind: str, round: int, doc: dict, timeout: float) -> dict[str, dict]:
        """Publish this node's JSON ``doc`` of ``kind`` for ``round`` and return every member's.

        Each member of the round (:attr:`round_members`) calls it with its own
        document (the in-memory checkpoints' inventories: ``checkpoint.plan``);
        it returns once every member published one for ``round``, or after
        ``timeout`` seconds with those that did (a missing member holds nothing).
        A document of an earlier round is never taken for this round's. Every
        member gets the same set of documents, also when some came late (the
        dynamic backends agree on it: ``dynamic/exchange.py``), so a choice made
        from them is the same on every node. Waits at most ``2 * timeout`` seconds.
        One exchange per ``kind`` and round: a second one in the same round may
        return the first one's documents.

        Args:
            kind: what is exchanged (letters, digits, ``_``), e.g. ``"ckpt"``.
            round: the round this node joined last (``RendezvousInfo.round``).
            doc: this node's document (JSON-serialisable, small: kilobytes).
            timeout: seconds to wait for the other members' documents.

        Returns:
            node id -> document, this node's own included (unless the members agreed
            without it). Without job state (static, standalone, plugin handlers):
            ``{LOCAL_NODE: doc}`` at once, or ``{node_id: doc}`` where a node id is set.

        Raises:
            ValueError: a bad ``kind``; TypeError, ValueError: ``doc`` is not JSON-serialisable.
                Backend errors are never raised: they are logged and waited through.
        """

    @abc.abstractmethod
    def request_stack_dump(self, by: FailureRecord) -> int:
        """Ask every agent of the job to dump its workers' Python stacks (``by``: the hung worker).

        Returns:
            The request's id (``JobState.dump_id``); 0 without job state (no-op).

        Raises:
            RendezvousConnectionError: the backend is unreachable.
        """

    @abc.abstractmethod
    def acknowledge_dump(self, dump_id: int) -> None:
        """Tell the asking node that this node's stacks for request ``dump_id`` are written (best effort)."""

    @abc.abstractmethod
    def await_dump_acknowledgements(self, dump_id: int, timeout: float) -> list[str]:
        """Wait up to ``timeout`` seconds until every live member of this node's round answered ``dump_id``.

        The asking node kills its hung workers only then: the others' workers are
        still blocked where the hang left them while they are dumped.

        Returns:
            The node ids that did not answer in time ([] without job state).
        """


class LocalJobChannel(JobChannel):
    """The channel of a handler that keeps no job state (static, standalone, torch plugin handlers).

    This agent counts its own restarts, as torchrun's agent does: no facts are
    shared, no node is ever lost or new, every write is a no-op.
    """

    keeps_job_state = False

    def state(self) -> None:
        return None

    def num_nodes_lost(self) -> int:
        return 0

    def num_nodes_new(self) -> int:
        return 0

    def record_failure(self, failure: FailureRecord) -> None:
        return None

    def fail_job(self, failure: FailureRecord) -> FailureRecord:
        return failure

    def succeed_job(self) -> None:
        pass

    def sit_out(self) -> None:
        pass

    def acknowledge_failure(self) -> None:
        pass

    def publish_node_record(self, kind: str, doc: dict) -> None:
        pass

    def exchange(self, kind: str, round: int, doc: dict, timeout: float) -> dict[str, dict]:
        """Only this node's ``doc``, at once: no other node is reachable (a static job of several nodes included)."""
        return {self.node_id or LOCAL_NODE: doc}

    def request_stack_dump(self, by: FailureRecord) -> int:
        return 0

    def acknowledge_dump(self, dump_id: int) -> None:
        pass

    def await_dump_acknowledgements(self, dump_id: int, timeout: float) -> list[str]:
        return []


class InMemoryJobChannel(JobChannel):
    """A channel whose facts are data, for tests of the agent's side (no rendezvous, no processes).

    The same rules as the dynamic backends', simplified to one node: the first
    record of a round counts one restart, a verdict is never replaced, a dump
    request gets the next id. Tests script the rest as data: ``lost`` (nodes a
    failure record blames on a lost member), ``nodes_lost`` and ``nodes_new``.

    Args:
        node_id: this node's id.
        job: the starting facts (``node`` is set to ``node_id``).

    Attributes:
        job: the current facts.
        records: ``kind -> doc`` as published.
        peer_docs: ``kind -> {node id: doc}``: the other members' documents :meth:`exchange` returns.
        exchanged: ``(kind, round, doc)`` of each :meth:`exchange` call.
        calls: the names of the writing methods called, in order.
    """

    keeps_job_state = True

    def __init__(self, node_id: str = "node0", job: JobState | None = None) -> None:
        self.node_id = node_id
        self.job = replace(job or JobState(), node=node_id)
        self.lost: tuple[str, ...] = ()
        self.nodes_lost = 0
        self.nodes_new = 0
        self.records: dict[str, dict] = {}
        self.calls: list[str] = []
        self.peer_docs: dict[str, dict[str, dict]] = {}
        self.exchanged: list[tuple[str, int, dict]] = []

    def state(self) -> JobState:
        return self.job

    def num_nodes_lost(self) -> int:
        return self.nodes_lost

    def num_nodes_new(self) -> int:
        return self.nodes_new

    def record_failure(self, failure: FailureRecord) -> JobState:
        self.calls.append("record_failure")
        if self.lost:
            return replace(self.job, lost=self.lost)
        known = self.job.failure
        if not self.job.failed and (known is None or known.round < failure.round):
            self.job = replace(self.job, failure=failure, restarts=self.job.restarts + 1,
                               blame=(*self.job.blame, self.node_id))
        return self.job

    def fail_job(self, failure: FailureRecord) -> FailureRecord:
        self.calls.append("fail_job")
        if not self.job.failed:
            self.job = replace(self.job, failed=True, closed=True, failure=self.job.failure or failure)
        return self.job.failure or failure

    def succeed_job(self) -> None:
        self.calls.append("succeed_job")
        if not (self.job.failed or self.job.succeeded):
            self.job = replace(self.job, succeeded=True, closed=True)

    def sit_out(self) -> None:
        self.calls.append("sit_out")

    def acknowledge_failure(self) -> None:
        self.calls.append("acknowledge_failure")

    def publish_node_record(self, kind: str, doc: dict) -> None:
        self.records[kind] = doc

    def exchange(self, kind: str, round: int, doc: dict, timeout: float) -> dict[str, dict]:
        """This node's ``doc`` and the scripted ``peer_docs[kind]`` (node id -> document); noted in ``exchanged``."""
        self.exchanged.append((kind, round, doc))
        return {**self.peer_docs.get(kind, {}), self.node_id: doc}

    def request_stack_dump(self, by: FailureRecord) -> int:
        self.calls.append("request_stack_dump")
        self.job = replace(self.job, dump_id=self.job.dump_id + 1, dump_by=by)
        return self.job.dump_id

    def acknowledge_dump(self, dump_id: int) -> None:
        self.calls.append("acknowledge_dump")

    def await_dump_acknowledgements(self, dump_id: int, timeout: float) -> list[str]:
        return []


def publish(channel: JobChannel, kind: str, doc: dict) -> threading.Thread | None:
    """Publish ``doc`` as this node's ``kind`` record on a daemon thread; never raises.

    For every part of an agent that keeps a record for ``elaunch status`` (the agent's
    ``agent`` and ``stacks`` records, the checkpoint keeper's ``checkpoint`` record). A status aid, not the job's business: the agent's loop never waits for it (an
    unreachable etcd would hold a write for up to ``read_timeout`` seconds).

    Returns:
        The thread writing it, or None for a channel without job state (static, standalone,
        plugin handlers: no thread is started).
    """
    if not channel.keeps_job_state:
        return None

    def write() -> None:
        try:
            channel.publish_node_record(kind, doc)
        except Exception as exc:  # noqa: BLE001 - a status aid must never end the agent's thread noisily
            log.debug("could not publish the %s record: %s", kind, exc)

    thread = threading.Thread(target=write, name=f"elaunch-publish-{kind}", daemon=True)
    thread.start()
    return thread
