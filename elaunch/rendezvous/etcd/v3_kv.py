"""``etcd-v3``: the key-value client (etcd-sdk-python, ``pyetcd``) the backend and the presence use.

Split from ``etcd.v3``, which keeps the rendezvous state backend and builds the
handler: single-key get / compare-and-set, the few multi-key transactions the
batched join needs, and watches, over the v3 gRPC API with endpoint fail-over
(``FailoverKV``). Reach it through ``elaunch.rendezvous.registry`` (``etcd.v3``)
only: it imports grpc.
"""

from __future__ import annotations

import logging
import os
import queue
import time
from collections.abc import Callable
from typing import Any

from elaunch.rendezvous.dynamic.backend import Token
from elaunch.rendezvous.etcd.common import EtcdConf, FailoverKV, import_client
from elaunch.rendezvous.etcd.standing import Opener, StandingWatches

log = logging.getLogger("elaunch.rendezvous.etcd.v3")

#: Seconds one gRPC call may take before the next endpoint is tried.
RPC_TIMEOUT = 5.0


def _value_of(got: tuple[Any, Any]) -> bytes | None:
    """The value of etcd-sdk-python's ``get`` answer, None for a missing key."""
    value, meta = got
    return None if meta is None else bytes(value)


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
        self._opener = Opener()  # opens a broken standing watch again; its thread starts with the agent
        put = self._pyetcd.events.PutEvent
        self._standing = StandingWatches(self._client, self._opener, lambda event: isinstance(event, put))

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

    def grant_key_lease(self) -> None:
        """Grant the lease of ``conf.ttl`` seconds that written keys go on now, not at the first write.

        An agent's first write is its join intent: granted there, each agent of a
        crowd made two requests in a row before its join was posted.

        Raises:
            RendezvousConnectionError: no endpoint answered within ``read_timeout`` seconds.
        """
        self.call("granting the keys' lease", self._lease_id)

    def get(self, key: str) -> tuple[bytes | None, Token]:
        def op(client: Any) -> tuple[bytes | None, Token]:
            value, meta = client.get(key)
            return (None, None) if meta is None else (bytes(value), int(meta.mod_revision))

        return self.call(f"reading {key}", op)

    def revision(self, key: str) -> Token:
        """Return ``key``'s ``mod_revision`` (None when it does not exist), without its value."""
        def op(client: Any) -> Token:
            _value, meta = client.get(key, keys_only=True)
            return None if meta is None else int(meta.mod_revision)

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

    def put_within(self, key: str, value: bytes, timeout: float) -> None:
        """Put ``key`` (on the keys' lease) within ``timeout`` seconds in all, each attempt's RPC included.

        For heartbeats: a put that etcd loses in a leader election is otherwise waited
        for the whole RPC timeout (5 s), then lands a stale time; given up on sooner,
        the keep-alive's next beat carries a fresh one (to the next endpoint).

        Raises:
            RendezvousConnectionError: not written within ``timeout`` seconds.
        """
        deadline = time.monotonic() + timeout
        etcdrpc, utils = self._pyetcd.etcdrpc, self._pyetcd.utils

        def op(client: Any) -> None:
            request = etcdrpc.PutRequest(key=utils.to_bytes(key), value=value, lease=self._lease_id(client))
            client.kvstub.Put(request, max(0.05, deadline - time.monotonic()),
                              credentials=client.call_credentials, metadata=client.metadata)

        self.call(f"writing {key}", op, timeout=timeout)

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
            standing = self._standing.covering(key, client) if exists and not prefix and start_revision is None else None
            if standing is not None:
                return standing.wait_written(key, timeout, lambda: _value_of(client.get(key))) is not None
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

    def get_when_written(self, key: str, timeout: float) -> bytes | None:
        """``EtcdKV.get_when_written``; under a standing watch, from the value its event carried (no read)."""
        try:
            client = self._client()
            standing = self._standing.covering(key, client)
        except Exception as exc:  # noqa: BLE001 - reading reports errors; this only saves a watch
            log.debug("etcd-v3: standing watch for %s: %s", key, exc)
            standing = None
        if standing is None:
            return super().get_when_written(key, timeout)
        deadline = time.monotonic() + timeout
        value = standing.wait_written(key, timeout, lambda: self.get(key)[0])
        if value is None and not standing.serves(key, self._client()):
            # the watch broke meanwhile: wait the plain way, for what is left of ``timeout``
            return super().get_when_written(key, max(0.0, deadline - time.monotonic()))
        return value

    def start_opener(self) -> None:
        """Start the thread that opens broken standing watches again now, not in the first round."""
        self._opener.start()

    def close(self) -> None:
        self._opener.stop()
        super().close()

    def keep_watching(self, prefix: str) -> None:
        """Keep one watch on ``prefix`` open for this client's life (``StandingWatches.add``).

        :meth:`watch` with ``exists`` of a key under it then waits on that watch's
        events instead of setting up a watch of its own. Best effort: while it cannot
        be opened (etcd away), such waits take their own watch as before.
        """
        self._standing.add(prefix)

    def listen(self, key: str, on_put: Callable[[], None]) -> Callable[[], None] | None:
        """Call ``on_put()`` on every put of ``key``, from the standing watch covering it (``StandingWatches.listen``).

        Returns:
            A function that stops the calls; None when no standing watch covers ``key``.
        """
        return self._standing.listen(key, on_put)

    def cas(self, key: str, value: bytes, token: Token | None,
            also: tuple[tuple[str, bytes], ...] = ()) -> Token | None:
        """``EtcdKV.cas``; ``also``: keys put in the same transaction when the write succeeds."""
        def op(client: Any) -> Token | None:
            tx = client.transactions
            lease = self._lease_id(client)
            compare = [tx.version(key) == 0] if token is None else [tx.mod(key) == int(token)]
            puts = [tx.put(key, value, lease=lease), *(tx.put(k, v, lease=lease) for k, v in also)]
            ok, responses = client.transaction(compare, puts, [])
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
