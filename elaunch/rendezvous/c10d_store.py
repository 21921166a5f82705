"""c10d's store access: torch Store calls bounded in time, their errors translated.

Split from ``c10d.py``: every call the c10d rendezvous makes on a TCPStore goes
through :class:`BoundedStore` (a server that stalls silently must not hang an
agent) and :func:`_translated` (a torch/socket error becomes a
RendezvousConnectionError naming the endpoint). Imports nothing from torch.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator

from elaunch.rendezvous.api import RendezvousConnectionError

#: Errors torch's stores raise (DistError and its subclasses are RuntimeErrors).
_STORE_ERRORS = (RuntimeError, ValueError, TimeoutError, OSError)


@contextlib.contextmanager
def _translated(endpoint: str, what: str) -> Iterator[None]:
    """Turn a torch/socket error into RendezvousConnectionError naming ``endpoint``."""
    try:
        yield
    except _STORE_ERRORS as exc:
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise RendezvousConnectionError(
            f"c10d rendezvous store at {endpoint}: {what} failed: {first_line} "
            f"(the store lives in the agent whose address matches the endpoint: "
            f"has it exited or died, or is the network down?)"
        ) from exc


#: Store methods that talk to the server (and can block on it).
_BLOCKING = frozenset({"get", "set", "add", "compare_set", "multi_get", "multi_set", "wait", "check",
                       "delete_key", "num_keys"})
#: Seconds a bounded call may take beyond the store's own timeout before it is abandoned.
_GRACE = 2.0


class BoundedStore:
    """A torch Store whose server calls give up after ``timeout`` seconds.

    torch's TCPStore client does not return when its server stalls silently (a cut
    link, a frozen host): it logs that its socket timed out and goes on waiting.
    An agent must never hang on that, so each call runs on a helper thread and the
    caller gets RendezvousConnectionError (naming the endpoint) once ``timeout``
    seconds pass. The stuck call is left to finish or die with the process (daemon
    thread). Other attributes pass through unchanged.

    Args:
        store: the torch Store (TCPStore, PrefixStore, FileStore).
        endpoint: its address, for messages.
        timeout: seconds a call may take (read_timeout plus a small grace).
    """

    def __init__(self, store: Any, endpoint: str, timeout: float) -> None:
        self.store, self._endpoint, self._timeout = store, endpoint, timeout

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.store, name)
        if name not in _BLOCKING:
            return attr

        def bounded(*args: Any, **kwargs: Any) -> Any:
            outcome: list = []
            done = threading.Event()

            def run() -> None:
                try:
                    outcome.append((True, attr(*args, **kwargs)))
                except BaseException as exc:  # noqa: BLE001 - re-raised in the caller
                    outcome.append((False, exc))
                finally:
                    done.set()

            threading.Thread(target=run, name=f"elaunch-store-{name}", daemon=True).start()
            if not done.wait(self._timeout):
                raise RendezvousConnectionError(
                    f"c10d rendezvous store at {self._endpoint}: no answer to {name} within {self._timeout:g} s "
                    f"(the store lives in the agent whose address matches the endpoint: "
                    f"has it exited or died, or is the network down?)"
                )
            ok, value = outcome[0]
            if not ok:
                raise value
            return value

        return bounded
