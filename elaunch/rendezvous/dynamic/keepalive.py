"""The keep-alive thread of a dynamic rendezvous' running member (``DynamicRendezvousHandler``).

Mirrors the keep-alive of torch's ``DynamicRendezvousHandler`` (``_keep_alive``
on a timer), with a thread that beats into the node's own heartbeat key (every
backend has them: c10d, etcd-v2, etcd-v3) and can be woken to answer a probe at
once. The thread is a helper of the launch's supervisor (``elaunch.supervision``, tier
``RENDEZVOUS``, policy off): the handler adds it when a round starts and stops it there
(``Supervisor.stop``) before it leaves; a thread that died is one WARNING line at the
monitor's next look. Stdlib only.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable

from elaunch.rendezvous.contract import RendezvousError
from elaunch.rendezvous.dynamic.backend import RendezvousBackend
from elaunch.rendezvous.dynamic.settings import RendezvousSettings
from elaunch.rendezvous.dynamic.stalls import StoreStalls
from elaunch.supervision import HelperThread

log = logging.getLogger("elaunch.rendezvous.dynamic.handler")


class KeepAlive:
    """Heart-beats for one node while its round runs; a helper (``elaunch.supervision.Helper``) that
    the handler adds to its supervisor (which starts it) and stops there.

    Args:
        node_id: the node whose heartbeat this is.
        settings: ``heartbeat_interval`` (seconds between beats), ``probe_timeout``
            (a probe is answered within a quarter of it), ``heartbeat_timeout``.
        backend: writes the node's heartbeat key (``beat``); ``cheap_heartbeats``
            sets how often.
        clock: seconds since the epoch, the time written into a heartbeat.
        stalls: where a beat that failed or was slow is noted as this node's store
            stall: the handler's, shared with the reads its loss rule judges by.
        on_tick: called after each beat, in the thread (the presence port's upkeep:
            ``presence.Presence.tick``); it should not block for long. An exception it raises
            is logged, as a beat's is: the thread beats on.
    """

    def __init__(self, node_id: str, settings: RendezvousSettings, backend: RendezvousBackend,
                 clock: Callable[[], float], stalls: StoreStalls, on_tick: Callable[[], None] | None = None) -> None:
        self._node_id = node_id
        self._on_tick = on_tick
        self._settings = settings
        self._backend = backend
        self._clock = clock
        self._stalls = stalls
        self._beat_now = threading.Event()  # wakes the thread: a read saw a probe it must answer
        self._thread: HelperThread | None = None
        self.name = "rendezvous keep-alive"

    @property
    def running(self) -> bool:
        """True between :meth:`start` and :meth:`stop`."""
        return self._thread is not None

    @property
    def thread(self) -> threading.Thread | None:
        """The running thread, or None."""
        return self._thread.thread if self._thread is not None else None

    def beat_now(self) -> None:
        """Make the thread beat at once (a probe to answer) instead of at its next tick."""
        self._beat_now.set()

    def start(self) -> None:
        """Start the thread (a daemon, named after the node)."""
        self._thread = HelperThread(self.name, self._loop, join_timeout=self._settings.heartbeat_timeout + 1.0,
                                    thread_name=f"elaunch-rdzv-keepalive-{self._node_id}", warn_late=False)
        self._thread.start()

    def check(self) -> bool:
        """Raise ``HelperDied`` once if the thread died of an exception (it logs and goes on after one
        raised by a beat); never restarts it (False)."""
        thread = self._thread  # once: the handler may stop it meanwhile, from the thread that leaves the round
        return thread.check() if thread is not None else False

    def private_fds(self) -> tuple[int, ...]:
        """None: the backend's connections are the handler's."""
        return ()

    def close(self) -> None:
        """Stop the thread; wait up to ``heartbeat_timeout + 1`` seconds for a beat in flight. Idempotent."""
        thread, self._thread = self._thread, None
        if thread is None:
            return
        thread.stopping.set()
        self._beat_now.set()
        thread.close()

    stop = close

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
            if self._on_tick is not None:
                try:
                    self._on_tick()
                except Exception:  # noqa: BLE001 - the upkeep of a helper must not stop the heartbeats
                    log.exception("node %s: keep-alive tick crashed", self._node_id)
            self._beat_now.wait(tick)  # a probe to answer, or ``stop``, wakes it early
            self._beat_now.clear()
            if stop.is_set():
                return
