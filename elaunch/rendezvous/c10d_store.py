"""c10d's store access: torch Store calls bounded in time, their errors translated.

Split from ``c10d.py``: every call the c10d rendezvous makes on a TCPStore goes
through :class:`BoundedStore` (a server that stalls silently must not hang an
agent) and :func:`_translated` (a torch/socket error becomes a
RendezvousConnectionError naming the endpoint). Imports nothing from torch.
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
import time
from typing import Any, Iterator

from elaunch.rendezvous.contract import RendezvousConnectionError

#: The end of every store error message: where the store lives, and what to check.
_WHERE_THE_STORE_IS = ("(the store lives in the agent whose address matches the endpoint: "
                       "has it exited or died, or is the network down?)")
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
            f"c10d rendezvous store at {endpoint}: {what} failed: {first_line} {_WHERE_THE_STORE_IS}"
        ) from exc


#: Store methods that talk to the server (and can block on it).
_BLOCKING = frozenset({"get", "set", "add", "compare_set", "multi_get", "multi_set", "wait", "check",
                       "delete_key", "num_keys"})
#: Seconds a bounded call may take beyond the store's own timeout before it is abandoned.
_GRACE = 2.0


class _Worker(threading.Thread):
    """A daemon thread that runs the store calls handed to it, one at a time.

    Idle workers wait in :data:`_idle`; a bounded call takes one (or starts one)
    instead of starting a thread per call (at 1024 simulated agents, thread starts
    were a tenth of a round's CPU). A worker whose call hangs (a stalled server)
    stays with that call and returns to the pool only if it ever finishes; one idle
    for :data:`_IDLE_EXIT` seconds exits.
    """

    def __init__(self) -> None:
        super().__init__(name="elaunch-store", daemon=True)
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()

    def run(self) -> None:
        while True:
            try:
                job = self.jobs.get(timeout=_IDLE_EXIT)
            except queue.Empty:
                with _idle_lock:
                    if self in _idle:  # nobody took us meanwhile: leave the pool for good
                        _idle.remove(self)
                        return
                continue  # taken just now: its job is on the way
            job.run()
            with _idle_lock:  # idle again before the caller wakes: its next call finds us
                _idle.append(self)
            job.finished.release()


class _Job:
    """One call for a :class:`_Worker`; its worker releases ``finished`` once the outcome is set.

    ``name`` is the store method's (for messages), ``started`` when the call was made
    (``time.monotonic()``), ``done`` whether it returned (read by :class:`StoreLine`).
    """

    __slots__ = ("fn", "args", "kwargs", "name", "started", "done", "ok", "value", "finished")

    def __init__(self, fn: Any, args: tuple, kwargs: dict, name: str = "") -> None:
        self.fn, self.args, self.kwargs, self.name = fn, args, kwargs, name
        self.started, self.done = time.monotonic(), False
        self.ok, self.value = False, None
        self.finished = threading.Lock()
        self.finished.acquire()

    def run(self) -> None:
        try:
            self.value, self.ok = self.fn(*self.args, **self.kwargs), True
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller
            self.value = exc
        finally:
            self.done = True


#: Seconds an idle store worker waits for a call before it exits.
_IDLE_EXIT = 60.0
_idle: list[_Worker] = []
_idle_lock = threading.Lock()
# a forked child has none of its parent's threads: its pool starts empty
os.register_at_fork(after_in_child=_idle.clear)


def _submit(job: _Job) -> None:
    """Hand ``job`` to an idle worker, or to a new one."""
    with _idle_lock:
        worker = _idle.pop() if _idle else None
    if worker is None:
        worker = _Worker()
        worker.start()
    worker.jobs.put(job)


class StoreLine:
    """The one connection a torch store client sends its calls on, one call at a time.

    torch's TCPStore client holds a lock around each call: a call made while an
    earlier one hangs waits behind it. The :class:`BoundedStore` wrappers of one
    client (the agent store, its per-round prefixes) share one line, so that once
    a call of theirs was abandoned (no answer within the timeout: the store has
    been silent that long) the calls made while it still hangs fail at once,
    instead of each waiting out a timeout of its own behind it. A cut-off agent's
    job read, rendezvous and close took three timeouts in a row (36 s at
    ``read_timeout=10``); now they take one. Once the abandoned call returns, calls
    go through again.

    Attributes:
        stuck: the abandoned call still in flight, or None.
    """

    def __init__(self) -> None:
        self.stuck: _Job | None = None

    def blocked_by(self) -> _Job | None:
        """The abandoned call that still hangs (a new call would wait behind it), or None."""
        stuck = self.stuck
        if stuck is not None and stuck.done:
            self.stuck = None
            return None
        return stuck


class BoundedStore:
    """A torch Store whose server calls give up after ``timeout`` seconds.

    torch's TCPStore client does not return when its server stalls silently (a cut
    link, a frozen host): it logs that its socket timed out and goes on waiting.
    An agent must never hang on that, so each call runs on a pooled worker thread
    (:class:`_Worker`, reused across calls and stores) and the caller gets
    RendezvousConnectionError (naming the endpoint) once ``timeout`` seconds pass.
    The stuck call is left to finish or die with the process (daemon thread);
    while it hangs, later calls on the same ``line`` raise at once (:class:`StoreLine`).
    Other attributes pass through unchanged.

    Args:
        store: the torch Store (TCPStore, PrefixStore, FileStore).
        endpoint: its address, for messages.
        timeout: seconds a call may take (read_timeout plus a small grace).
        line: the client connection this store's calls share with other wrappers
            of the same client; None: a line of its own.
    """

    def __init__(self, store: Any, endpoint: str, timeout: float, line: StoreLine | None = None) -> None:
        self.store, self._endpoint, self._timeout = store, endpoint, timeout
        self._line = StoreLine() if line is None else line

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.store, name)
        if name not in _BLOCKING:
            return attr

        def bounded(*args: Any, **kwargs: Any) -> Any:
            stuck = self._line.blocked_by()
            if stuck is not None:
                raise RendezvousConnectionError(
                    f"c10d rendezvous store at {self._endpoint}: no answer to {name}: an earlier "
                    f"{stuck.name} has had no answer for {time.monotonic() - stuck.started:.0f} s "
                    f"{_WHERE_THE_STORE_IS}"
                )
            job = _Job(attr, args, kwargs, name)
            _submit(job)
            if not job.finished.acquire(timeout=self._timeout):
                self._line.stuck = job
                raise RendezvousConnectionError(
                    f"c10d rendezvous store at {self._endpoint}: no answer to {name} within {self._timeout:g} s "
                    f"{_WHERE_THE_STORE_IS}"
                )
            if not job.ok:
                raise job.value
            return job.value

        return bounded
