"""``etcd-v3``: a node's presence key on its own lease, kept alive by a thread.

Split from ``etcd.v3``. A node whose agent dies loses its key when the lease
expires; ``EtcdV3StateBackend`` reads such a node as dead. Knows the client only
as a :class:`~elaunch.rendezvous.etcd.common.FailoverKV` (``v3`` imports this
module, not the reverse).
"""

from __future__ import annotations

import logging
import random
import threading
from typing import Any

from elaunch.rendezvous.etcd.common import FailoverKV

log = logging.getLogger(__name__)


class Presence:
    """This node's presence key on its own lease, kept alive by a daemon thread.

    The lease's TTL is ``ttl`` seconds; it is refreshed every ``ttl / 3`` seconds (the
    first time at a random point of that interval) and
    re-granted (with the key written again) when etcd lost it (e.g. after a long
    partition). :meth:`stop` revokes it, so the node disappears at once.

    Args:
        kv: an etcd-v3 client (``EtcdV3KV``) of its own (not shared with the
            rendezvous, so a slow refresh never blocks a join).
        key: the presence key.
        ttl: lease TTL in seconds (>= 2).
    """

    def __init__(self, kv: FailoverKV, key: str, ttl: int) -> None:
        self.kv = kv
        self.key = key
        self.ttl = max(2, ttl)
        self.lease_id: int | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _grant(self) -> None:
        def op(client: Any) -> int:
            lease = client.lease(self.ttl)
            client.put(self.key, b"alive", lease=lease.id)
            return int(lease.id)

        self.lease_id = self.kv.call(f"granting a lease for {self.key}", op)

    def start(self) -> None:
        """Grant the lease, write the key and start the keep-alive thread.

        Raises:
            RendezvousConnectionError, RendezvousConfigError: etcd unreachable or refused.
        """
        self._grant()
        self._thread = threading.Thread(target=self._loop, name="elaunch-etcd-presence", daemon=True)
        self._thread.start()

    def first_refresh_after(self) -> float:
        """Seconds from :meth:`start` to the first refresh: a random point of the first ``ttl / 3``.

        Agents a scheduler starts together would otherwise refresh in step, every
        one of them in the same instant, once per ``ttl / 3`` seconds for the job's life.
        """
        return self.ttl / 3 * random.uniform(0.25, 1.0)

    def _loop(self) -> None:
        wait = self.first_refresh_after()
        while not self._stop.wait(wait):
            wait = self.ttl / 3
            try:
                lease_id = self.lease_id
                ttls = self.kv.call("refreshing the node lease",
                                    lambda c: [r.TTL for r in c.refresh_lease(lease_id)], timeout=self.ttl / 3)
                if not ttls or ttls[-1] <= 0:
                    log.warning("etcd-v3: lease of %s expired; joining again with a new lease", self.key)
                    self._grant()
            except Exception as exc:  # noqa: BLE001 - retried at the next interval
                log.debug("etcd-v3: refreshing %s failed: %s", self.key, exc)

    def stop(self) -> None:
        """Stop refreshing and revoke the lease (the key disappears); best effort."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(self.kv.conf.read_timeout)
        if self.lease_id is not None:
            try:
                lease_id = self.lease_id
                self.kv.call("revoking the node lease", lambda c: c.revoke_lease(lease_id), timeout=2.0)
            except Exception as exc:  # noqa: BLE001 - it expires on its own
                log.debug("etcd-v3: revoking the lease of %s failed: %s", self.key, exc)
        self.kv.close()
