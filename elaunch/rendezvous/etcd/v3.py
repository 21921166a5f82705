"""``etcd-v3`` rendezvous: the dynamic rendezvous over etcd's v3 gRPC API (etcd-sdk-python, ``pyetcd``).

New in elaunch (torchrun only speaks the v2 API, which etcd 3.6 removed): works
against an etcd serving v3 only. Same conf keys as ``etcd-v2`` plus ``user`` /
``password``. Compared with v2:

* compare-and-set is a transaction on the state key's ``mod_revision``;
* each node keeps a presence key ``{etcd_prefix}/{run_id}/nodes/{node_id}`` on its
  own lease (TTL = ``keep_alive_interval * keep_alive_max_attempt`` seconds, kept
  alive by a thread): when an agent dies its key expires and the others see it
  dead at their next read, without waiting for stale heartbeats;
* waiting agents watch the state key and wake on a change (``poll_interval``,
  default 1 s here, only bounds time-driven steps such as the last call);
* the state and round keys are on a lease of ``ttl`` seconds (default 7200), so an
  abandoned run id is cleaned up by etcd.

Reach this module through ``elaunch.rendezvous.registry`` only: it imports grpc.
"""

from __future__ import annotations

import json
import logging
import math
import os
import queue
import time
from dataclasses import replace
from collections.abc import Callable
from typing import Any

from elaunch.rendezvous.api import RendezvousParameters, RendezvousStateError
from elaunch.rendezvous.dynamic.backend import Token
from elaunch.rendezvous.dynamic.settings import RendezvousSettings
from elaunch.rendezvous.dynamic.state import RendezvousState
from elaunch.rendezvous.etcd.common import (
    EtcdConf,
    FailoverKV,
    import_client,
    parse_conf,
)
from elaunch.rendezvous.etcd.handler import EtcdRendezvousHandler, EtcdStateBackend, build_handler
from elaunch.rendezvous.etcd.presence import Presence

log = logging.getLogger(__name__)

#: Seconds one gRPC call may take before the next endpoint is tried.
RPC_TIMEOUT = 5.0
#: Default ``poll_interval`` of etcd-v3 (seconds): watches wake waiting agents on changes.
DEFAULT_POLL_INTERVAL = 1.0
#: A state read with the heartbeats of at most this many nodes reads their keys one by one
#: in its transaction (the monitor's: itself and its ring neighbours); more read the prefixes.
FEW_NODES = 4


class EtcdV3KV(FailoverKV):
    """Single-key get / compare-and-set / watch over the v3 API, with endpoint fail-over.

    Tokens are ``mod_revision`` ints. Written keys are attached to a lease of
    ``conf.ttl`` seconds (re-granted when half used).

    Args:
        conf: connection settings (endpoints, TLS, user/password, read timeout in seconds).
        backend: the registry name, for messages.
    """

    def __init__(self, conf: EtcdConf, backend: str = "etcd-v3") -> None:
        super().__init__(conf, backend)
        # The agent forks workers (subprocess + preexec_fn) while gRPC threads run;
        # gRPC's fork handlers then abort the child ("epoll_wait: Bad file
        # descriptor"). The child execs at once, so they are not needed. Set before
        # grpc is first imported; launch() snapshots the workers' env before this.
        os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
        self._pyetcd = import_client("pyetcd", backend)
        self._grpc = import_client("grpc", backend)
        self._ttl_lease: tuple[int, float] | None = None  # (id, monotonic time granted)
        self._rpc_timeout = min(RPC_TIMEOUT, conf.read_timeout)

    def _make_client(self, host: str, port: int) -> Any:
        c, grpc, pyetcd = self.conf, self._grpc, self._pyetcd
        creds = None
        secure = c.protocol == "https"
        if secure:
            def read(path: str | None) -> bytes | None:
                if not path:
                    return None
                with open(path, "rb") as f:
                    return f.read()

            creds = grpc.ssl_channel_credentials(read(c.ca_cert), read(c.ssl_cert_key), read(c.ssl_cert))
        ep = pyetcd.Endpoint(host, port, secure=secure, creds=creds)
        client = pyetcd.MultiEndpointEtcd3Client(endpoints=[ep], timeout=self._rpc_timeout,
                                                 user=c.user, password=c.password)
        client.call_credentials = None  # the token travels as metadata: call credentials need TLS
        return client

    def _describe(self, exc: BaseException) -> str:
        """A gRPC error as ``UNAVAILABLE: <details>``, never the client's multi-line repr."""
        grpc = self._grpc
        if isinstance(exc, grpc.RpcError) and hasattr(exc, "code"):
            try:
                code, details = exc.code(), str(exc.details() or "").strip()
            except Exception:  # noqa: BLE001 - a half-built error: fall back to its type
                return type(exc).__name__
            name = getattr(code, "name", str(code))
            return f"{name}: {details.splitlines()[0]}" if details else name
        return super()._describe(exc)

    def _classify(self, exc: BaseException) -> str | None:
        grpc, errors = self._grpc, self._pyetcd.exceptions
        if isinstance(exc, grpc.RpcError) and hasattr(exc, "code"):
            code, details = exc.code(), str(exc.details() or "")
            if code == grpc.StatusCode.UNAUTHENTICATED or "invalid auth token" in details:
                return "reconnect"  # token expired or etcd restarted: authenticate again
            if code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.PERMISSION_DENIED):
                return "config"  # wrong user/password, missing permission, user name missing
            return "retry"
        if isinstance(exc, errors.Etcd3Exception) or isinstance(exc, (OSError, TimeoutError)):
            return "retry"
        if isinstance(exc, ValueError) and "failed node" in str(exc):
            return "retry"
        return None

    def _lease_id(self, client: Any) -> int:
        now = time.monotonic()
        if self._ttl_lease is None or now - self._ttl_lease[1] > self.conf.ttl / 2:
            self._ttl_lease = (client.lease(self.conf.ttl).id, now)
        return self._ttl_lease[0]

    def get(self, key: str) -> tuple[bytes | None, Token]:
        def op(client: Any) -> tuple[bytes | None, Token]:
            value, meta = client.get(key)
            return (None, None) if meta is None else (bytes(value), int(meta.mod_revision))

        return self.call(f"reading {key}", op)

    def get_with_prefix(self, key: str, prefix: str) -> tuple[bytes | None, Token, set[str]]:
        """Read ``key`` and the names under ``prefix`` in one transaction (one revision)."""
        utils = self._pyetcd.utils

        def op(client: Any) -> tuple[bytes | None, Token, set[str]]:
            tx = client.transactions
            end = utils.prefix_range_end(utils.to_bytes(prefix))
            _ok, (state, names) = client.transaction([], [tx.get(key), tx.get(prefix, end)], [])
            found = {m.key.decode()[len(prefix):] for _v, m in names}
            if not state:
                return None, None, found
            value, meta = state[0]
            return bytes(value), int(meta.mod_revision), found

        return self.call(f"reading {key}", op)

    def read_keys(self, key: str, keys: list[str]) -> tuple[bytes | None, Token, dict[str, bytes]]:
        """Read ``key`` and each of ``keys`` (single keys) in one transaction; a missing key is left out.

        Returns:
            ``(value, mod_revision, {key: value})``.
        """
        def op(client: Any) -> tuple[bytes | None, Token, dict[str, bytes]]:
            tx = client.transactions
            _ok, (state, *found) = client.transaction([], [tx.get(key), *(tx.get(k) for k in keys)], [])
            values = {k: bytes(items[0][0]) for k, items in zip(keys, found) if items}
            if not state:
                return None, None, values
            value, meta = state[0]
            return bytes(value), int(meta.mod_revision), values

        return self.call(f"reading {key}", op)

    def read_many(self, key: str, prefixes: list[str]
                  ) -> tuple[bytes | None, Token, list[list[tuple[str, bytes, int, int]]]]:
        """Read ``key`` and everything under each of ``prefixes`` in one transaction (one revision).

        Returns:
            ``(value, mod_revision, [[(name after the prefix, value, create_revision, mod_revision), ...]
            per prefix])``.
        """
        utils = self._pyetcd.utils

        def op(client: Any) -> tuple[bytes | None, Token, list[list[tuple[str, bytes, int, int]]]]:
            tx = client.transactions
            ranges = [tx.get(p, utils.prefix_range_end(utils.to_bytes(p))) for p in prefixes]
            _ok, (state, *found) = client.transaction([], [tx.get(key), *ranges], [])
            listed = [[(m.key.decode()[len(p):], bytes(v), int(m.create_revision), int(m.mod_revision))
                       for v, m in items]
                      for p, items in zip(prefixes, found)]
            if not state:
                return None, None, listed
            value, meta = state[0]
            return bytes(value), int(meta.mod_revision), listed

        return self.call(f"reading {key}", op)

    def put_many(self, items: list[tuple[str, bytes]], unless_exists: str | None = None,
                 otherwise: list[tuple[str, bytes]] | None = None) -> bool:
        """Put ``items`` in one transaction; with ``unless_exists``, only if that key is absent.

        Returns:
            True when ``items`` were written; False when ``unless_exists`` existed
            (``otherwise`` was written instead).
        """
        def op(client: Any) -> bool:
            tx = client.transactions
            lease = self._lease_id(client)
            compare = [tx.version(unless_exists) == 0] if unless_exists else []
            ok, _ = client.transaction(compare, [tx.put(k, v, lease=lease) for k, v in items],
                                       [tx.put(k, v, lease=lease) for k, v in (otherwise or [])])
            return bool(ok)

        return self.call(f"writing {items[0][0]}", op)

    def watch(self, key: str, timeout: float, prefix: bool = False, start_revision: int | None = None,
              exists: bool = False) -> bool:
        """Return True on the first event on ``key`` (or under it, ``prefix``), False after ``timeout`` s.

        ``start_revision``: replay events from that revision on. ``exists``: also
        return True when ``key`` exists already (checked after the watch started,
        so a write in between is not missed).
        """
        deadline = time.monotonic() + timeout
        events: queue.Queue = queue.Queue()
        try:
            client = self._client()
            kwargs = {} if start_revision is None else {"start_revision": int(start_revision)}
            add = client.add_watch_prefix_callback if prefix else client.add_watch_callback
            watch_id = add(key, events.put, **kwargs)
            try:
                if exists and client.get(key)[1] is not None:
                    return True
                events.get(timeout=max(0.0, deadline - time.monotonic()))
                return True
            except queue.Empty:
                return False
            finally:
                client.cancel_watch(watch_id)
        except Exception as exc:  # noqa: BLE001 - a watch only shortens waiting; reads report errors
            log.debug("etcd-v3: watching %s failed: %s", key, exc)
            time.sleep(max(0.0, deadline - time.monotonic()))
            return False

    def watch_forever(self, key: str, on_change: Callable[[], None]) -> Callable[[], None] | None:
        """Call ``on_change()`` on every event on ``key`` (from gRPC's thread) until the returned function is called.

        Returns None when the watch cannot be set up (logged at DEBUG): callers then poll.
        """
        def event(_response: Any) -> None:
            on_change()  # an event or a broken stream alike: the caller re-reads either way

        try:
            client = self._client()
            watch_id = client.add_watch_callback(key, event)
        except Exception as exc:  # noqa: BLE001 - a watch only shortens waiting; reads report errors
            log.debug("etcd-v3: watching %s failed: %s", key, exc)
            return None

        def cancel() -> None:
            try:
                client.cancel_watch(watch_id)
            except Exception as exc:  # noqa: BLE001 - the client may be gone already
                log.debug("etcd-v3: cancelling the watch on %s failed: %s", key, exc)

        return cancel

    def cas(self, key: str, value: bytes, token: Token | None) -> Token | None:
        def op(client: Any) -> Token | None:
            tx = client.transactions
            compare = [tx.version(key) == 0] if token is None else [tx.mod(key) == int(token)]
            ok, responses = client.transaction(compare, [tx.put(key, value, lease=self._lease_id(client))], [])
            return int(responses[0].response_put.header.revision) if ok else None

        return self.call(f"writing {key}", op)

    def wait(self, key: str, token: Token | None, timeout: float) -> None:
        """Watch ``key`` from revision ``token + 1``; return on the first event or after ``timeout`` s.

        With ``token`` None (the key was missing) it also returns at once if the
        key exists by the time the watch started: a write in between is not missed.
        """
        if token is None:
            self.watch(key, timeout, exists=True)
        else:
            self.watch(key, timeout, start_revision=int(token) + 1)


class EtcdV3StateBackend(EtcdStateBackend):
    """The state key plus the presence keys: a node without a live presence key reads as dead.

    ``get_state`` reports the last heartbeat of such a node as 0 (the epoch), so the
    shared state machine prunes it at once; the stored bytes are untouched until a
    node writes. The token is the state key's ``mod_revision``.

    Also batched joins and heartbeat keys (``dynamic/batching.py``), under
    ``{base}``: ``heartbeat/{node}`` (a put, no compare-and-set), round r's intent
    log ``intents/r/{node}:{time}`` (its position is the newest create revision),
    ``combiner/r`` (written by the round's first join, in the same transaction)
    and the completion notice ``done/r``. Waiting is a watch.

    Args:
        kv: the client.
        key: the state key.
        nodes_prefix: ``{base}/nodes/``.
    """

    def __init__(self, kv: EtcdV3KV, key: str, nodes_prefix: str) -> None:
        super().__init__(kv, key, "etcd-v3")
        self.nodes_prefix = nodes_prefix
        self._base = nodes_prefix[: -len("nodes/")]

    @property
    def supports_heartbeat_keys(self) -> bool:
        return True

    @property
    def cheap_heartbeats(self) -> bool:
        return False  # every put is a raft write: heart-beat at keep_alive_interval only

    def put_heartbeat(self, node_id: str, at: float) -> None:
        assert isinstance(self.kv, EtcdV3KV)
        self.kv.put_many([(f"{self._base}heartbeat/{node_id}", repr(at).encode())])

    def get_heartbeats(self, nodes) -> dict[str, float]:
        return self._read(None)[4]

    def watch_state(self, on_change: Callable[[], None]) -> Callable[[], None] | None:
        assert isinstance(self.kv, EtcdV3KV)
        return self.kv.watch_forever(self.key, on_change)  # every node's, in one range read

    def get_state_and_heartbeats(self, nodes) -> tuple[bytes | None, Token, dict[str, float]]:
        if len(nodes) > FEW_NODES:
            data, token, _log, _pos, beats = self._read(None)
            return data, token, beats
        # a few nodes (the monitor's: itself and its ring neighbours): their presence and
        # heartbeat keys, not every node's; only those are judged by their presence
        assert isinstance(self.kv, EtcdV3KV)
        keys = {n: (f"{self.nodes_prefix}{n}", f"{self._base}heartbeat/{n}") for n in nodes}
        data, token, found = self.kv.read_keys(self.key, [k for pair in keys.values() for k in pair])
        alive = {n for n, (presence, _beat) in keys.items() if presence in found}
        beats: dict[str, float] = {}
        for n in alive:
            try:
                beats[n] = float(found[keys[n][1]])
            except (KeyError, ValueError):
                continue
        return self._zero_dead(data, alive, judged=set(nodes)), token, beats

    @property
    def supports_intents(self) -> bool:
        return True

    def post_intent(self, round: int, intent: bytes) -> bool:
        assert isinstance(self.kv, EtcdV3KV)
        doc = json.loads(intent)
        item = (f"{self._base}intents/{round}/{doc['node']}:{doc['at']!r}", intent)
        return self.kv.put_many([item, (f"{self._base}combiner/{round}", intent)],
                                unless_exists=f"{self._base}combiner/{round}", otherwise=[item])

    def get_state_and_intents(self, round: int, nodes=()) -> tuple[bytes | None, Token, bytes, int, dict[str, float]]:
        return self._read(round)

    def wait_for_arrival(self, round: int, position: int, timeout: float) -> bool:
        assert isinstance(self.kv, EtcdV3KV)
        return self.kv.watch(f"{self._base}intents/{round}/", timeout, prefix=True, start_revision=position + 1)

    def notify_round(self, round: int) -> None:
        assert isinstance(self.kv, EtcdV3KV)
        self.kv.put_many([(f"{self._base}done/{round}", b"1"), (f"{self._base}intents/{round}/~notice", b"")])

    def wait_for_round(self, round: int, timeout: float) -> bool:
        assert isinstance(self.kv, EtcdV3KV)
        return self.kv.watch(f"{self._base}done/{round}", timeout, exists=True)

    def _read(self, round: int | None) -> tuple[bytes | None, Token, bytes, int, dict[str, float]]:
        """State (dead nodes zeroed), intent log of ``round``, its position and live nodes' heartbeats."""
        assert isinstance(self.kv, EtcdV3KV)
        prefixes = [self.nodes_prefix, f"{self._base}heartbeat/"]
        if round is not None:
            prefixes.append(f"{self._base}intents/{round}/")
        data, token, (alive, beats, *log_items) = self.kv.read_many(self.key, prefixes)
        names = {name for name, *_rest in alive}
        heartbeats: dict[str, float] = {}
        for name, value, *_revs in beats:
            if name in names:  # a node without presence is dead, whatever its last beat says
                try:
                    heartbeats[name] = float(value)
                except ValueError:
                    continue
        items = sorted(log_items[0], key=lambda item: item[2]) if log_items else []  # by creation
        log_bytes = b"".join(v if v.endswith(b"\n") else v + b"\n" for _n, v, _c, _m in items if v)
        position = max((mod for *_rest, mod in items), default=0)
        return self._zero_dead(data, names), token, log_bytes, position, heartbeats

    def get_state(self) -> tuple[bytes | None, Token]:
        assert isinstance(self.kv, EtcdV3KV)
        data, token, alive = self.kv.get_with_prefix(self.key, self.nodes_prefix)
        return self._zero_dead(data, alive), token

    def get_stored_state(self) -> tuple[bytes | None, Token]:
        return super().get_state()  # the state key alone: no presence keys, no decode here

    @staticmethod
    def _zero_dead(data: bytes | None, alive: set[str], judged: set[str] | None = None) -> bytes | None:
        """The state with the heartbeat of each node (of ``judged``; None: all) not in ``alive`` set to 0."""
        if data is None or (judged is not None and not judged):
            return data  # no one to judge: no decode
        try:
            state = RendezvousState.from_bytes(data)
        except RendezvousStateError:
            return data  # not a state: the executor reports it when it decodes it
        gone = [n for n in state.last_heartbeats if n not in alive and (judged is None or n in judged)]
        if not gone:
            return data
        for node in gone:
            state.last_heartbeats[node] = 0.0  # ANY -> DEAD: its lease expired or was revoked
        return state.to_bytes()


def create_handler(params: RendezvousParameters) -> EtcdRendezvousHandler:
    """Build an ``etcd-v3`` dynamic rendezvous handler and register this node's presence lease.

    Conf keys: those of ``etcd-v2`` (endpoints, ``protocol``, ``ca_cert``,
    ``ssl_cert``, ``ssl_cert_key``, ``read_timeout``, ``etcd_prefix``, ``ttl``),
    ``user``/``password``, and the dynamic rendezvous' timeouts;
    ``poll_interval`` defaults to 1 s (watches wake agents on changes).

    Raises:
        RendezvousConfigError: bad conf value, wrong credentials, or etcd-sdk-python
            missing (``pip install 'elaunch[etcd]'``).
        RendezvousConnectionError: no endpoint answered within ``read_timeout`` seconds.
    """
    config = dict(params.config)
    config.setdefault("poll_interval", str(DEFAULT_POLL_INTERVAL))
    if params.get("timeout") is not None and "join_timeout" not in config:
        config["join_timeout"] = config["timeout"]
    params = replace(params, config=config)
    conf = parse_conf(params)
    settings = RendezvousSettings.from_params(params)
    base = f"{conf.prefix}/{params.run_id}"
    kv = EtcdV3KV(conf)
    backend = EtcdV3StateBackend(kv, f"{base}/state", f"{base}/nodes/")
    holder: list[Presence] = []
    handler = build_handler(params, conf, kv, "etcd-v3", backend=backend, settings=settings,
                            on_close=(lambda: holder and holder[0].stop(),))
    presence = Presence(EtcdV3KV(conf), f"{base}/nodes/{handler.node_id}", math.ceil(settings.dead_after))
    try:
        presence.start()
    except BaseException:
        kv.close()
        presence.kv.close()
        raise
    holder.append(presence)
    return handler
