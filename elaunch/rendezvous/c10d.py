"""c10d rendezvous: the dynamic rendezvous over a TCPStore hosted by one agent.

Mirrors torch's ``c10d_rendezvous_backend`` (conf keys ``is_host``,
``store_type``, ``read_timeout``, ``use_libuv``; default port 29400) with the
dynamic rendezvous of ``elaunch.rendezvous.dynamic``. Reach it only through
``elaunch.rendezvous.registry``.

The agent store itself (hosting or reaching it, in a background thread for the
agent's own launch) is in ``c10d_agent_store.py``; torch is imported where a store is made.

Deliberate change from torchrun: every round, the group-rank-0 agent hosts a NEW
workers' TCPStore (MASTER_ADDR/MASTER_PORT) and publishes its address in the
round's namespace of the agent store. torchrun reuses one store for the whole
job, so restarted workers read the dead workers' gloo addresses, and a node that
joins on scale-up never sees MASTER_ADDR republished.
"""

from __future__ import annotations

import datetime
import logging
import socket
from collections.abc import Sequence
from typing import Any

import os

# TCPStore's C++ warnings (with stack frames) would reach the user when a peer or
# the store host goes away; elaunch reports those failures itself, in one line.
# Only the agent is affected: launch() snapshots the workers' env before this import.
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")

from elaunch.rendezvous.contract import (
    NodeInfo,
    RendezvousConfigError,
    RendezvousParameters,
)
from elaunch.rendezvous.c10d_agent_store import AgentStore, make_agent_store
from elaunch.rendezvous.c10d_store import _GRACE, _STORE_ERRORS, BoundedStore, StoreLine, _translated
from elaunch.rendezvous.dynamic.backend import RendezvousBackend, Token
from elaunch.rendezvous.c10d_rounds import C10dRoundStores
from elaunch.rendezvous.dynamic.handler import DynamicRendezvousHandler
from elaunch.rendezvous.dynamic.settings import RendezvousSettings
from elaunch.rendezvous.endpoint import parse_endpoint

log = logging.getLogger(__name__)

#: Port of the agent store when the endpoint names none (torch's default).
DEFAULT_PORT = 29400
#: Default seconds a store operation (and a client's connection attempts) may take.
DEFAULT_READ_TIMEOUT = 60.0
#: Stored in the state key until the first node writes a state.
_EMPTY = b"elaunch:empty"


class C10dBackend(RendezvousBackend):
    """The rendezvous state in a torch Store key, written with ``compare_set``.

    The token is the stored bytes themselves (as torch's C10dRendezvousBackend).

    Args:
        store: a torch Store (TCPStore or FileStore).
        run_id: the job id; the state lives under ``elaunch/rdzv/{run_id}/state``.
        endpoint: the store's address, for error messages.
        create: write the empty-state marker when the key is missing (agents); False
            for a reader that must write nothing (``elaunch status``: it checks
            :meth:`exists` first, as a get of a missing key blocks).

    Raises:
        RendezvousConnectionError: the store cannot be reached.
    """

    def __init__(self, store: Any, run_id: str, endpoint: str, create: bool = True) -> None:
        self._store = store
        # the keep-alive thread's heartbeats skip BoundedStore's hand-off (see ``beat``)
        self._direct = store.store if isinstance(store, BoundedStore) else store
        self._endpoint = endpoint
        self._prefix = run_prefix(run_id)
        self.key = state_key(run_id)
        self._forgotten = -1  # the newest round this node deleted the keys of
        if create:
            initialise_state(store, run_id, endpoint)

    def never_reached(self) -> bool:
        """True while the agent store made in the background (``AgentStore``) is not made, or once that failed."""
        return not getattr(self._direct, "made", True)

    def exists(self) -> bool:
        """True when the state key exists (an agent of this run id reached the store). Writes nothing.

        Raises:
            RendezvousConnectionError: the store cannot be reached.
        """
        with _translated(self._endpoint, "checking the state key"):
            return bool(self._store.check([self.key]))

    @property
    def name(self) -> str:
        return "c10d"

    def get_state(self) -> tuple[bytes | None, Token]:
        with _translated(self._endpoint, "reading the state"):
            data = bytes(self._store.get(self.key))
        return (None if data == _EMPTY else data), data

    def set_state(self, state: bytes, token: Token | None) -> tuple[bytes, Token, bool] | None:
        expected = _EMPTY if token is None else token
        with _translated(self._endpoint, "writing the state"):
            current = bytes(self._store.compare_set(self.key, expected, state))
        if current == _EMPTY:
            return None
        return current, current, current == state

    # Batched joins (see dynamic/batching.py): round r's intent log is the key
    # ``intents/r``, grown with the store's atomic ``append``; ``tickets/r`` counts the
    # joins (``add``; ticket 1 is the combiner); every post (and the notice) sets
    # ``arrived/r``, which the combiner, the only node that waits on it, deletes each
    # time it wakes; the log's position is the ticket count. The round's completion
    # notice is ``done/r``. A blocked ``wait`` sees a key the moment it is set. These
    # four keys are all a round leaves behind: :meth:`forget_round` deletes them.

    @property
    def supports_intents(self) -> bool:
        return True

    def post_intent(self, round: int, intent: bytes) -> bool:
        with _translated(self._endpoint, "posting a join intent"):
            self._store.append(f"{self._prefix}/intents/{round}", intent)
            ticket = int(self._store.add(f"{self._prefix}/tickets/{round}", 1))
            self._store.set(f"{self._prefix}/arrived/{round}", b"1")
        return ticket == 1

    def get_state_and_intents(self, round: int, nodes: Sequence[str] = ()
                              ) -> tuple[bytes | None, Token, bytes, int, dict[str, float]]:
        # Called after our own post to ``round``, so its keys exist unless the round was
        # forgotten since: we are two rounds behind (frozen, or pruned as dead meanwhile).
        # A get of a missing key blocks, so that rare reader waits read_timeout, then finds
        # the keys gone and reads the state alone; checking first would cost every read a call.
        round_keys = [f"{self._prefix}/intents/{round}", f"{self._prefix}/tickets/{round}"]
        with _translated(self._endpoint, "reading the state"):
            if round <= self._forgotten:
                return self._without_log(nodes)
            try:
                values = [bytes(v) for v in self._store.multi_get([self.key] + round_keys
                                                                  + self._heartbeat_keys(nodes))]
            except _STORE_ERRORS:
                if self._store.check(round_keys):
                    raise
                return self._without_log(nodes)  # forgotten: the state shows the round is over
        data, log_bytes, tickets = values[:3]
        return (None if data == _EMPTY else data), data, log_bytes, int(tickets), _heartbeats(nodes, values[3:])

    def _without_log(self, nodes: Sequence[str]) -> tuple[bytes | None, Token, bytes, int, dict[str, float]]:
        """A forgotten round's log reads as empty: the state itself shows the round is long over."""
        data, token, heartbeats = self.get_state_and_heartbeats(nodes)
        return data, token, b"", 0, heartbeats

    # Heartbeats: node n's is the key ``heartbeat/n`` (its time, as text), written
    # before n first appears in the state, so a reader's multi_get never waits.

    @property
    def cheap_heartbeats(self) -> bool:
        return True

    def put_heartbeat(self, node_id: str, at: float) -> None:
        self._set_heartbeat(self._store, node_id, at)

    def beat(self, node_id: str, at: float) -> None:
        # Two thread hand-offs fewer per beat: at 1024 simulated agents on 2 cores the beats
        # (one per agent every 0.375 s) were as many store calls as the round's own.
        self._set_heartbeat(self._direct, node_id, at)

    def _set_heartbeat(self, store: Any, node_id: str, at: float) -> None:
        with _translated(self._endpoint, "writing a heartbeat"):
            store.set(f"{self._prefix}/heartbeat/{node_id}", repr(at))

    def get_heartbeats(self, nodes: Sequence[str]) -> dict[str, float]:
        if not nodes:
            return {}
        with _translated(self._endpoint, "reading heartbeats"):
            values = [bytes(v) for v in self._store.multi_get(self._heartbeat_keys(nodes))]
        return _heartbeats(nodes, values)

    def get_state_and_heartbeats(self, nodes: Sequence[str]) -> tuple[bytes | None, Token, dict[str, float]]:
        with _translated(self._endpoint, "reading the state"):
            values = [bytes(v) for v in self._store.multi_get([self.key] + self._heartbeat_keys(nodes))]
        data = values[0]
        return (None if data == _EMPTY else data), data, _heartbeats(nodes, values[1:])

    def put_node_key(self, kind: str, node_id: str, data: bytes) -> None:
        with _translated(self._endpoint, f"writing {kind}/{node_id}"):
            self._store.set(f"{self._prefix}/{kind}/{node_id}", data)

    def get_node_keys(self, kind: str, nodes: Sequence[str]) -> dict[str, bytes]:
        keys = {n: f"{self._prefix}/{kind}/{n}" for n in nodes}
        with _translated(self._endpoint, f"reading {kind} keys"):
            present = [n for n in nodes if self._store.check([keys[n]])]  # a get of a missing key blocks
            values = self._store.multi_get([keys[n] for n in present]) if present else []
        return {n: bytes(v) for n, v in zip(present, values)}

    def _heartbeat_keys(self, nodes: Sequence[str]) -> list[str]:
        return [f"{self._prefix}/heartbeat/{n}" for n in nodes]

    def wait_for_arrival(self, round: int, position: int, timeout: float) -> bool:
        # One key per round, not per ticket, so a round leaves a constant number of keys.
        # ``position`` is not needed: the key is deleted on waking, before the caller
        # reads the log, so it stands for "posted since the last read". A post that lands
        # between the delete and the read is read now and wakes the next wait at once
        # (one spare read); none is missed, since a post appends before it sets the key.
        key = f"{self._prefix}/arrived/{round}"
        if not self._wait(key, timeout, "waiting for joiners"):
            return False
        with _translated(self._endpoint, "waiting for joiners"):
            self._store.delete_key(key)
        return True

    def notify_round(self, round: int) -> None:
        with _translated(self._endpoint, "announcing the round's completion"):
            self._store.set(f"{self._prefix}/done/{round}", b"1")
            self._store.add(f"{self._prefix}/tickets/{round}", 1)
            self._store.set(f"{self._prefix}/arrived/{round}", b"1")  # wakes the combiner

    def forget_round(self, round: int) -> None:
        # Deletes round ``round``'s four keys (4 store calls, by one node per round).
        self._forgotten = max(self._forgotten, round)
        with _translated(self._endpoint, f"deleting round {round}'s keys"):
            for name in ("intents", "tickets", "arrived", "done"):
                self._store.delete_key(f"{self._prefix}/{name}/{round}")

    def wait_for_round(self, round: int, timeout: float) -> bool:
        return self._wait(f"{self._prefix}/done/{round}", timeout, "waiting for the round")

    def _wait(self, key: str, timeout: float, what: str) -> bool:
        try:
            self._store.wait([key], datetime.timedelta(seconds=timeout))
        except _STORE_ERRORS as exc:
            if "timeout" not in str(exc).lower():
                with _translated(self._endpoint, what):
                    raise
            return False
        return True


def run_prefix(run_id: str) -> str:
    """The prefix of run ``run_id``'s keys in the c10d store."""
    return f"elaunch/rdzv/{run_id}"


def state_key(run_id: str) -> str:
    """The store key of run ``run_id``'s rendezvous state."""
    return f"{run_prefix(run_id)}/state"


def initialise_state(store: Any, run_id: str, endpoint: str) -> None:
    """Write run ``run_id``'s empty-state marker where its state key is missing (an agent's first write).

    Args:
        store: a torch Store.
        endpoint: the store's address, for error messages.

    Raises:
        RendezvousConnectionError: the store cannot be reached.
    """
    with _translated(endpoint, "initialising the state"):
        store.compare_set(state_key(run_id), "", _EMPTY)


def _heartbeats(nodes: Sequence[str], values: list[bytes]) -> dict[str, float]:
    out: dict[str, float] = {}
    for node, value in zip(nodes, values):
        try:
            out[node] = float(value)
        except ValueError:
            continue  # not ours to judge: the state's own heartbeat stands
    return out


def create_handler(params: RendezvousParameters, store_in_background: bool = False,
                   supervisor=None) -> DynamicRendezvousHandler:
    """Build a c10d dynamic rendezvous handler (torch ``c10d_rendezvous_backend.create_backend``).

    With ``store_in_background`` (the agent's own launch) and an endpoint with a port,
    the agent store is hosted or reached in a background thread (:class:`AgentStore`);
    its errors are then raised at the handler's first use of it, not here.

    Conf keys (besides the dynamic rendezvous' timeouts, see RendezvousSettings):
    ``store_type`` (``tcp``, default, or ``file``: the endpoint is a file path),
    ``read_timeout`` (seconds, default 60), ``is_host`` (bool; default: whether the
    endpoint host is this machine), ``use_libuv`` (bool, default true). Like torch's
    c10d backend it does not read ``timeout`` (etcd's join timeout): the registry
    names it in its "does not use" warning.

    Raises:
        RendezvousConfigError: a bad conf value or endpoint; the message names it.
        RendezvousConnectionError: the store cannot be hosted or reached.
    """
    settings = RendezvousSettings.from_params(params)
    read_timeout = params.get_as_seconds("read_timeout", DEFAULT_READ_TIMEOUT)
    use_libuv = bool(params.get_as_bool("use_libuv", True))
    local_addr = params.local_addr or socket.getfqdn()
    store_type = str(params.get("store_type", "tcp")).strip().lower()
    if store_type == "tcp":
        host, port = parse_endpoint(params.endpoint, DEFAULT_PORT, allow_zero=True, bare_ipv6=True)
        assert port is not None
        is_host = params.get_as_bool("is_host")
        background = store_in_background and port != 0  # (port 0: the port is known once the store is hosted)
        agent_store = AgentStore(lambda: make_agent_store(host, port, is_host, local_addr, read_timeout, use_libuv),
                                 after=lambda store: initialise_state(store, params.run_id, f"{host}:{store.port}"),
                                 background=background)
        endpoint = f"{host}:{port if background else agent_store.port}"
    elif store_type == "file":
        endpoint = params.endpoint.strip()
        if not endpoint:
            raise RendezvousConfigError("--rdzv-conf store_type=file: the endpoint must be a file path")

        def file_store() -> tuple[Any, bool]:
            from torch.distributed import FileStore

            with _translated(endpoint, "opening the file store"):
                return FileStore(endpoint), False

        agent_store = AgentStore(file_store, after=lambda store: initialise_state(store, params.run_id, endpoint))
    else:
        raise RendezvousConfigError(f"--rdzv-conf store_type={store_type}: expected tcp or file")
    line = StoreLine()  # the backend's calls and the round stores' go through one client
    # the state key's first write is the agent store's ``after``, in the thread that made it
    backend = C10dBackend(BoundedStore(agent_store, endpoint, read_timeout + _GRACE, line), params.run_id, endpoint,
                          create=False)
    stores = C10dRoundStores(agent_store, params.run_id, local_addr, read_timeout, use_libuv, endpoint, line)
    node = NodeInfo(local_addr, params.role, params.local_world_size)
    return DynamicRendezvousHandler(node, settings, backend, stores, supervisor=supervisor)
