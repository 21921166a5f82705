"""``etcd`` / ``etcd-v2`` rendezvous: the dynamic rendezvous over etcd's v2 API (python-etcd).

Mirrors torchrun's ``etcd`` and ``etcd-v2`` backends and their ``--rdzv-conf`` keys
(``protocol``, ``ssl_cert``, ``ssl_cert_key``, ``ca_cert``, torch's legacy
``cert``/``key``/``cacert``, ``read_timeout``, ``etcd_prefix``, ``timeout``,
``last_call_timeout``); both names run elaunch's shared dynamic rendezvous (torch's
``etcd`` ran an older, separate state machine). etcd 3.4 serves the v2 API only
with ``--enable-v2``; etcd 3.6 removed it: use ``etcd-v3`` there.

The state lives in ``{etcd_prefix}/{run_id}/state`` (base64 JSON, TTL ``ttl``
seconds, refreshed by every write), compared on its ``modifiedIndex``; waiting
agents long-poll it (``?wait=true``) instead of re-reading. Each node's heartbeat
is its own key ``{etcd_prefix}/{run_id}/heartbeat/{node}`` (its time as text, a
plain write with the same TTL), so two beating nodes never contend for the state.
Reach this module through ``elaunch.rendezvous.registry`` only: it imports python-etcd.
"""

from __future__ import annotations

import http.client
from base64 import b64decode, b64encode
from dataclasses import replace
from collections.abc import Sequence
from typing import Any

from elaunch.rendezvous.contract import RendezvousParameters, RendezvousStateError
from elaunch.rendezvous.dynamic.backend import Token
from elaunch.rendezvous.dynamic.settings import RendezvousSettings
from elaunch.rendezvous.etcd.common import (
    EtcdConf,
    FailoverKV,
    import_client,
    parse_conf,
)
from elaunch.rendezvous.etcd.base import EtcdRendezvousHandler, EtcdStateBackend, build_handler

#: A heartbeat read of at most this many nodes reads their keys one by one (the
#: monitor's: its own and its ring neighbours'); more read the directory at once.
KEYS_READ_ONE_BY_ONE = 4


class EtcdV2KV(FailoverKV):
    """Single-key get / compare-and-set / wait over the v2 HTTP API, with endpoint fail-over.

    Values are stored base64-encoded (as torch's ``EtcdRendezvousBackend``), with a
    TTL of ``conf.ttl`` seconds. Tokens are ``modifiedIndex`` ints.

    Args:
        conf: connection settings (endpoints, TLS, auth, read timeout in seconds).
        backend: the registry name, for messages.
    """

    def __init__(self, conf: EtcdConf, backend: str = "etcd-v2") -> None:
        super().__init__(conf, backend)
        self._etcd = import_client("etcd", backend)
        import urllib3.exceptions

        self._urllib3 = urllib3.exceptions

    def _make_client(self, host: str, port: int) -> Any:
        c = self.conf
        cert: Any = (c.ssl_cert, c.ssl_cert_key) if c.ssl_cert and c.ssl_cert_key else c.ssl_cert
        return self._etcd.Client(host=host, port=port, protocol=c.protocol, read_timeout=max(1, int(c.read_timeout)),
                                 cert=cert, ca_cert=c.ca_cert, username=c.user, password=c.password,
                                 allow_reconnect=False)

    def _classify(self, exc: BaseException) -> str | None:
        e = self._etcd
        if isinstance(exc, e.EtcdInsufficientPermissions):
            return "config"
        if isinstance(exc, (e.EtcdConnectionFailed, e.EtcdLeaderElectionInProgress, e.EtcdWatchTimedOut,
                            self._urllib3.HTTPError, http.client.HTTPException, OSError)):
            return "retry"
        if isinstance(exc, e.EtcdException):
            text = str(exc)
            if "decode" in text or "404" in text:
                return "config"  # the v2 API answers 404 when etcd runs without --enable-v2
            return "retry"
        return None

    def _hint(self, what: str) -> str:
        return f"{what} (is etcd running with --enable-v2? etcd >= 3.6 has no v2 API: use --rdzv-backend=etcd-v3)"

    @staticmethod
    def _decode(result: Any) -> tuple[bytes, Token]:
        try:
            return b64decode(result.value.encode(), validate=True), int(result.modifiedIndex)
        except (ValueError, TypeError, AttributeError) as exc:
            raise RendezvousStateError(f"etcd key {result.key}: value is not base64 (corrupt)") from exc

    def get(self, key: str) -> tuple[bytes | None, Token]:
        def op(client: Any) -> tuple[bytes | None, Token]:
            try:
                return self._decode(client.read(key))
            except self._etcd.EtcdKeyNotFound:
                return None, None

        return self.call(self._hint(f"reading {key}"), op)

    def cas(self, key: str, value: bytes, token: Token | None) -> Token | None:
        kwargs: dict[str, Any] = {"prevExist": False} if token is None else {"prevIndex": int(token)}
        encoded = b64encode(value).decode()

        def op(client: Any) -> Token | None:
            try:
                return int(client.write(key, encoded, ttl=self.conf.ttl, **kwargs).modifiedIndex)
            except (self._etcd.EtcdAlreadyExist, self._etcd.EtcdCompareFailed, self._etcd.EtcdKeyNotFound):
                return None

        return self.call(self._hint(f"writing {key}"), op)

    def put_text(self, key: str, text: str) -> None:
        """Write ``text`` to ``key`` unconditionally (TTL ``conf.ttl``): one request, no compare."""
        self.call(self._hint(f"writing {key}"), lambda client: client.write(key, text, ttl=self.conf.ttl))

    def get_texts(self, keys: Sequence[str]) -> dict[str, str]:
        """Read ``keys`` one request each; a missing key is left out."""
        def op(client: Any) -> dict[str, str]:
            out: dict[str, str] = {}
            for key in keys:
                try:
                    out[key] = client.read(key).value
                except self._etcd.EtcdKeyNotFound:
                    continue
            return out

        return self.call(self._hint(f"reading {len(keys)} key(s)"), op)

    def get_dir(self, directory: str) -> dict[str, str]:
        """Read every key under ``directory`` in one recursive request: ``{name after the directory: text}``."""
        prefix = directory.rstrip("/") + "/"

        def op(client: Any) -> dict[str, str]:
            try:
                result = client.read(prefix.rstrip("/"), recursive=True)
            except self._etcd.EtcdKeyNotFound:
                return {}
            return {r.key[len(prefix):]: r.value for r in result.leaves
                    if not r.dir and r.key.startswith(prefix) and r.value is not None}

        return self.call(self._hint(f"reading {directory}"), op)

    def wait(self, key: str, token: Token | None, timeout: float) -> None:
        """Long-poll ``key`` for a change after index ``token``; return after ``timeout`` s at most."""
        try:
            kwargs: dict[str, Any] = {"wait": True, "timeout": max(0.05, timeout)}
            if token is not None:
                kwargs["waitIndex"] = int(token) + 1
            self._client().read(key, **kwargs)
        except Exception:  # noqa: BLE001 - a wait only shortens polling; the next read reports errors
            pass


class EtcdV2StateBackend(EtcdStateBackend):
    """The state key plus per-node heartbeat keys ``{base}/heartbeat/{node}`` (like c10d's and etcd-v3's).

    A heartbeat is one unconditional write of the node's own key (TTL ``ttl``, far
    longer than any liveness rule; it expires ``ttl`` s after the node's last beat,
    so the keys a job leaves are bounded by its nodes). Reading a few nodes' beats
    (the monitor's: itself and its ring neighbours) costs a request per key; more
    (a join, ``elaunch status``) read the directory in one recursive request.

    Args:
        kv: the client.
        key: the state key (``{base}/state``).
    """

    def __init__(self, kv: EtcdV2KV, key: str, name: str = "etcd-v2") -> None:
        super().__init__(kv, key, name)
        self._beats = f"{key.rpartition('/')[0]}/heartbeat"

    @property
    def cheap_heartbeats(self) -> bool:
        return False  # a raft write: beat at heartbeat_interval, no faster

    def put_heartbeat(self, node_id: str, at: float) -> None:
        assert isinstance(self.kv, EtcdV2KV)
        self.kv.put_text(f"{self._beats}/{node_id}", repr(at))

    def get_heartbeats(self, nodes: Sequence[str]) -> dict[str, float]:
        assert isinstance(self.kv, EtcdV2KV)
        if not nodes:
            return {}
        if len(nodes) <= KEYS_READ_ONE_BY_ONE:
            found = {k.rpartition("/")[2]: v for k, v in self.kv.get_texts([f"{self._beats}/{n}" for n in nodes]).items()}
        else:
            found = self.kv.get_dir(self._beats)
        out: dict[str, float] = {}
        for node in nodes:
            try:
                out[node] = float(found[node])
            except (KeyError, TypeError, ValueError):
                continue  # none (yet) or not ours: the state's own heartbeat stands
        return out

    def get_state_and_heartbeats(self, nodes: Sequence[str]) -> tuple[bytes | None, Token, dict[str, float]]:
        # two requests (the v2 API has no multi-key read): the state first, so no beat read is older than it
        data, token = self.get_state()
        return data, token, self.get_heartbeats(nodes)


def create_handler(params: RendezvousParameters, supervisor=None) -> EtcdRendezvousHandler:
    """Build an ``etcd``/``etcd-v2`` dynamic rendezvous handler (torch ``etcd_rendezvous_backend``).

    Conf keys: see :func:`elaunch.rendezvous.etcd.common.parse_conf` (endpoints,
    TLS, auth, ``read_timeout``, ``etcd_prefix``, ``ttl``) and the dynamic
    rendezvous' timeouts (:class:`RendezvousSettings`); torch's legacy ``timeout``
    key is the join timeout in seconds when ``join_timeout`` is not given. ``supervisor``: the
    launch's ``elaunch.supervision.Supervisor``, which runs the keep-alive thread (None: the handler's own).

    Raises:
        RendezvousConfigError: bad conf value, or python-etcd missing (``pip install 'elaunch[etcd]'``).
    """
    if params.get("timeout") is not None and "join_timeout" not in params.config:
        params = replace(params, config={**params.config, "join_timeout": params.config["timeout"]})
    conf = parse_conf(params)
    name = params.backend or "etcd-v2"
    kv = EtcdV2KV(conf, name)
    backend = EtcdV2StateBackend(kv, f"{conf.prefix}/{params.run_id}/state", name)
    return build_handler(params, conf, kv, name, backend=backend, settings=RendezvousSettings.from_params(params),
                         supervisor=supervisor)


