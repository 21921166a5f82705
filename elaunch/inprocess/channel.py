"""The agent's end of the control channel: one listening socket, one thread, one connection per worker.

The socket is a Unix stream socket in the abstract namespace (no file to remove, gone
with the agent), named for this run and a random suffix; every worker gets the name in
``ELAUNCH_CONTROL`` (:data:`~elaunch.inprocess.wire.CONTROL_ENV`), whether it starts
cold, from a warm spare or forked, so no descriptor has to be handed to it. A peer is
known by its kernel credentials (``SO_PEERCRED``), never by what it writes:

* another user's process is closed at once;
* a process that is not one of the agent's current workers (:meth:`Channel.expect`)
  is not read from; it is closed after :data:`PENDING_S` seconds, and at most
  :data:`MAX_PENDING` wait at once (the oldest is closed first): a worker whose pid the
  agent learns a moment after it connected (a warm spare runs at once) is read then;
* a line that is not a well-formed worker message (:mod:`~elaunch.inprocess.wire`)
  closes its connection with one log line.

The thread only reads: each good message is queued, for the agent's main thread to
take (:meth:`Channel.take`); a ``raised`` or a ``ready`` wakes the agent (``wake``): its
monitor, or its wait for the interrupted workers' ``ready``.
The main thread sends (:meth:`Channel.send`). The channel is a helper of the run's
supervisor (tier ``THREADS``, policy ``OFF``): its descriptors are closed in forked
workers, and if its thread dies the job goes on with full restarts. torchrun has no
such channel. Stdlib only.
"""

from __future__ import annotations

import logging
import os
import secrets
import selectors
import socket
import struct
import threading
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

from elaunch.inprocess.wire import BadMessage, LineReader, decode_worker, encode
from elaunch.supervision import HelperDied

log = logging.getLogger("elaunch.agent")

#: The op :meth:`Channel.take` reports when a worker's connection ended (not a wire op: none can forge it).
GONE = "gone"
#: Seconds a connection from a process that is not (yet) a worker of the agent is kept unread.
PENDING_S = 5.0
#: Connections from unknown processes kept at once; the oldest is closed for a new one.
MAX_PENDING = 16
#: Seconds one send may block on a worker that does not read (a stopped one), before it counts as gone.
SEND_TIMEOUT = 2.0
#: Seconds between the thread's looks at its stop event and pending connections.
TICK = 0.2
_UCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


@dataclass
class _Conn:
    sock: socket.socket
    pid: int
    since: float
    reader: LineReader = field(default_factory=LineReader)
    read: bool = False  # registered for reading: its pid is a worker's


class Channel:
    """The listening socket and its thread. Call :meth:`open` once; use from the agent's main thread.

    Args:
        run_id: the job's id, part of the socket's name (for ``ss -x`` readers).
        wake: called (from the channel's thread) when a ``raised`` or a ``ready`` arrives: the
            agent's monitor, or its wait for the interrupted workers, looks at once
            (``WorkerProcesses.wakeup``). May be replaced later (:attr:`wake`).

    Attributes:
        name: how the supervisor's lines name it.
        address: the abstract socket's name (without the leading NUL).
        wake: see Args.
    """

    name = "in-process control channel"

    def __init__(self, run_id: str, wake: Callable[[], None] | None = None) -> None:
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in run_id)[:40]
        self.address = f"elaunch-control-{safe}-{os.getpid()}-{secrets.token_hex(8)}"
        self.wake = wake
        self._uid = os.getuid()
        self._lock = threading.Lock()
        self._expected: frozenset[int] = frozenset()
        self._conns: dict[int, _Conn] = {}  # fd -> connection
        self._inbox: list[tuple[int, dict, float]] = []
        self._queued: dict[int, bytes] = {}  # pid -> a message for an expected worker that has not connected yet
        self._listener: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._told = False

    # ------------------------------------------------------------ the helper's shape (supervision.Helper)

    def open(self) -> "Channel":
        """Bind and listen; start the thread. Returns self.

        Raises:
            OSError: the socket cannot be bound (e.g. no abstract namespace: not Linux).
        """
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            sock.bind("\0" + self.address)
            sock.listen(64)
            sock.setblocking(False)
        except OSError:
            sock.close()
            raise
        self._listener = sock
        self._thread = threading.Thread(target=self._run, name="elaunch-control", daemon=True)
        self._thread.start()
        return self

    def check(self) -> bool:
        """Raise ``HelperDied`` once when the thread died of an exception; never restarts it (False)."""
        if self._error is not None and not self._told:
            self._told = True
            raise HelperDied(f"{self.name} thread died: {type(self._error).__name__}: {self._error}")
        return False

    def private_fds(self) -> tuple[int, ...]:
        """The listening socket and every connection: a worker forked from the agent closes them."""
        with self._lock:
            fds = list(self._conns)
        if self._listener is not None:
            fds.append(self._listener.fileno())
        return tuple(fd for fd in fds if fd >= 0)

    def close(self) -> None:
        """Stop the thread; close every connection and the listener. Idempotent."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(5.0)
        with self._lock:
            conns, self._conns = list(self._conns.values()), {}
        for conn in conns:
            conn.sock.close()
        if self._listener is not None:
            self._listener.close()
            self._listener = None

    # ------------------------------------------------------------ the agent's main thread

    def expect(self, pids: Collection[int]) -> None:
        """The pids of the agent's workers from now on: only they are read; others wait to be closed."""
        with self._lock:
            self._expected = frozenset(pids)
            self._queued = {pid: data for pid, data in self._queued.items() if pid in self._expected}
        # the thread (un)registers the connections at its next tick

    def take(self) -> list[tuple[int, dict, float]]:
        """Every message queued since the last call, oldest first: ``(pid, message, arrival)``.

        ``arrival``: when the thread read it, seconds since the epoch (a "raised" is dated by it).
        Besides the worker's messages, ``{"op": "gone"}`` (:data:`GONE`, no op a worker can send)
        when a worker's connection reached its end: a killed worker's sockets close as it dies,
        before the agent can see its exit, so this dates its death better than its exit does.
        """
        with self._lock:
            out, self._inbox = self._inbox, []
        return out

    def send(self, pid: int, msg: dict, queue: bool = False) -> bool:
        """Send ``msg`` to the worker with ``pid`` (its latest connection); False when it has none or it failed.

        Args:
            pid: an expected worker's (:meth:`expect`); any other gets nothing (False).
            msg: the message (:mod:`~elaunch.inprocess.wire`'s agent ops).
            queue: when the worker has not connected yet, keep ``msg`` and send it as its connection is
                accepted (True: queued): a replacement started before its round (``wire.PRESTART_ENV``)
                may still be on its way to the wrapper when the round's "go" is due. One message is
                kept per pid (the last); :meth:`expect` without the pid drops it.
        """
        with self._lock:
            if pid not in self._expected:
                return False
            conn = next((c for c in reversed(list(self._conns.values())) if c.pid == pid), None)
            if conn is None:
                if queue:
                    self._queued[pid] = encode(msg)
                return queue
        try:
            conn.sock.settimeout(SEND_TIMEOUT)
            conn.sock.sendall(encode(msg))
            return True
        except OSError as exc:
            log.warning("in-process restart: cannot send %s to worker %d: %s", msg.get("op"), pid, exc)
            return False
        finally:
            try:
                conn.sock.setblocking(False)
            except OSError:
                pass

    def connected(self, pid: int) -> bool:
        """True while the worker with ``pid`` (an expected one) has a connection."""
        with self._lock:
            return pid in self._expected and any(c.pid == pid for c in self._conns.values())

    # ------------------------------------------------------------ the thread

    def _run(self) -> None:
        try:
            with selectors.DefaultSelector() as sel:
                sel.register(self._listener, selectors.EVENT_READ)
                while not self._stop.is_set():
                    for key, _ in sel.select(TICK):
                        if key.fileobj is self._listener:
                            self._accept()
                        else:
                            self._receive(sel, key.fileobj)
                    self._tend(sel)
        except BaseException as exc:  # noqa: BLE001 - reported by check()
            if not self._stop.is_set():
                log.debug("the control channel's thread died", exc_info=True)
                self._error = exc

    def _accept(self) -> None:
        try:
            sock, _ = self._listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        try:
            pid, uid, _gid = _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
        except OSError:
            sock.close()
            return
        if uid != self._uid:  # another user's process: never a worker of ours
            sock.close()
            return
        with self._lock:
            self._conns[sock.fileno()] = _Conn(sock, pid, time.monotonic())
            queued = self._queued.pop(pid, None)
            if queued is not None:  # a fresh connection's buffer is empty: this never waits long
                try:
                    sock.settimeout(SEND_TIMEOUT)
                    sock.sendall(queued)
                except OSError as exc:  # closed: the worker's wait ends, it exits 1 and fails its round
                    log.warning("in-process restart: cannot send a queued message to worker %d: %s", pid, exc)
                    del self._conns[sock.fileno()]
                    sock.close()
                    return
        sock.setblocking(False)

    def _tend(self, sel: selectors.BaseSelector) -> None:
        """Register connections of expected pids; close those of unknown pids past :data:`PENDING_S`, or too many."""
        now = time.monotonic()
        with self._lock:
            pending = []
            for fd, conn in list(self._conns.items()):
                if conn.pid in self._expected and not conn.read:
                    conn.read = True
                    sel.register(conn.sock, selectors.EVENT_READ)
                elif conn.pid not in self._expected:
                    if conn.read:  # no longer expected (expect() changed): stop reading it
                        conn.read = False
                        sel.unregister(conn.sock)
                    pending.append(conn)
            pending.sort(key=lambda c: c.since)
            drop = [c for c in pending if now - c.since > PENDING_S] + pending[:max(0, len(pending) - MAX_PENDING)]
            for conn in drop:
                if self._conns.pop(conn.sock.fileno(), None) is not None:
                    conn.sock.close()

    def _receive(self, sel: selectors.BaseSelector, sock: socket.socket) -> None:
        with self._lock:
            conn = self._conns.get(sock.fileno())
        if conn is None:
            return
        try:
            data = sock.recv(65536)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        try:
            if not data:
                raise EOFError
            msgs = [decode_worker(line) for line in conn.reader.feed(data) if line.strip()]
        except BadMessage as exc:
            log.warning("in-process restart: closed the control connection of pid %d: %s", conn.pid, exc)
            msgs = None
        except EOFError:
            msgs = None
        if msgs is None:
            sel.unregister(sock)
            with self._lock:
                self._conns.pop(sock.fileno(), None)
                if not data:  # the worker closed its end, or died: its sockets closed now (see take())
                    self._inbox.append((conn.pid, {"op": GONE}, time.time()))
            sock.close()
            return
        with self._lock:
            now = time.time()
            self._inbox.extend((conn.pid, m, now) for m in msgs)
        if any(m["op"] in ("raised", "ready") for m in msgs) and self.wake is not None:
            self.wake()
