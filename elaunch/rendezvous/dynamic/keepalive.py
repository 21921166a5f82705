"""The keep-alive thread of a dynamic rendezvous' running member (``DynamicRendezvousHandler``).

Mirrors the keep-alive of torch's ``DynamicRendezvousHandler`` (``_keep_alive``
on a timer), with a thread that beats into the node's own heartbeat key (every
backend has them: c10d, etcd-v2, etcd-v3) and can be woken to answer a probe at
once. Stdlib only.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable

from elaunch.rendezvous.contract import RendezvousError
from elaunch.rendezvous.dynamic.backend import RendezvousBackend
from elaunch.rendezvous.dynamic.settings import RendezvousSettings
from elaunch.rendezvous.dynamic.stalls import StoreStalls

log = logging.getLogger("elaunch.rendezvous.dynamic.handler")


class KeepAlive:
    """Heart-beats for one node while its round runs; started and stopped by the handler.

    Args:
        node_id: the node whose heartbeat this is.
        settings: ``heartbeat_interval`` (seconds between beats), ``probe_timeout``
            (a probe is answered within a quarter of it), ``heartbeat_timeout``.
        backend: writes the node's heartbeat key (``beat``); ``cheap_heartbeats``
            sets how often.
        clock: seconds since the epoch, the time written into a heartbeat.
        stalls: where a beat that failed or was slow is noted as this node's store
            stall: the handler's, shared with the reads its loss rule judges by.
    """

    def __init__(self, node_id: str, settings: RendezvousSettings, backend: RendezvousBackend,
                 clock: Callable[[], float], stalls: StoreStalls) -> None:
        self._node_id = node_id
        self._settings = settings
        self._backend = backend
        self._clock = clock
        self._stalls = stalls
        self._beat_now = threading.Event()  # wakes the thread: a read saw a probe it must answer
        self._stop: threading.Event | None = None
        self.thread: threading.Thread | None = None

    @property
    def running(self) -> bool:
        """True between :meth:`start` and :meth:`stop`."""
        return self.thread is not None

    def beat_now(self) -> None:
        """Make the thread beat at once (a probe to answer) instead of at its next tick."""
        self._beat_now.set()

    def start(self) -> None:
        """Start the thread (a daemon, named after the node)."""
        stop = threading.Event()
        thread = threading.Thread(target=self._loop, args=(stop,), name=f"elaunch-rdzv-keepalive-{self._node_id}",
                                  daemon=True)
        self._stop, self.thread = stop, thread
        thread.start()

    def stop(self) -> None:
        """Stop the thread; wait up to ``heartbeat_timeout + 1`` seconds for a beat in flight. Idempotent."""
        if self._stop is None or self.thread is None:
            return
        self._stop.set()
        self._beat_now.set()
        if self.thread is not threading.current_thread():
            self.thread.join(self._settings.heartbeat_timeout + 1.0)
        self._stop = self.thread = None

    def _loop(self, stop: threading.Event) -> None:
        """Heart-beat into this node's own key now, then every tick, until ``stop`` is set.

        The tick is ``heartbeat_interval`` (0.375 s by default), or
        ``min(heartbeat_interval, probe_timeout / 4)`` where a beat costs next to
        nothing (``cheap_heartbeats``: c10d). Such a write is uncontended and no
        state is read for it, so it is simply frequent enough to keep this running
        member clear of ``lost_after`` and to answer any probe in time; a probe the
        monitor's read saw is answered at once (``_beat_now``). After a freeze
        (SIGSTOP, a stalled VM) the overdue wait returns at once, so the first thing
        a thawed agent does is beat. Dead nodes are pruned by joining nodes
        (``decide_join``), as in torch.
        """
        s = self._settings
        tick = min(s.heartbeat_interval, s.probe_timeout / 4) if self._backend.cheap_heartbeats else s.heartbeat_interval
        while True:
            try:
                with self._stalls.timing():
                    self._backend.beat(self._node_id, self._clock())
            except RendezvousError as exc:
                log.warning("node %s: keep-alive heartbeat failed: %s", self._node_id, exc)
            except Exception:  # noqa: BLE001 - a heartbeat thread must not die silently
                log.exception("node %s: keep-alive heartbeat crashed", self._node_id)
            self._beat_now.wait(tick)  # a probe to answer, or ``stop``, wakes it early
            self._beat_now.clear()
            if stop.is_set():
                return
