"""The base of the etcd-v2 and etcd-v3 rendezvous: state backend, round stores, outage tolerance, handler.

Built on any :class:`~elaunch.rendezvous.etcd.common.EtcdKV` (``etcd.v2``,
``etcd.v3``): :class:`EtcdStateBackend` stores the rendezvous state in one key,
:class:`EtcdRoundStores` publishes each round's workers' store, and
:func:`build_handler` assembles the handler (``v2.py`` and ``v3.py`` each bring
their client). Stdlib only.
"""

from __future__ import annotations

import logging
import socket
import time
from typing import Any, Callable

from elaunch.rendezvous.contract import NodeInfo, RendezvousConnectionError, RendezvousParameters
from elaunch.rendezvous.dynamic.backend import RendezvousBackend, Token
from elaunch.rendezvous.dynamic.handler import DynamicRendezvousHandler, RoundStoreFactory, RoundStores
from elaunch.rendezvous.dynamic.settings import RendezvousSettings
from elaunch.rendezvous.etcd.common import DEFAULT_READ_TIMEOUT, EtcdConf, EtcdKV
from elaunch.rendezvous.standalone import free_port

log = logging.getLogger(__name__)


class EtcdStateBackend(RendezvousBackend):
    """The dynamic rendezvous state in one etcd key, written with compare-and-set on its revision.

    Mirrors torch's ``EtcdRendezvousBackend`` (token = modified index / mod_revision).

    Args:
        kv: the client.
        key: the state key.
        name: the registry name (``etcd``, ``etcd-v2``, ``etcd-v3``).
    """

    def __init__(self, kv: EtcdKV, key: str, name: str) -> None:
        self.kv = kv
        self.key = key
        self._name = name

    @property
    def name(self) -> str:
        return self._name

    def get_state(self) -> tuple[bytes | None, Token]:
        return self.kv.get(self.key)

    def set_state(self, state: bytes, token: Token | None) -> tuple[bytes, Token, bool] | None:
        new_token = self._write_state(state, token)
        if new_token is not None:
            return state, new_token, True
        data, current = self.get_state()
        if data is None:
            return None
        return data, current, False

    def _write_state(self, state: bytes, token: Token | None) -> Token | None:
        """Compare-and-set the state key; its new token, or None when ``token`` was stale."""
        return self.kv.cas(self.key, state, token)

    def wait_for_change(self, token: Token | None, timeout: float) -> bool:
        """Block until the state changes after ``token`` or ``timeout`` seconds pass (a watch); True."""
        self.kv.wait(self.key, token, timeout)
        return True

    # per-node documents for `elaunch status`: ``{base}/{kind}/{node}`` beside the state key,
    # written like it (TTL / lease of ``ttl`` seconds), never part of it

    def _node_key(self, kind: str, node_id: str) -> str:
        return f"{self.key.rpartition('/')[0]}/{kind}/{node_id}"

    def put_node_key(self, kind: str, node_id: str, data: bytes) -> None:
        key = self._node_key(kind, node_id)
        for _ in range(8):  # only this node writes its key: a lost race is a retry of a stale read
            _old, token = self.kv.get(key)
            if self.kv.cas(key, data, token) is not None:
                return

    def get_node_keys(self, kind: str, nodes) -> dict[str, bytes]:
        out: dict[str, bytes] = {}
        for node in nodes:
            data, _token = self.kv.get(self._node_key(kind, node))
            if data is not None:
                out[node] = data
        return out


class EtcdRoundStores(RoundStoreFactory):
    """Per round: worker rank 0 hosts the workers' store on a fresh port of the rank-0 node.

    The rank-0 agent picks a free port on its ``local_addr`` and publishes
    ``addr:port`` in ``{base}/round/{n}/master_endpoint``; the others read it. No
    agent imports torch (``use_agent_store=False``, as torchrun's etcd handler).

    Args:
        kv: the client.
        base: ``{prefix}/{run_id}``.
        local_addr: this node's address.
        read_timeout: seconds to wait for rank 0's publication.
    """

    def __init__(self, kv: EtcdKV, base: str, local_addr: str, read_timeout: float,
                 on_close: tuple[Callable[[], None], ...] = ()) -> None:
        self.kv = kv
        self._on_close = on_close
        self._base = base
        self._local_addr = local_addr
        self._read_timeout = read_timeout
        self._port: int | None = None  # the last round's master port here: never handed out twice in a row

    def _key(self, round: int, name: str) -> str:
        return f"{self._base}/round/{round}/{name}"

    def setup_round(self, round: int, rank: int, world_size: int, nodes: tuple[NodeInfo, ...]) -> RoundStores:
        """Publish (rank 0) or read (others, waiting up to ``read_timeout`` s) the round's MASTER_ADDR:PORT.

        Raises:
            RendezvousConnectionError: etcd is unreachable, or nothing was published in time.
        """
        key = self._key(round, "master_endpoint")
        data = None
        if rank == 0:
            port = self._port = free_port(self._local_addr, avoid=self._port)
            value = f"{self._local_addr}:{port}".encode()
            if self.kv.cas(key, value, None) is not None:
                data = value
        if data is None:  # not rank 0, or a retry of its setup found its first publication
            data = self.kv.get_when_written(key, self._read_timeout)
        if data is None:
            raise RendezvousConnectionError(
                f"etcd at {self.kv.endpoint}: round {round}'s master address ({key}) was not "
                f"published within read_timeout={self._read_timeout:g} s")
        addr, _, port_s = data.decode().rpartition(":")
        return RoundStores(addr, int(port_s), False, None)

    def exit_barrier(self, round: int, rank: int, world_size: int, timeout: float) -> None:
        """Count this node in ``exit_barrier/{n}`` and wait up to ``timeout`` s for all.

        Raises:
            RendezvousConnectionError: etcd is unreachable.
        """
        key = f"{self._base}/exit_barrier/{round}"  # not under round/: v3's standing watch would carry every count
        deadline = time.monotonic() + timeout
        while True:  # increment with compare-and-set
            data, token = self.kv.get(key)
            count = int(data or b"0") + 1
            if self.kv.cas(key, str(count).encode(), token) is not None:
                break
        while count < world_size:
            left = deadline - time.monotonic()
            if left <= 0:
                log.warning("exit barrier: %d of %d nodes of round %d arrived within %g s; leaving",
                            count, world_size, round, timeout)
                return
            data, token = self.kv.get(key)
            count = int(data or b"0")
            if count < world_size:
                self.kv.wait(key, token, min(left, 1.0))

    def close(self) -> None:
        """Run the ``on_close`` callbacks (e.g. revoke the node's lease), then close the client."""
        for fn in self._on_close:
            try:
                fn()
            except Exception as exc:  # noqa: BLE001 - shutdown is best effort
                log.debug("etcd round stores: close callback failed: %s", exc)
        self.kv.close()


class OutageTolerance:
    """Rides out short etcd outages while workers run (a ``DynamicJobChannel`` ``tolerate``).

    A monitor read that cannot reach etcd returns its fallback (and logs once), so
    running workers are not killed because etcd is briefly away. An agent cannot
    tell an etcd outage from its own partition (a cut link), so the tolerance is
    bounded: once etcd has been unreachable for ``outage_timeout`` seconds the
    error is raised and the agent stops its workers and fails, rather than hang
    while the others re-form without it.

    Args:
        outage_timeout: seconds of tolerated unreachability (conf ``outage_timeout``).
    """

    def __init__(self, outage_timeout: float) -> None:
        self._outage_timeout = outage_timeout
        self._last_reached = time.monotonic()
        self._warned = False

    def reached(self) -> None:
        """etcd answered (a round formed): the outage clock starts again."""
        self._last_reached = time.monotonic()

    def __call__(self, read: Callable[[], Any], fallback: Any = 0) -> Any:
        """Return ``read()``; within ``outage_timeout`` s of the last answer, ``fallback`` when etcd is away.

        Raises:
            RendezvousConnectionError: etcd has been unreachable for ``outage_timeout`` seconds or more.
        """
        try:
            n = read()
        except RendezvousConnectionError as exc:
            away = time.monotonic() - self._last_reached
            if away >= self._outage_timeout:
                raise RendezvousConnectionError(
                    f"{exc} (unreachable for {away:.0f} s, more than outage_timeout={self._outage_timeout:g} s)"
                ) from exc
            if not self._warned:
                log.warning("etcd unreachable while workers run (%s); they keep running for up to "
                            "outage_timeout=%g s", exc, self._outage_timeout)
            self._warned = True
            return fallback
        self._warned = False
        self._last_reached = time.monotonic()
        return n


class EtcdRendezvousHandler(DynamicRendezvousHandler):
    """The dynamic handler, tolerant of etcd outages while workers run (:class:`OutageTolerance`).

    ``num_nodes_waiting`` and its job channel's lost and new counts return 0 (and
    log), its job state the last one read, while etcd cannot be reached for less
    than ``outage_timeout`` seconds.

    Args:
        outage_timeout: seconds of tolerated unreachability (conf ``outage_timeout``).
        (others as DynamicRendezvousHandler)
    """

    def __init__(self, *args, outage_timeout: float = 2 * DEFAULT_READ_TIMEOUT, **kwargs) -> None:
        self._outage = OutageTolerance(outage_timeout)
        super().__init__(*args, tolerate=self._outage, **kwargs)

    def num_nodes_waiting(self) -> int:
        return self._outage(super().num_nodes_waiting)

    def next_rendezvous(self):
        info = super().next_rendezvous()
        self._outage.reached()
        return info


def build_handler(params: RendezvousParameters, conf: EtcdConf, kv: EtcdKV, name: str,
                  backend: EtcdStateBackend | None = None,
                  settings: RendezvousSettings | None = None,
                  on_close: tuple[Callable[[], None], ...] = (), supervisor=None) -> EtcdRendezvousHandler:
    """Assemble the handler of an etcd backend from its client (``supervisor``: as the handler's).

    Raises:
        RendezvousConfigError: a bad conf value.
    """
    base = f"{conf.prefix}/{params.run_id}"
    settings = settings or RendezvousSettings.from_params(params)
    local_addr = params.local_addr or socket.getfqdn()
    backend = backend or EtcdStateBackend(kv, f"{base}/state", name)
    stores = EtcdRoundStores(kv, base, local_addr, conf.read_timeout, on_close)
    node = NodeInfo(local_addr, params.role, params.local_world_size)
    return EtcdRendezvousHandler(node, settings, backend, stores, outage_timeout=conf.outage_timeout,
                                 supervisor=supervisor)
