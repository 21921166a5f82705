"""The replica service's child: keeps copies of peers' snapshots and sends this node's to its ring.

``python elaunch/checkpoint/_replica_child.py FD NODE_DIR``: FD is this end of a
``SOCK_SEQPACKET`` socket pair with the agent (``replicas.py``), NODE_DIR the
agent's node directory. Messages from the agent, one per packet:

* ``conf {"key": HEX, "source": HOST, "members": [HOST, ...] | null}`` (JSON): the key
  peers must prove they hold, this node's address (the source of its own connections)
  and the current round's nodes (:meth:`Server.configure`; sent before ``listen`` and
  again at each round).
* ``listen`` with a descriptor attached: the TCP socket the agent listens on; peers'
  connections are served from it (:class:`Server`), one thread each, once they pass
  the member check and the handshake (``replica_wire``), within the bounds of a
  :class:`Gate`.
* ``ring [[HOST, PORT, KEY], ...]`` (JSON): this round's successors and their keys. One
  thread per successor (:class:`Link`) keeps one authenticated connection to it and
  sends it this node's newest committed snapshot of each rank when it changed
  (:func:`to_send`); ``ring []`` stops sending.
* ``stats``: answered by one JSON packet of counters (:data:`COUNTERS`).
* end of file (the agent closed its end, or died): exit.

Every :data:`PRUNE_EVERY` seconds the child removes the replicas of replicated state
that a newer replicated snapshot on this node supersedes (:func:`superseded`): the job
restores the highest step every rank can get, and any snapshot of replicated state
serves every rank, so they can never be restored again. Without this, each round whose
ring changed left a full copy of the state behind (``r<rank>`` is named by the lowest
rank of its sender's node) until the run ended. Sharded replicas stay, two per rank as
the slots are: the newest step (``r<rank>``) and the one it replaced
(``r<rank>`` + :data:`PREVIOUS`). A node sends its ranks' copies of a step one after
another, so one killed between two of them leaves some ranks' newest copies at the step
before; the job then restores that step, which every rank's copy (the newest or the one
kept) still holds, instead of starting fresh.

Between agents the requests and answers are ``replica_wire``'s (its docstring has the
format). Stdlib only (no torch, none of elaunch's imports when run as a script).
"""

from __future__ import annotations

import collections
import ipaddress
import json
import logging
import os
import socket
import sys
import threading
import time

if __package__:
    from . import replica_wire as wire
else:  # run as a script: load the sibling module by path (whatever PYTHONSAFEPATH says), without elaunch's imports
    import importlib.util
    _spec = importlib.util.spec_from_file_location(
        "_elaunch_replica_wire", os.path.join(os.path.dirname(os.path.abspath(__file__)), "replica_wire.py"))
    wire = sys.modules[_spec.name] = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(wire)

slotfile = wire.slotfile  # loaded by path when run as a script
log = logging.getLogger("elaunch.procs.replica_service")

SCAN = 0.05  #: seconds between looks at the slots' headers
BACKOFF = (0.1, 5.0)  #: seconds before reconnecting to a successor after an error: first, most
OWN_GRACE = 0.5  #: seconds an offer of replicated state waits for this node's ranks to commit that step
PING_EVERY = 30.0  #: seconds of an idle sender's connection between two pings (the server's idle limit is 120)
PRUNE_EVERY = 1.0  #: seconds between looks for superseded replicas (:func:`superseded`)
PREVIOUS = ".prev"  #: suffix of a rank's replica of the step before its newest one (``r3`` -> ``r3.prev``)
MAX_PENDING = 16  #: connections in their handshake at once; a new one beyond this closes the oldest
MAX_PEERS = 64  #: authenticated connections at once; one more is closed after its handshake
WARN_EVERY = 60.0  #: seconds between two warnings about refused connections
COUNTERS = ("sent", "skipped", "torn", "received", "refused", "own", "discarded", "served", "pruned",
            "strangers", "unauthenticated", "evicted", "over_limit")


class Stats:
    """Counters a test or the agent's status can read (``stats`` on the channel)."""

    def __init__(self) -> None:
        self.lock, self.counts = threading.Lock(), dict.fromkeys(COUNTERS, 0)

    def add(self, name: str) -> None:
        with self.lock:
            self.counts[name] += 1


class Gate:
    """Bounds on the connections being served: so the child's threads, whatever a flood of connections does.

    A connection is *pending* from its accept until its handshake ends; at most
    ``max_pending`` are, and a new one beyond that closes the oldest pending one (whose
    thread then ends): a peer of the job completes its handshake in a round trip, a
    connection held open idle by someone without the key is what gets closed. At most
    ``max_peers`` connections are served after their handshake.
    """

    def __init__(self, stats: Stats, max_pending: int = MAX_PENDING, max_peers: int = MAX_PEERS) -> None:
        self.stats, self.max_pending, self.max_peers = stats, max_pending, max_peers
        self._lock = threading.Lock()
        self._pending: collections.deque[socket.socket] = collections.deque()
        self._peers = 0

    def enter(self, conn: socket.socket) -> None:
        """A new connection, not yet authenticated; the oldest pending one is closed when there are too many."""
        with self._lock:
            self._pending.append(conn)
            oldest = self._pending.popleft() if len(self._pending) > self.max_pending else None
        if oldest is not None:
            self.stats.add("evicted")
            try:
                oldest.shutdown(socket.SHUT_RDWR)  # its thread's read fails and the thread ends
            except OSError:
                pass

    def passed(self, conn: socket.socket, ok: bool) -> bool:
        """The handshake of ``conn`` ended (``ok``: it authenticated); True if it may be served now."""
        with self._lock:
            try:
                self._pending.remove(conn)
            except ValueError:
                ok = False  # closed as the oldest while it authenticated
            if ok and self._peers >= self.max_peers:
                self.stats.add("over_limit")
                return False
            if ok:
                self._peers += 1
            return ok

    def left(self) -> None:
        """A served connection ended."""
        with self._lock:
            self._peers -= 1


def member_ips(hosts: list[str] | None) -> frozenset[str] | None:
    """The addresses ``hosts`` (names or IPs) resolve to, plus every loopback one when one of them is loopback.

    None stays None (any address). A name that does not resolve contributes nothing.
    """
    if hosts is None:
        return None
    ips: set[str] = set()
    for host in hosts:
        try:
            ips.update(str(ai[4][0]) for ai in socket.getaddrinfo(host, None, type=socket.SOCK_STREAM))
        except (OSError, UnicodeError) as exc:
            log.warning("replica service: member %s does not resolve (%s); its connections are refused", host, exc)
    if any(_is_loopback(ip) for ip in ips):
        ips.add("loopback")
    return frozenset(ips)


def _address(ip: str):
    """``ip`` as an ``ipaddress`` address, an IPv4-mapped IPv6 one as its IPv4 address (a dual-stack socket's
    peer); None when it is no address."""
    try:
        addr = ipaddress.ip_address(ip.split("%")[0])
    except ValueError:
        return None
    return getattr(addr, "ipv4_mapped", None) or addr


def _is_loopback(ip: str) -> bool:
    addr = _address(ip)
    return addr is not None and addr.is_loopback


def is_member(ip: str, members: frozenset[str] | None) -> bool:
    """Whether a connection from ``ip`` comes from a member (:func:`member_ips`; None: anyone)."""
    if members is None:
        return True
    addr = _address(ip)
    if addr is None:
        return False
    return str(addr) in members or ip in members or ("loopback" in members and addr.is_loopback)


class Server:
    """Serves peers' PUTs and GETs on the agent's listening socket, one thread per connection.

    Only to members of the current round that prove they hold :attr:`key` (see the module docstring).
    """

    def __init__(self, node_dir: str, stats: Stats) -> None:
        self.node_dir = node_dir
        self.replicas = os.path.join(node_dir, "replicas")
        self.stats = stats
        self.key: bytes | None = None  # none yet: every connection is refused
        self.members: frozenset[str] | None = frozenset()  # nobody until the agent names the round's nodes
        self.gate = Gate(stats)
        self._lock = threading.Lock()  # one rename decision at a time
        self._n = 0
        self._warn_lock = threading.Lock()
        self._warned = (float("-inf"), 0)  # (when the last warning about refused connections was, refusals since)

    def configure(self, key: bytes, members: frozenset[str] | None) -> None:
        """Take the key peers must prove they hold, and the round's members (:func:`member_ips`)."""
        self.key, self.members = key, members

    def serve(self, listener: socket.socket) -> None:
        threading.Thread(target=self._accept, args=(listener,), name="accept", daemon=True).start()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                conn, addr = listener.accept()
            except OSError as exc:  # out of descriptors, a connection reset in the backlog: try again
                log.warning("replica service: accept failed: %s", exc)
                time.sleep(BACKOFF[0])
                continue
            if not is_member(addr[0], self.members):
                conn.close()  # not a node of this round: nothing read, nothing sent
                self._refused("strangers", addr[0], "not a member of the current round")
                continue
            self.gate.enter(conn)
            threading.Thread(target=self._connection, args=(conn, addr[0]), name="peer", daemon=True).start()

    def _refused(self, counter: str, ip: str, why: str) -> None:
        """Count a refused connection; warn at most every :data:`WARN_EVERY` seconds."""
        self.stats.add(counter)
        now = time.monotonic()
        with self._warn_lock:  # the accept thread and every connection's thread refuse
            last, since = self._warned
            if now - last < WARN_EVERY:
                self._warned = (last, since + 1)
                return
            self._warned = (now, 0)
        more = f" ({since} more refused since the last warning)" if since else ""
        log.warning("replica service: refused a connection from %s: %s%s", ip, why, more)

    def _connection(self, conn: socket.socket, ip: str) -> None:
        wire.tune(conn)
        try:
            with conn, conn.makefile("rb") as rfile:
                if not self._authenticated(conn, rfile, ip):
                    return
                try:
                    self._requests(conn, rfile)
                finally:
                    self.gate.left()
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.debug("replica service: a peer's connection ended: %s", exc)

    def _authenticated(self, conn: socket.socket, rfile, ip: str) -> bool:
        """The handshake (:data:`wire.AUTH_TIMEOUT` seconds); True when ``conn`` may be served."""
        ok, why = False, "no key yet"
        try:
            if self.key is not None:
                conn.settimeout(wire.AUTH_TIMEOUT)
                wire.authenticate_client(conn, rfile, self.key)
                ok = True
        except (OSError, ValueError) as exc:  # AuthError, a timeout, a reset, a malformed line
            why = f"the handshake failed ({exc or type(exc).__name__})"
        if not self.gate.passed(conn, ok):
            if not ok:
                self._refused("unauthenticated", ip, why)
            return False
        return True

    def _requests(self, conn: socket.socket, rfile) -> None:
        """Serve one authenticated peer until it closes, breaks the protocol or idles too long."""
        while True:
            conn.settimeout(wire.IDLE_TIMEOUT)  # a sender's connection idles between saves; it pings
            req = wire.read_json(rfile)
            conn.settimeout(wire.IO_TIMEOUT)
            op = req.get("op")
            if op == "put":
                self._put(conn, rfile, req)
            elif op == "get":
                self._get(conn, int(req["rank"]), int(req["step"]))
            elif op == "ping":
                wire.send_json(conn, {"ok": True})
            else:
                raise ValueError(f"unknown request {req!r}")

    def _put(self, conn: socket.socket, rfile, req: dict) -> None:
        rank, step, seq, stamp, size = (int(req["rank"]), int(req["step"]), int(req["seq"]), float(req["time"]),
                                        int(req["size"]))
        if req.get("replicated") and self._own_has(step):
            self.stats.add("own")
            wire.send_json(conn, {"go": False})
            return
        final = os.path.join(self.replicas, f"r{rank}")
        have, room = slotfile.read_info(final), os.statvfs(self.replicas)
        if (have is not None and (have.step, have.time) >= (step, stamp)) or room.f_bavail * room.f_frsize < size:
            self.stats.add("refused")
            wire.send_json(conn, {"go": False})
            return
        wire.send_json(conn, {"go": True})
        with self._lock:
            self._n += 1
            tmp = os.path.join(self.replicas, f".r{rank}.tmp-{os.getpid()}-{self._n}")
        try:
            mark = wire.receive_file(rfile, tmp, size)
            info = slotfile.read_info(tmp)
            ok = mark == b"=" and info is not None and (info.rank, info.step, info.seq, info.size) == (
                rank, step, seq, size)
            with self._lock:
                have = slotfile.read_info(final)
                if ok and (have is None or (have.step, have.time) <= (info.step, info.time)):
                    if have is not None and have.step < info.step:
                        # the step it replaces stays, as the slots' other file does: a node killed between
                        # sending its ranks' copies of a step leaves the previous step whole here
                        os.replace(final, final + PREVIOUS)
                    os.replace(tmp, final)  # the newest step wins
                    self.stats.add("received")
                else:
                    ok = False
                    self.stats.add("discarded")
        finally:
            _unlink(tmp)  # gone already when it was renamed
        wire.send_json(conn, {"ok": ok})

    def prune(self) -> None:
        """Remove the replicas :func:`superseded` names; under the lock, so that a newer receipt renamed
        into the same name is never the file removed."""
        with self._lock:
            for path in superseded(self.node_dir):
                _unlink(path)
                self.stats.add("pruned")

    def prune_forever(self) -> None:
        """:meth:`prune` every :data:`PRUNE_EVERY` seconds, in a thread of its own."""
        def loop() -> None:
            while True:
                time.sleep(PRUNE_EVERY)
                try:
                    self.prune()
                except OSError as exc:  # the node directory went away: the agent is closing
                    log.debug("replica service: pruning failed: %s", exc)

        threading.Thread(target=loop, name="prune", daemon=True).start()

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
        mine = os.path.join(self.replicas, f"r{rank}")
        for path in [mine, mine + PREVIOUS, *(i.path for i in held if i.rank == rank)]:
            opened = wire.open_info(path)
            if opened is None:
                continue
            fd, info = opened
            try:
                if info.rank == rank and info.step == step:
                    wire.send_json(conn, {"size": info.size})
                    wire.send_file(conn, fd, info)
                    self.stats.add("served")
                    return
            finally:
                os.close(fd)
        wire.send_json(conn, {"size": 0})


def superseded(node_dir: str) -> list[str]:
    """The replicas of replicated state in ``node_dir/replicas`` older than the newest replicated snapshot
    this node holds (in ``slots/`` or ``replicas/``): paths that no restore can choose again."""
    held = slotfile.inventory(node_dir)
    steps = [info.step for info in held if info.replicated]
    if not steps:
        return []
    replicas = os.path.join(node_dir, "replicas")
    return [info.path for info in held
            if info.replicated and info.step < max(steps) and os.path.dirname(info.path) == replicas]


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

    def __init__(self, node_dir: str, peer: tuple[str, int], key: bytes, stats: Stats,
                 source: str | None = None) -> None:
        self.peer, self.node_dir, self.key, self.stats, self.source = peer, node_dir, key, stats, source
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
                with wire.connect(self.peer, self.key, wire.IO_TIMEOUT, self.source) as sock:
                    self._sock = sock
                    if self._stop.is_set():
                        return
                    with sock.makefile("rb") as rfile:
                        backoff, warned = BACKOFF[0], False
                        busy = time.monotonic()
                        while not self._stop.is_set():
                            if self._send_changed(sock, rfile):
                                busy = time.monotonic()
                            elif time.monotonic() - busy >= PING_EVERY:
                                wire.send_json(sock, {"op": "ping"})  # the server closes idle connections
                                wire.read_json(rfile)
                                busy = time.monotonic()
                            else:
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
            opened = wire.open_info(seen.path)
            if opened is None:
                continue  # a write began since the scan: look again
            fd, info = opened
            try:
                tried = True
                key = (seen.path, info.seq, info.step, info.time)
                wire.send_json(sock, {"op": "put", "rank": info.rank, "step": info.step, "seq": info.seq,
                                 "time": info.time, "size": info.size, "replicated": info.replicated})
                if not wire.read_json(rfile)["go"]:
                    self.sent[rank] = key  # it has this one or a newer one
                    self.stats.add("skipped")
                    continue
                whole = wire.send_file(sock, fd, info)
                if wire.read_json(rfile)["ok"] and whole:
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
        self.source: str | None = None  # this node's address: the source of its connections
        self.links: dict[tuple[str, int, bytes], Link] = {}

    def set(self, peers: list[tuple[str, int, bytes]]) -> None:
        for peer in [p for p in self.links if p not in peers]:
            self.links.pop(peer).stop()
        for host, port, key in peers:
            if (host, port, key) not in self.links:
                self.links[(host, port, key)] = Link(self.node_dir, (host, port), key, self.stats, self.source)


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
    server.prune_forever()
    while True:
        try:
            msg, fds, _flags, _addr = socket.recv_fds(chan, 65536, 1)
        except OSError:
            return 0
        if not msg:
            return 0  # the agent is gone
        word, _, rest = msg.decode("utf-8", "replace").partition(" ")
        if word == "conf":
            conf = json.loads(rest)
            ring.source = conf.get("source") or None
            server.configure(bytes.fromhex(conf["key"]), member_ips(conf.get("members")))
            chan.send(b"conf")  # applied: the agent waits for this before it tells peers of the round
        elif word == "listen" and fds:
            server.serve(socket.socket(fileno=fds.pop()))
        elif word == "ring":
            ring.set([(str(h), int(p), bytes.fromhex(k)) for h, p, k in json.loads(rest)])
        elif word == "stats":
            with stats.lock:
                chan.send(json.dumps(stats.counts).encode("ascii"))
        else:
            log.warning("replica service: unknown message %r", msg[:80])
        for extra in fds:
            os.close(extra)


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]), sys.argv[2]))
