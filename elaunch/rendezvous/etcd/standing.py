"""``etcd-v3``: watches kept open for an agent's life, and the thread that opens watches off callers' threads.

Split from ``etcd.v3``. An agent waits, every round, for keys that appear once:
the round's completion notice (``{base}/round/{round}/done``) and its workers'
address (``{base}/round/{round}/master_endpoint``). Setting up a watch for each
such wait costs a create on the client's watch stream, and etcd-sdk-python
creates one watch at a time per stream: behind a slow create the next waits its
turn. A :class:`StandingWatch` on their prefix (``{base}/round/``) is set up once,
when the agent starts, and answers every such wait from the events (and values)
it has seen. It also tells the running member's monitor of every write of the
state: each write puts ``{base}/round/state_written`` too (a few bytes), and a
listener (:meth:`StandingWatch.listen`) is called on its events, so no round opens
a watch of its own for that.
A client keeps its standing watches in a :class:`StandingWatches`. A standing
watch whose stream broke is opened again by an :class:`Opener`, one thread started
with the agent, off gRPC's and the callers' threads. Both know the client only
through the callables they are given; stdlib only.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from collections import OrderedDict
from typing import Any, Callable

log = logging.getLogger(__name__)

#: How many keys a standing watch remembers seeing written (the newest; a notice is
#: waited for within a round or two of being written).
REMEMBERED = 256


class StandingWatch:
    """A prefix watch on one client, and the keys under the prefix that it saw written.

    Created with :meth:`start`; :meth:`serves` says whether it can answer a wait
    for a key (the prefix covers it, the watch is open, on the client now in use).
    A broken stream (etcd restarted, the client was dropped) closes it: waits then
    take a watch of their own until it is started again.

    Args:
        prefix: the key prefix watched, e.g. ``{etcd_prefix}/{run_id}/round/``.
        is_put: tells a put event from a delete event (etcd-sdk-python's event classes).
        on_break: called (from gRPC's thread) when the stream breaks while someone
            listens (:meth:`listen`), so the owner can open the watch again.
    """

    def __init__(self, prefix: str, is_put: Callable[[Any], bool],
                 on_break: Callable[[], None] | None = None) -> None:
        self.prefix = prefix
        self._is_put = is_put
        self._on_break = on_break
        self._cond = threading.Condition()
        self._seen: OrderedDict[str, bytes] = OrderedDict()  # key -> the value it was written with
        self._listeners: dict[str, list[Callable[[], None]]] = {}  # key -> called on each of its puts
        self._client: Any = None  # the client whose stream carries the watch; None: closed

    def start(self, client: Any) -> bool:
        """Open the watch on ``client``'s stream; False (logged at DEBUG) when that fails."""
        with self._cond:
            self._client = None
        try:
            client.add_watch_prefix_callback(self.prefix, self._on_response)
        except Exception as exc:  # noqa: BLE001 - the waits fall back to watches of their own
            log.debug("etcd-v3: standing watch on %s failed: %s", self.prefix, exc)
            return False
        with self._cond:
            self._client = client
        return True

    def serves(self, key: str, client: Any) -> bool:
        """True when ``key`` is under the prefix and the watch is open on ``client``."""
        return key.startswith(self.prefix) and self._client is not None and self._client is client

    def listen(self, key: str, on_put: Callable[[], None]) -> Callable[[], None]:
        """Call ``on_put()`` (from gRPC's thread) on every put of ``key``, and when the stream breaks.

        Returns:
            A function that stops the calls (idempotent).
        """
        with self._cond:
            self._listeners.setdefault(key, []).append(on_put)

        def stop() -> None:
            with self._cond:
                fns = self._listeners.get(key, [])
                if on_put in fns:
                    fns.remove(on_put)
                if not fns:
                    self._listeners.pop(key, None)

        return stop

    def listening(self) -> bool:
        """True while someone listens (:meth:`listen`)."""
        with self._cond:
            return bool(self._listeners)

    def tell_listeners(self) -> None:
        """Call every listener once (writes may have gone unseen: the watch was just opened again)."""
        with self._cond:
            fns = [fn for fns in self._listeners.values() for fn in fns]
        for fn in fns:
            fn()

    def _on_response(self, response: Any) -> None:
        with self._cond:
            events = getattr(response, "events", None)
            if events is None:  # an error, or None: the stream ended; nothing more will come
                broke = self._client is not None
                self._client = None
                called = [fn for fns in self._listeners.values() for fn in fns]
            else:
                broke, called = False, []
                for event in events:
                    if self._is_put(event):
                        key = event.key.decode()
                        self._seen[key] = bytes(event.value)
                        called += self._listeners.get(key, ())
                while len(self._seen) > REMEMBERED:
                    self._seen.popitem(last=False)
            self._cond.notify_all()
        for fn in called:  # outside the lock: a listener may read or wait
            fn()
        if broke and called and self._on_break is not None:
            self._on_break()

    def wait_written(self, key: str, timeout: float, read_now: Callable[[], bytes | None]) -> bytes | None:
        """Return ``key``'s value once it was written; None after ``timeout`` seconds or when the watch breaks.

        For keys written once (a notice, an address): the value an event carried is
        the key's value. ``read_now()`` reads the key once, None when it is missing
        (the watch was open before that read, so a write after it is seen as an event).
        """
        deadline = time.monotonic() + timeout
        with self._cond:
            if key in self._seen:
                return self._seen[key]
        value = read_now()
        if value is not None:
            return value
        with self._cond:
            while key not in self._seen and self._client is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._cond.wait(left)
            return self._seen.get(key)


class StandingWatches:
    """The standing watches of one client (``EtcdV3KV``): opened on the client in use, again after a break.

    Args:
        client: returns the client in use (raises when etcd cannot be reached).
        opener: runs the re-opens off gRPC's and the callers' threads.
        is_put: tells a put event from a delete event (etcd-sdk-python's event classes).
    """

    def __init__(self, client: Callable[[], Any], opener: Opener, is_put: Callable[[Any], bool]) -> None:
        self._client = client
        self._opener = opener
        self._is_put = is_put
        self.watches: list[StandingWatch] = []
        # opens a standing watch again; not the client lock, which a heartbeat must never wait behind
        self._lock = threading.Lock()

    def add(self, prefix: str) -> None:
        """Open a :class:`StandingWatch` on ``prefix`` now (best effort: a failed open is opened on demand)."""
        standing = StandingWatch(prefix, self._is_put, on_break=lambda: self._reopen_later(standing))
        self.watches.append(standing)
        standing.start(self._client())

    def _find(self, key: str) -> StandingWatch | None:
        """The standing watch whose prefix covers ``key``, open or not."""
        return next((w for w in self.watches if key.startswith(w.prefix)), None)

    def covering(self, key: str, client: Any) -> StandingWatch | None:
        """The standing watch covering ``key``, open on ``client`` (opened again if it broke), or None."""
        standing = self._find(key)
        if standing is None:
            return None
        with self._lock:
            return standing if standing.serves(key, client) or standing.start(client) else None

    def listen(self, key: str, on_put: Callable[[], None]) -> Callable[[], None] | None:
        """Call ``on_put()`` on every put of ``key`` from the standing watch covering it (no watch of its own).

        While that watch is broken (etcd restarted) it is opened again every second,
        by the :class:`Opener`, and ``on_put()`` is called once when it is (for the
        writes nobody saw); meanwhile callers see no events (they poll).

        Returns:
            A function that stops the calls; None when no standing watch covers ``key``.
        """
        standing = self._find(key)
        if standing is None:
            return None
        stop = standing.listen(key, on_put)
        try:
            open_now = standing.serves(key, self._client())
        except Exception:  # noqa: BLE001 - no client now: the opener tries
            open_now = False
        if not open_now:
            self._reopen_later(standing, 0.0)
        return stop

    def _reopen_later(self, standing: StandingWatch, delay: float = 1.0) -> None:
        """Open ``standing`` again on the client in use, ``delay`` s from now and then every second until it is.

        Does nothing once it is open; tells its listeners when it was not.
        """
        def reopen() -> None:
            try:
                client = self._client()
                with self._lock:
                    if standing.serves(standing.prefix, client):
                        return
                    opened = standing.start(client)
            except Exception as exc:  # noqa: BLE001 - tried again below
                log.debug("etcd-v3: opening the standing watch on %s again: %s", standing.prefix, exc)
                opened = False
            if opened:
                standing.tell_listeners()
            elif standing.listening():
                self._reopen_later(standing)

        self._opener.run_in(delay, reopen)


class Opener:
    """One thread that runs watch opens off their callers' threads, each when it is due, in order.

    etcd-sdk-python blocks a caller opening a watch until etcd answered, behind any
    other open on the same stream; a caller that must not wait hands the open here.
    Start it with the agent (:meth:`start`), so that no round pays for a thread
    start: at 1,024 simulated agents per 8 processes, starting a thread per round
    was a quarter of the time a returning agent held the GIL.

    Args:
        name: the thread's name.
    """

    def __init__(self, name: str = "elaunch-etcd-watch-opener") -> None:
        self._name = name
        self._cond = threading.Condition()
        self._due: list[tuple[float, int, Callable[[], None]]] = []  # (monotonic time, order, open)
        self._order = itertools.count()
        self._thread: threading.Thread | None = None
        self._running = False  # an open is running now
        self._stopped = False

    def start(self) -> None:
        """Start the thread (once; later calls do nothing)."""
        with self._cond:
            if self._thread is None and not self._stopped:
                self._thread = threading.Thread(target=self._loop, name=self._name, daemon=True)
                self._thread.start()

    def run_in(self, delay: float, fn: Callable[[], None]) -> None:
        """Run ``fn()`` on the thread in ``delay`` seconds (started now if it was not); errors are logged."""
        self.start()
        with self._cond:
            heapq.heappush(self._due, (time.monotonic() + delay, next(self._order), fn))
            self._cond.notify()

    def idle(self) -> bool:
        """True when nothing runs or waits to run."""
        with self._cond:
            return not self._due and not self._running

    def stop(self) -> None:
        """Drop what waits to run and end the thread (after the open it runs now, if any)."""
        with self._cond:
            self._stopped = True
            self._due.clear()
            self._cond.notify()

    def _loop(self) -> None:
        while True:
            with self._cond:
                self._running = False
                while not self._stopped and (not self._due or self._due[0][0] > time.monotonic()):
                    self._cond.wait(self._due[0][0] - time.monotonic() if self._due else None)
                if self._stopped:
                    return
                _when, _order, fn = heapq.heappop(self._due)
                self._running = True
            try:
                fn()
            except Exception as exc:  # noqa: BLE001 - an open is best effort; its owner retries
                log.debug("etcd-v3: opening a watch failed: %s", exc)
