"""``etcd-v3``: one prefix watch kept open for an agent's life, for the small keys it waits to exist.

Split from ``etcd.v3``. An agent waits, every round, for keys that appear once:
the round's completion notice (``{base}/done/{round}``). Setting up a watch for
each such wait costs a create on the client's watch stream, and etcd-sdk-python
creates one watch at a time per stream: behind a slow create the next waits
its turn. A :class:`StandingWatch` on the notices' prefix is set up once, when
the agent starts, and answers every such wait from the events it has seen. It
knows the client only through the callables it is given; stdlib only.
"""

from __future__ import annotations

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
        prefix: the key prefix watched, e.g. ``{etcd_prefix}/{run_id}/done/``.
        is_put: tells a put event from a delete event (etcd-sdk-python's event classes).
    """

    def __init__(self, prefix: str, is_put: Callable[[Any], bool]) -> None:
        self.prefix = prefix
        self._is_put = is_put
        self._cond = threading.Condition()
        self._seen: OrderedDict[str, bytes] = OrderedDict()  # key -> the value it was written with
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

    def _on_response(self, response: Any) -> None:
        with self._cond:
            events = getattr(response, "events", None)
            if events is None:  # an error, or None: the stream ended; nothing more will come
                self._client = None
            else:
                for event in events:
                    if self._is_put(event):
                        self._seen[event.key.decode()] = bytes(event.value)
                while len(self._seen) > REMEMBERED:
                    self._seen.popitem(last=False)
            self._cond.notify_all()

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
