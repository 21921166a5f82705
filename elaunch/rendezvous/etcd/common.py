"""What the etcd v2 and v3 clients share: conf keys, the KV interface, endpoint fail-over.

Stdlib only (the clients are imported by ``etcd.v2`` / ``etcd.v3``). A backend
module implements :class:`EtcdKV` (get / compare-and-set / wait on one key), usually
through :class:`FailoverKV`; ``etcd.base`` builds the dynamic rendezvous on it
(:class:`EtcdStateBackend`, :class:`EtcdRoundStores`, :func:`build_handler`).

Key layout under ``{etcd_prefix}/{run_id}/``: ``state`` (the rendezvous state,
JSON), ``heartbeat/{node_id}`` (each node's heartbeat, its own key),
``nodes/{node_id}`` (v3 presence keys on leases), ``round/{n}/master_endpoint``
(and on v3 ``round/{n}/done``, the round's completion notice: keys written once,
which a standing watch on ``round/`` delivers; and ``round/state_written``, put with
every write of the state) and ``exit_barrier/{n}``.
"""

from __future__ import annotations

import abc
import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Any

from elaunch.rendezvous.contract import (
    RendezvousConfigError,
    RendezvousConnectionError,
    RendezvousError,
    RendezvousParameters,
)
from elaunch.rendezvous.dynamic.backend import Token
from elaunch.rendezvous.endpoint import parse_endpoints

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
        endpoints=parse_endpoints(params.endpoint, DEFAULT_PORT, bare_ipv6=True),
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

    def get_when_written(self, key: str, timeout: float) -> bytes | None:
        """Return the value of ``key``, a key written once, waiting up to ``timeout`` seconds for it to exist.

        Returns:
            The value, or None when ``key`` was not written within ``timeout``.

        Raises:
            RendezvousConnectionError: etcd is unreachable.
        """
        deadline = time.monotonic() + timeout
        while True:
            data, token = self.get(key)
            if data is not None:
                return data
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            self.wait(key, token, min(left, 1.0))

    def close(self) -> None:
        """Release the client (leases, threads)."""


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

    def _dropped(self, index: int, client: Any) -> bool:
        """Whether ``client`` is no longer endpoint ``index``'s client (:meth:`_drop_client` closed it)."""
        with self._lock:
            return self._clients.get(index) is not client

    def _describe(self, exc: BaseException) -> str:
        """One line naming a client error for messages (subclasses translate their client's errors)."""
        return first_line(exc)

    def call(self, what: str, fn: Any, timeout: float | None = None) -> Any:
        """Run ``fn(client)``; on transient errors try the next endpoint until ``timeout`` s passed.

        Raises:
            RendezvousConnectionError: no endpoint answered within ``timeout``
                (default ``read_timeout``) seconds; names the endpoints and last error.
            RendezvousConfigError: credentials or server setup are wrong; names the endpoint.
        """
        limit = self.conf.read_timeout if timeout is None else timeout
        deadline = time.monotonic() + limit
        delay = 0.05
        while True:
            index = self._current
            host, port = self.conf.endpoints[index]
            client = None
            try:
                client = self._client()  # may fail too (pyetcd authenticates as it connects)
                return fn(client)
            except RendezvousError:
                raise
            except Exception as exc:  # noqa: BLE001 - sorted by _classify, re-raised if foreign
                kind = self._classify(exc)
                if kind is None and client is not None and self._dropped(index, client):
                    # another thread closed this client while fn used it (it saw the endpoint fail):
                    # grpc then raises ValueError("Cannot invoke RPC on closed channel!"); use a new one
                    kind = "reconnect"
                where = f"{self.backend} rendezvous: etcd at {host}:{port}"
                if kind is None:
                    raise
                if kind == "config":
                    raise RendezvousConfigError(f"{where}: {what} failed: {self._describe(exc)}") from exc
                self._drop_client(index)
                if kind == "retry":
                    self._current = (index + 1) % len(self.conf.endpoints)
                if time.monotonic() >= deadline:
                    raise RendezvousConnectionError(
                        f"{self.backend} rendezvous: etcd at {self.endpoint} unreachable: {what} failed "
                        f"within {'read_timeout=' if timeout is None else ''}{limit:g} s: {self._describe(exc)}") from exc
                log.debug("%s: %s failed (%s); retrying", where, what, self._describe(exc))
                if self._current == 0 or len(self.conf.endpoints) == 1:
                    time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
                    delay = min(delay * 2, 1.0)

    def close(self) -> None:
        for index in list(self._clients):
            self._drop_client(index)
