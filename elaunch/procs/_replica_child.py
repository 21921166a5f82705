"""The replica service's child: keeps copies of peers' snapshots and sends this node's to its ring.

``python elaunch/procs/_replica_child.py FD NODE_DIR``: FD is this end of a
``SOCK_SEQPACKET`` socket pair with the agent (``replicas.py``), NODE_DIR the
agent's node directory. Messages from the agent, one per packet:

* ``listen`` with a descriptor attached: the TCP socket the agent listens on; peers'
  connections are served from it, one thread each.
* ``ring [[HOST, PORT], ...]`` (JSON): this round's successors. One thread per
  successor keeps one connection to it and sends it this node's newest committed
  snapshot of each rank when it changed (:func:`to_send`); ``ring []`` stops sending.
* ``stats``: answered by one JSON packet of counters (:data:`COUNTERS`).
* end of file (the agent closed its end, or died): exit.

Between agents, the connecting side sends requests, each a JSON line answered by one:

* ``{"op": "put", "rank", "step", "seq", "time", "size", "replicated"}`` -> ``{"go": bool}``
  (false: this node has that snapshot or a newer one of that rank, or no room, or, of
  replicated state, its own ranks saved that step or a newer one: see :meth:`Server._own_has`). After a go:
  ``size`` bytes of the slot file and one mark byte, ``=`` (its seq did not change
  during the read) or ``x`` (a write began: discard) -> ``{"ok": bool}``. The bytes go
  to ``replicas/.r<rank>.tmp-<pid>-<n>`` (0600), renamed to ``replicas/r<rank>`` when
  marked ``=``, parsed by ``slotfile.read_info`` as announced, and not older than the
  replica there (the newest step wins).
* ``{"op": "get", "rank", "step"}`` -> ``{"size": N}``, N bytes and the mark, from
  ``replicas/r<rank>`` or a local slot of that rank and step; or ``{"size": 0}``.

Bytes leave a file by ``sendfile`` (no copy in Python; a file truncated under it ends
the send short, where a mapping would fault) and land in a mapping of the new file
whose pages were reserved (``posix_fallocate``: a full ``/dev/shm`` is ENOSPC, not a
SIGBUS). Stdlib only (no torch); the agent's ``fetch`` imports the wire functions.
"""

from __future__ import annotations

import json
import logging
import mmap
import os
import socket
import sys
import threading
import time

if __package__:
    from ..checkpoint import slotfile
else:  # run as a script: load the sibling package's slot-file module by path, without elaunch's imports
    import importlib.util
    _spec = importlib.util.spec_from_file_location("_elaunch_slotfile", os.path.join(
        os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "checkpoint", "slotfile.py"))
    slotfile = sys.modules[_spec.name] = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(slotfile)

log = logging.getLogger("elaunch.procs.replica_service")

SCAN = 0.05  #: seconds between looks at the slots' headers
CHUNK = 4 << 20  #: bytes received per read into the new file's mapping
IO_TIMEOUT = 30.0  #: seconds one blocking read or write on a connection may wait for its peer
BACKOFF = (0.1, 5.0)  #: seconds before reconnecting to a successor after an error: first, most
MAX_LINE = 4096  #: bytes of a request or answer line, at most
OWN_GRACE = 0.5  #: seconds an offer of replicated state waits for this node's ranks to commit that step
COUNTERS = ("sent", "skipped", "torn", "received", "refused", "own", "discarded", "served")


class Stats:
    """Counters a test or the agent's status can read (``stats`` on the channel)."""

    def __init__(self) -> None:
        self.lock, self.counts = threading.Lock(), dict.fromkeys(COUNTERS, 0)

    def add(self, name: str) -> None:
        with self.lock:
            self.counts[name] += 1


def tune(sock: socket.socket) -> socket.socket:
    """Set TCP_NODELAY and keepalive on a connection (buffers: the kernel's autotuning)."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    return sock


def send_json(sock: socket.socket, obj: dict) -> None:
    sock.sendall(json.dumps(obj).encode("ascii") + b"\n")


def read_json(rfile) -> dict:
    """One JSON line from ``rfile`` (a binary buffered reader). Raises ConnectionError at end of file."""
    line = rfile.readline(MAX_LINE)
    if not line.endswith(b"\n"):
        raise ConnectionError("connection closed" if not line else "request line too long")
    obj = json.loads(line)
    if not isinstance(obj, dict):
        raise ValueError(f"not a JSON object: {line[:80]!r}")
    return obj


def receive_file(rfile, path: str, size: int, deadline: float | None = None, sock=None) -> bytes:
    """Receive ``size`` bytes and the mark byte into a new file ``path`` (0600); return the mark.

    Raises:
        OSError: no such file can be made (ENOSPC: ``/dev/shm`` is full), the peer closed early
            (ConnectionError), or ``deadline`` (``time.monotonic()``) passed (TimeoutError).
    """
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.posix_fallocate(fd, 0, size)  # pages reserved: a full /dev/shm fails here, not as a SIGBUS below
        with mmap.mmap(fd, size) as buf:
            view, got = memoryview(buf), 0
            try:
                while got < size:
                    if deadline is not None:  # the socket's timeout is per call: the whole receipt has one
                        if deadline <= time.monotonic():
                            raise TimeoutError("timed out receiving a snapshot")
                        sock.settimeout(deadline - time.monotonic())
                    n = rfile.readinto(view[got:got + CHUNK])
                    if not n:
                        raise ConnectionError(f"connection closed after {got} of {size} bytes")
                    got += n
            finally:
                view.release()
    finally:
        os.close(fd)
    mark = rfile.read(1)
    if not mark:
        raise ConnectionError("connection closed before the end mark")
    return mark


def open_info(path: str) -> tuple[int, "slotfile.SlotInfo"] | None:
    """``(fd, info)``: ``path`` opened and parsed through the descriptor (one file's, whatever renames), or None."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    info = slotfile.read_info(f"/proc/self/fd/{fd}")
    if info is None:
        os.close(fd)
        return None
    return fd, info


def send_file(sock: socket.socket, fd: int, info: "slotfile.SlotInfo") -> bool:
    """Send the snapshot's bytes from ``fd``, then its mark; True if it was still whole (mark ``=``).

    Raises:
        OSError: the connection failed, or the file ended early (ConnectionError).
    """
    with os.fdopen(os.dup(fd), "rb", buffering=0) as f:
        sent = sock.sendfile(f, 0, info.size)
    if sent != info.size:
        raise ConnectionError(f"{info.path}: sent {sent} of {info.size} bytes (the file shrank)")
    whole = slotfile.seq_of(os.pread(fd, 16, 0)) == info.seq
    sock.sendall(b"=" if whole else b"x")
    return whole


class Server:
    """Serves peers' PUTs and GETs on the agent's listening socket, one thread per connection."""

    def __init__(self, node_dir: str, stats: Stats) -> None:
        self.node_dir = node_dir
        self.replicas = os.path.join(node_dir, "replicas")
        self.stats = stats
        self._lock = threading.Lock()  # one rename decision at a time
        self._n = 0

    def serve(self, listener: socket.socket) -> None:
        threading.Thread(target=self._accept, args=(listener,), name="accept", daemon=True).start()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError as exc:  # out of descriptors, a connection reset in the backlog: try again
                log.warning("replica service: accept failed: %s", exc)
                time.sleep(BACKOFF[0])
                continue
            threading.Thread(target=self._connection, args=(conn,), name="peer", daemon=True).start()

    def _connection(self, conn: socket.socket) -> None:
        tune(conn)
        try:
            with conn, conn.makefile("rb") as rfile:
                while True:
                    conn.settimeout(None)  # a peer's connection idles between its saves
                    req = read_json(rfile)
                    conn.settimeout(IO_TIMEOUT)
                    if req.get("op") == "put":
                        self._put(conn, rfile, req)
                    elif req.get("op") == "get":
                        self._get(conn, int(req["rank"]), int(req["step"]))
                    else:
                        raise ValueError(f"unknown request {req!r}")
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.debug("replica service: a peer's connection ended: %s", exc)

    def _put(self, conn: socket.socket, rfile, req: dict) -> None:
        rank, step, seq, stamp, size = (int(req["rank"]), int(req["step"]), int(req["seq"]), float(req["time"]),
                                        int(req["size"]))
        if req.get("replicated") and self._own_has(step):
            self.stats.add("own")
            send_json(conn, {"go": False})
            return
        final = os.path.join(self.replicas, f"r{rank}")
        have, room = slotfile.read_info(final), os.statvfs(self.replicas)
        if (have is not None and (have.step, have.time) >= (step, stamp)) or room.f_bavail * room.f_frsize < size:
            self.stats.add("refused")
            send_json(conn, {"go": False})
            return
        send_json(conn, {"go": True})
        with self._lock:
            self._n += 1
            tmp = os.path.join(self.replicas, f".r{rank}.tmp-{os.getpid()}-{self._n}")
        try:
            mark = receive_file(rfile, tmp, size)
            info = slotfile.read_info(tmp)
            ok = mark == b"=" and info is not None and (info.rank, info.step, info.seq, info.size) == (
                rank, step, seq, size)
            with self._lock:
                have = slotfile.read_info(final)
                if ok and (have is None or (have.step, have.time) <= (info.step, info.time)):
                    os.replace(tmp, final)  # the newest step wins
                    self.stats.add("received")
                else:
                    ok = False
                    self.stats.add("discarded")
        finally:
            _unlink(tmp)  # gone already when it was renamed
        send_json(conn, {"ok": ok})

    def _own_has(self, step: int) -> bool:
        """Whether this node's own ``slots/`` hold replicated state of ``step`` or newer, waiting up to
        :data:`OWN_GRACE` seconds for a save of it that is about to commit. Any rank's snapshot of replicated
        state serves any rank: this node can serve that step itself, and a copy would be redundant."""
        deadline = time.monotonic() + OWN_GRACE
        while True:
            own = [info.step for info in slotfile.inventory(self.node_dir, ("slots",)) if info.replicated]
            if own and max(own) >= step:
                return True
            if (own and max(own) < step - 1) or time.monotonic() >= deadline:
                return False  # more than a step behind (or the grace is over): no save of it is under way
            time.sleep(SCAN / 5)

    def _get(self, conn: socket.socket, rank: int, step: int) -> None:
        held = slotfile.inventory(self.node_dir, ("slots",))
        for path in [os.path.join(self.replicas, f"r{rank}"), *(i.path for i in held if i.rank == rank)]:
            opened = open_info(path)
            if opened is None:
                continue
            fd, info = opened
            try:
                if info.rank == rank and info.step == step:
                    send_json(conn, {"size": info.size})
                    send_file(conn, fd, info)
                    self.stats.add("served")
                    return
            finally:
                os.close(fd)
        send_json(conn, {"size": 0})


def to_send(node_dir: str) -> dict[int, "slotfile.SlotInfo"]:
    """This node's newest committed snapshot of each global rank in ``slots/``, one for replicated state.

    Replicated state (``slotfile.REPLICATED``: DDP) is the same on every rank and any
    rank's snapshot serves any rank, so of the ranks whose newest snapshot is
    replicated only the lowest is sent (a node of 8 ranks sends one copy, not 8).
    """
    by_rank: dict[int, list] = {}
    for info in slotfile.inventory(node_dir, ("slots",)):
        by_rank.setdefault(info.rank, []).append(info)
    newest = {rank: slotfile.newest(infos) for rank, infos in by_rank.items()}
    shared = sorted(rank for rank, info in newest.items() if info.replicated)
    return {rank: info for rank, info in newest.items() if not info.replicated or rank == shared[0]}


class Link:
    """One successor: a thread that keeps one connection to it and sends it this node's new snapshots."""

    def __init__(self, node_dir: str, peer: tuple[str, int], stats: Stats) -> None:
        self.peer, self.node_dir, self.stats = peer, node_dir, stats
        self.sent: dict[int, tuple] = {}  # rank -> (path, seq, step, time) of the snapshot it has
        self._stop = threading.Event()
        self._sock: socket.socket | None = None
        threading.Thread(target=self._run, name=f"link {peer[0]}:{peer[1]}", daemon=True).start()

    def stop(self) -> None:
        """End the thread; a send under way is cut (the peer discards what it got)."""
        self._stop.set()
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except (AttributeError, OSError):  # no connection
            pass

    def _run(self) -> None:
        backoff, warned = BACKOFF[0], False
        while not self._stop.is_set():
            try:
                with tune(socket.create_connection(self.peer, timeout=IO_TIMEOUT)) as sock:
                    self._sock = sock
                    if self._stop.is_set():
                        return
                    with sock.makefile("rb") as rfile:
                        backoff, warned = BACKOFF[0], False
                        while not self._stop.is_set():
                            if not self._send_changed(sock, rfile):
                                self._stop.wait(SCAN)
            except (OSError, ValueError, KeyError) as exc:
                if not self._stop.is_set():
                    (log.debug if warned else log.warning)(
                        "replica service: sending to %s:%s failed (%s); retrying", *self.peer, exc)
                    warned = True
            finally:
                self._sock = None
            self._stop.wait(backoff)
            backoff = min(backoff * 2, BACKOFF[1])

    def _send_changed(self, sock: socket.socket, rfile) -> bool:
        """Send each rank's newest snapshot the peer was not sent yet; True if any was tried."""
        tried = False
        for rank, seen in to_send(self.node_dir).items():
            if self.sent.get(rank) == (seen.path, seen.seq, seen.step, seen.time):
                continue
            opened = open_info(seen.path)
            if opened is None:
                continue  # a write began since the scan: look again
            fd, info = opened
            try:
                tried = True
                key = (seen.path, info.seq, info.step, info.time)
                send_json(sock, {"op": "put", "rank": info.rank, "step": info.step, "seq": info.seq,
                                 "time": info.time, "size": info.size, "replicated": info.replicated})
                if not read_json(rfile)["go"]:
                    self.sent[rank] = key  # it has this one or a newer one
                    self.stats.add("skipped")
                    continue
                whole = send_file(sock, fd, info)
                if read_json(rfile)["ok"] and whole:
                    self.sent[rank] = key
                    self.stats.add("sent")
                else:
                    self.stats.add("torn")  # the newest is sent at the next look
            finally:
                os.close(fd)
        return tried


class Ring:
    """The successors of this round: one :class:`Link` each."""

    def __init__(self, node_dir: str, stats: Stats) -> None:
        self.node_dir, self.stats = node_dir, stats
        self.links: dict[tuple[str, int], Link] = {}

    def set(self, peers: list[tuple[str, int]]) -> None:
        for peer in [p for p in self.links if p not in peers]:
            self.links.pop(peer).stop()
        for peer in peers:
            if peer not in self.links:
                self.links[peer] = Link(self.node_dir, peer, self.stats)


def _clean(replicas: str) -> None:
    """Remove receipts a previous child left unfinished (it was killed mid-receipt)."""
    names = os.listdir(replicas) if os.path.isdir(replicas) else []  # the agent made it
    for name in [n for n in names if n.startswith(".")]:
        _unlink(os.path.join(replicas, name))


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def main(fd: int, node_dir: str) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    chan = socket.socket(fileno=fd)
    _clean(os.path.join(node_dir, "replicas"))
    stats = Stats()
    server, ring = Server(node_dir, stats), Ring(node_dir, stats)
    while True:
        try:
            msg, fds, _flags, _addr = socket.recv_fds(chan, 65536, 1)
        except OSError:
            return 0
        if not msg:
            return 0  # the agent is gone
        word, _, rest = msg.decode("utf-8", "replace").partition(" ")
        if word == "listen" and fds:
            server.serve(socket.socket(fileno=fds.pop()))
        elif word == "ring":
            ring.set([(str(h), int(p)) for h, p in json.loads(rest)])
        elif word == "stats":
            with stats.lock:
                chan.send(json.dumps(stats.counts).encode("ascii"))
        else:
            log.warning("replica service: unknown message %r", msg[:80])
        for extra in fds:
            os.close(extra)


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]), sys.argv[2]))
