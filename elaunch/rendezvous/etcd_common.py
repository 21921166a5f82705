"""What the etcd v2 and v3 rendezvous backends share: conf keys, the state backend, round stores.

Stdlib only (the clients are imported by ``etcd_v2`` / ``etcd_v3``). A backend
module implements :class:`EtcdKV` (get / compare-and-set / wait on one key) and
gets from here the dynamic-rendezvous :class:`EtcdStateBackend`, the per-round
:class:`EtcdRoundStores` and :func:`build_handler`.

Key layout under ``{etcd_prefix}/{run_id}/``: ``state`` (the rendezvous state,
JSON), ``nodes/{node_id}`` (v3 presence keys on leases), ``round/{n}/master_endpoint``
and ``round/{n}/exit_barrier``.
"""

from __future__ import annotations

import abc
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from elaunch.rendezvous.api import (
    NodeInfo,
    RendezvousConfigError,
    RendezvousConnectionError,
    RendezvousError,
    RendezvousParameters,
)
from elaunch.rendezvous.dynamic.backend import RendezvousBackend, Token
from elaunch.rendezvous.dynamic.handler import DynamicRendezvousHandler, RoundStoreFactory, RoundStores
from elaunch.rendezvous.dynamic.settings import RendezvousSettings
from elaunch.rendezvous.standalone import free_port

log = logging.getLogger(__name__)

#: etcd's client port when an endpoint names none.
DEFAULT_PORT = 2379
#: Seconds an etcd request (with its retries on transient errors) may take (conf ``read_timeout``).
DEFAULT_READ_TIMEOUT = 60.0
#: Seconds the state and round keys live after their last write (conf ``ttl``; torch's 2 hours).
DEFAULT_TTL = 7200
#: Key prefix (conf ``etcd_prefix`` or ``key_prefix``).
DEFAULT_PREFIX = "/elaunch/rdzv"
INSTALL_HINT = "pip install 'elaunch[etcd]'"


def import_client(module: str, backend: str) -> Any:
    """Import an optional etcd client module.

    Raises:
        RendezvousConfigError: it is not installed; one line naming the extra to install.
    """
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise RendezvousConfigError(
            f"--rdzv-backend={backend} needs the Python module {module!r} ({exc}); run: {INSTALL_HINT}"
        ) from exc


@dataclass(frozen=True)
class EtcdConf:
    """The etcd connection settings of ``--rdzv-endpoint`` and ``--rdzv-conf``.

    Attributes:
        endpoints: ``(host, port)`` pairs, in fail-over order.
        protocol: ``http`` or ``https`` (conf ``protocol``; https also when ``ca_cert`` is set).
        ca_cert, ssl_cert, ssl_cert_key: PEM paths or None (conf keys of the same names;
            torch's legacy ``cacert``, ``cert``, ``key`` are accepted too).
        user, password: authentication (conf ``user``/``username`` and ``password``) or None.
        read_timeout: seconds per request including retries (conf ``read_timeout``, 60).
        prefix: key prefix (conf ``etcd_prefix``/``key_prefix``, ``/elaunch/rdzv``).
        ttl: seconds the state key lives after its last write (conf ``ttl``, 7200).
        outage_timeout: seconds a running agent rides out an unreachable etcd before it
            stops its workers and fails (conf ``outage_timeout``, 2 x read_timeout).
    """

    endpoints: tuple[tuple[str, int], ...]
    protocol: str = "http"
    ca_cert: str | None = None
    ssl_cert: str | None = None
    ssl_cert_key: str | None = None
    user: str | None = None
    password: str | None = None
    read_timeout: float = DEFAULT_READ_TIMEOUT
    prefix: str = DEFAULT_PREFIX
    ttl: int = DEFAULT_TTL
    outage_timeout: float = 2 * DEFAULT_READ_TIMEOUT

    @property
    def endpoint_str(self) -> str:
        """The endpoints as ``host:port,host:port`` (for messages)."""
        return ",".join(f"{h}:{p}" for h, p in self.endpoints)


def parse_endpoints(value: str, default_port: int = DEFAULT_PORT) -> tuple[tuple[str, int], ...]:
    """Parse ``host[:port][,host[:port]...]`` (an optional ``http(s)://`` per entry is dropped).

    Raises:
        RendezvousConfigError: empty, or a port that is not an integer in 1..65535.
    """
    out = []
    for raw in (value or "").split(","):
        item = raw.strip()
        for scheme in ("http://", "https://"):
            if item.startswith(scheme):
                item = item[len(scheme):]
        item = item.rstrip("/")
        if not item:
            continue
        if item.startswith("["):  # [ipv6]:port
            host, _, rest = item[1:].partition("]")
            port_s = rest[1:] if rest.startswith(":") else ""
        elif item.count(":") == 1:
            host, _, port_s = item.partition(":")
        else:
            host, port_s = item, ""
        try:
            port = int(port_s) if port_s else default_port
        except ValueError:
            raise RendezvousConfigError(f"--rdzv-endpoint={value}: port {port_s!r} of {raw.strip()!r} is not an integer") from None
        if not 0 < port < 65536 or not host:
            raise RendezvousConfigError(f"--rdzv-endpoint={value}: {raw.strip()!r} is not host[:port] with port in 1..65535")
        out.append((host, port))
    if not out:
        raise RendezvousConfigError(f"--rdzv-endpoint={value!r}: an etcd backend needs host[:port][,host[:port]...]")
    return tuple(out)


def parse_conf(params: RendezvousParameters) -> EtcdConf:
    """Read :class:`EtcdConf` from ``params`` (torch's etcd conf keys plus ``user``/``password``).

    Raises:
        RendezvousConfigError: bad endpoint, protocol, timeout, or a certificate file
            that does not exist; the message names the key and value.
    """
    get = params.get
    ca_cert = get("ca_cert") or get("cacert")
    ssl_cert = get("ssl_cert") or get("cert")
    ssl_key = get("ssl_cert_key") or get("key")
    protocol = str(get("protocol", "https" if ca_cert else "http")).strip().lower()
    if protocol not in ("http", "https"):
        raise RendezvousConfigError(f"--rdzv-conf protocol={protocol}: expected http or https")
    for key, path in (("ca_cert", ca_cert), ("ssl_cert", ssl_cert), ("ssl_cert_key", ssl_key)):
        if path and not os.path.isfile(path):
            raise RendezvousConfigError(f"--rdzv-conf {key}={path}: no such file")
    if ssl_key and not ssl_cert:
        raise RendezvousConfigError(f"--rdzv-conf ssl_cert_key={ssl_key}: needs ssl_cert too")
    user = get("user") or get("username")
    password = get("password")
    if bool(user) != bool(password):
        raise RendezvousConfigError("--rdzv-conf user/password: give both or neither")
    prefix = "/" + str(get("etcd_prefix") or get("key_prefix") or DEFAULT_PREFIX).strip("/")
    read_timeout = params.get_as_seconds("read_timeout", DEFAULT_READ_TIMEOUT)
    ttl = params.get_as_int("ttl", DEFAULT_TTL)
    if ttl is None or ttl <= 0:
        raise RendezvousConfigError(f"--rdzv-conf ttl={get('ttl')}: must be > 0 seconds")
    return EtcdConf(
        endpoints=parse_endpoints(params.endpoint),
        protocol=protocol,
        ca_cert=ca_cert,
        ssl_cert=ssl_cert,
        ssl_cert_key=ssl_key,
        user=user,
        password=password,
        read_timeout=read_timeout,
        prefix=prefix,
        ttl=ttl,
        outage_timeout=params.get_as_seconds("outage_timeout", 2 * read_timeout),
    )


class EtcdKV(abc.ABC):
    """Single-key operations an etcd client offers; tokens are etcd revisions/indexes (ints).

    Implementations retry transient errors within their read timeout and raise
    RendezvousConnectionError (unreachable) or RendezvousConfigError (auth, TLS
    setup) naming the endpoint, chained ``from`` the client's error.
    """

    endpoint: str

    @abc.abstractmethod
    def get(self, key: str) -> tuple[bytes | None, Token]:
        """Return ``(value, token)``; ``(None, None)`` for a missing key."""

    @abc.abstractmethod
    def cas(self, key: str, value: bytes, token: Token | None) -> Token | None:
        """Write ``value`` if ``key`` still has ``token`` (None: if it does not exist).

        Returns:
            The key's new token when written, None when the comparison failed.
        """

    @abc.abstractmethod
    def wait(self, key: str, token: Token | None, timeout: float) -> None:
        """Return when ``key`` changed after ``token``, or after ``timeout`` seconds; never raises."""

    def close(self) -> None:
        """Release the client (leases, threads)."""


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
        new_token = self.kv.cas(self.key, state, token)
        if new_token is not None:
            return state, new_token, True
        data, current = self.get_state()
        if data is None:
            return None
        return data, current, False

    def wait_for_change(self, token: Token | None, timeout: float) -> None:
        """Block until the state changes after ``token`` or ``timeout`` seconds pass (a watch)."""
        self.kv.wait(self.key, token, timeout)


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

    def _key(self, round: int, name: str) -> str:
        return f"{self._base}/round/{round}/{name}"

    def setup_round(self, round: int, rank: int, world_size: int, nodes: tuple[NodeInfo, ...]) -> RoundStores:
        """Publish (rank 0) or read (others, waiting up to ``read_timeout`` s) the round's MASTER_ADDR:PORT.

        Raises:
            RendezvousConnectionError: etcd is unreachable, or nothing was published in time.
        """
        key = self._key(round, "master_endpoint")
        if rank == 0:
            port = free_port(self._local_addr)
            value = f"{self._local_addr}:{port}"
            self.kv.cas(key, value.encode(), None)
        deadline = time.monotonic() + self._read_timeout
        while True:
            data, token = self.kv.get(key)
            if data is not None:
                break
            left = deadline - time.monotonic()
            if left <= 0:
                raise RendezvousConnectionError(
                    f"etcd at {self.kv.endpoint}: round {round}'s master address ({key}) was not "
                    f"published within read_timeout={self._read_timeout:g} s")
            self.kv.wait(key, token, min(left, 1.0))
        addr, _, port_s = data.decode().rpartition(":")
        return RoundStores(addr, int(port_s), False, None)

    def exit_barrier(self, round: int, rank: int, world_size: int, timeout: float) -> None:
        """Count this node in ``round/{n}/exit_barrier`` and wait up to ``timeout`` s for all.

        Raises:
            RendezvousConnectionError: etcd is unreachable.
        """
        key = self._key(round, "exit_barrier")
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


class EtcdRendezvousHandler(DynamicRendezvousHandler):
    """The dynamic handler, tolerant of etcd outages while workers run.

    ``num_nodes_waiting`` and ``num_nodes_lost`` return 0 (and log) when etcd cannot
    be reached, so running workers are not killed because etcd is briefly away. An
    agent cannot tell an etcd outage from its own partition (a cut link), so the
    tolerance is bounded: once etcd has been unreachable for ``outage_timeout``
    seconds the error is raised and the agent stops its workers and fails, rather
    than hang while the others re-form without it.

    Args:
        outage_timeout: seconds of tolerated unreachability (conf ``outage_timeout``).
        (others as DynamicRendezvousHandler)
    """

    _warned = False

    def __init__(self, *args, outage_timeout: float = 2 * DEFAULT_READ_TIMEOUT, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._outage_timeout = outage_timeout
        self._last_reached = time.monotonic()

    def num_nodes_waiting(self) -> int:
        return self._tolerant(super().num_nodes_waiting)

    def num_nodes_lost(self) -> int:
        return self._tolerant(super().num_nodes_lost)

    def next_rendezvous(self):
        info = super().next_rendezvous()
        self._last_reached = time.monotonic()
        return info

    def _tolerant(self, count: Callable[[], int]) -> int:
        try:
            n = count()
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
            return 0
        self._warned = False
        self._last_reached = time.monotonic()
        return n


def build_handler(params: RendezvousParameters, conf: EtcdConf, kv: EtcdKV, name: str,
                  backend: EtcdStateBackend | None = None,
                  settings: RendezvousSettings | None = None,
                  on_close: tuple[Callable[[], None], ...] = ()) -> EtcdRendezvousHandler:
    """Assemble the handler of an etcd backend from its client.

    Raises:
        RendezvousConfigError: a bad conf value.
    """
    base = f"{conf.prefix}/{params.run_id}"
    settings = settings or RendezvousSettings.from_params(params)
    local_addr = params.local_addr or socket.getfqdn()
    backend = backend or EtcdStateBackend(kv, f"{base}/state", name)
    stores = EtcdRoundStores(kv, base, local_addr, conf.read_timeout, on_close)
    node = NodeInfo(local_addr, params.role, params.local_world_size)
    return EtcdRendezvousHandler(node, settings, backend, stores, outage_timeout=conf.outage_timeout)


def first_line(exc: BaseException) -> str:
    """The first non-empty line of ``exc``'s message, or its type name."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


class FailoverKV(EtcdKV):
    """Runs each request on the current endpoint, failing over to the next on transient errors.

    Subclasses build one client per endpoint (``_make_client``) and sort client
    errors (``_classify``): ``"retry"`` (unreachable, leader election, timeout: the
    next endpoint is tried, until ``read_timeout`` seconds passed), ``"reconnect"``
    (e.g. an expired auth token: the client is rebuilt, then retried), ``"config"``
    (bad credentials or server setup: RendezvousConfigError at once) or None
    (not a client error: re-raised as is).

    Args:
        conf: the connection settings.
        backend: the registry name, for messages.
    """

    def __init__(self, conf: EtcdConf, backend: str) -> None:
        self.conf = conf
        self.backend = backend
        self._clients: dict[int, Any] = {}
        self._current = 0
        self._lock = threading.RLock()

    @property
    def endpoint(self) -> str:  # type: ignore[override]
        return self.conf.endpoint_str

    @abc.abstractmethod
    def _make_client(self, host: str, port: int) -> Any:
        """Return a client connected (lazily or not) to ``host:port``."""

    @abc.abstractmethod
    def _classify(self, exc: BaseException) -> str | None:
        """Return ``"retry"``, ``"reconnect"``, ``"config"`` or None for ``exc``."""

    def _client(self) -> Any:
        with self._lock:
            client = self._clients.get(self._current)
            if client is None:
                host, port = self.conf.endpoints[self._current]
                client = self._clients[self._current] = self._make_client(host, port)
            return client

    def _drop_client(self, index: int) -> None:
        with self._lock:
            client = self._clients.pop(index, None)
        close = getattr(client, "close", None)
        if close is not None:
            try:
                close()
            except Exception:  # noqa: BLE001 - closing a broken client is best effort
                pass

    def call(self, what: str, fn: Any, timeout: float | None = None) -> Any:
        """Run ``fn(client)``; on transient errors try the next endpoint until ``timeout`` s passed.

        Raises:
            RendezvousConnectionError: no endpoint answered within ``timeout``
                (default ``read_timeout``) seconds; names the endpoints and last error.
            RendezvousConfigError: credentials or server setup are wrong; names the endpoint.
        """
        deadline = time.monotonic() + (self.conf.read_timeout if timeout is None else timeout)
        delay = 0.05
        while True:
            index = self._current
            host, port = self.conf.endpoints[index]
            try:
                return fn(self._client())
            except RendezvousError:
                raise
            except Exception as exc:  # noqa: BLE001 - sorted by _classify, re-raised if foreign
                kind = self._classify(exc)
                where = f"{self.backend} rendezvous: etcd at {host}:{port}"
                if kind is None:
                    raise
                if kind == "config":
                    raise RendezvousConfigError(f"{where}: {what} failed: {first_line(exc)}") from exc
                self._drop_client(index)
                if kind == "retry":
                    self._current = (index + 1) % len(self.conf.endpoints)
                if time.monotonic() >= deadline:
                    raise RendezvousConnectionError(
                        f"{self.backend} rendezvous: etcd at {self.endpoint} unreachable: {what} failed "
                        f"within read_timeout={self.conf.read_timeout:g} s: {first_line(exc)}") from exc
                log.debug("%s: %s failed (%s); retrying", where, what, first_line(exc))
                if self._current == 0 or len(self.conf.endpoints) == 1:
                    time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
                    delay = min(delay * 2, 1.0)

    def close(self) -> None:
        for index in list(self._clients):
            self._drop_client(index)
