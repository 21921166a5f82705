"""The replica service: copies of this node's snapshots on the next nodes of the round, and theirs here.

With ``--checkpoint-replicas N`` each agent sends its workers' newest committed
snapshots (``slots/`` of its node directory) to the next N nodes of the round (a
ring), in the background (of replicated state, which any rank's snapshot serves,
only the node's lowest rank's), and keeps the copies its predecessors send it in
``replicas/r<rank>`` (one per saved global rank, the newest step wins). A node that
replaces a lost one fetches its ranks' snapshots from a peer at the round's start
(:func:`fetch`), without touching disk. No torchrun counterpart: torch keeps no
snapshots.

The work is done by one helper child (``_replica_child.py``; the wire format is
``replica_wire.py``'s), a :class:`~elaunch.procs.helper_process.HelperProcess`: the agent
binds the TCP socket on its address and hands it to the child, which serves peers'
copies and fetches on it, and sends this node's snapshots to the successors the
agent names with :meth:`ReplicaService.set_ring`. Because the agent keeps the
listening socket, a restarted child serves the same port: peers need not be told.

**Only the job's own agents are served.** Every connection is authenticated before
any request (``replica_wire``'s handshake over the serving node's key: the service's
:attr:`ReplicaService.key`); connections from addresses that are not members of the
current round (:meth:`ReplicaService.set_members`) are closed unread; a handshake has
``replica_wire.AUTH_TIMEOUT`` seconds, an authenticated connection idle for
``replica_wire.IDLE_TIMEOUT`` seconds is closed, and the connections (so the child's
threads) are bounded (``_replica_child.MAX_PENDING``, ``MAX_PEERS``).

Policy: **restart** (:data:`RESTARTS` times), then off. A dead replica service
loses no training and no snapshot of this node (those are in ``slots/``); while it
is down the node's newest snapshots are not copied out and its replicas are not
served. :meth:`ReplicaService.check` restarts it and hands the new child the socket
and the ring again; once the budget is spent it logs one warning and the service
stays off for the rest of the run (peers' connections are then refused).

Stdlib only: the agent imports this module.
"""

from __future__ import annotations

import json
import logging
import os
import select
import socket
import time

from elaunch.procs.helper_process import HelperProcess

from . import replica_wire as wire
from . import slotfile

log = logging.getLogger(__name__)

_CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_replica_child.py")
RESTARTS = 3  #: restarts of a dead replica child before the service stays off
STATS_TIMEOUT = 5.0  #: seconds :meth:`ReplicaService.stats` waits for the child's answer


class ReplicaService:
    """One agent's replica service (see the module docstring).

    Args:
        node_dir: the agent's node directory in ``/dev/shm`` (``slots/`` is read,
            ``replicas/`` is written; made if missing, mode 0700).
        host: the address to listen on (the agent's address, as peers reach it).
        reaper: the watchdog (``Reaper``) that kills the child if the agent dies, or None.
        env: the child's environment (default: the agent's).
        restarts: restarts of the child before the service stays off.
        key: the key peers must prove they hold (``replica_wire.KEY_BYTES`` bytes; default: a new
            random one, :attr:`key`); it goes to the child over the private channel only.

    Use from the agent's main thread (``PR_SET_PDEATHSIG`` follows the starting thread).
    """

    def __init__(self, node_dir: str, host: str, reaper=None, env: dict[str, str] | None = None,
                 restarts: int = RESTARTS, key: bytes | None = None) -> None:
        self.node_dir = node_dir
        self.host = host
        self.key = key if key is not None else wire.new_key()  #: the key this service's peers prove they hold
        self._helper = HelperProcess("replica service", _CHILD, node_dir, env=env, reaper=reaper, restarts=restarts)
        self._listener: socket.socket | None = None
        self._ring: list[tuple[str, int, bytes]] = []
        self._members: list[str] | None = None
        self.port: int | None = None  #: the port peers reach this node's service on, once started

    @property
    def name(self) -> str:
        """How the supervisor (``elaunch.supervision``) and its warnings name it."""
        return self._helper.name

    @property
    def pid(self) -> int | None:
        """The child's process id while it runs."""
        return self._helper.pid

    def start(self) -> int:
        """Listen on ``host`` (any free port) and start the child; return the port. Once (else the port).

        Raises:
            OSError: ``replicas/`` cannot be made, the socket cannot be bound, or the child cannot be started.
        """
        if self._listener is not None:
            return self.port
        os.makedirs(os.path.join(self.node_dir, "replicas"), mode=0o700, exist_ok=True)
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.bind((self.host, 0))
            sock.listen(socket.SOMAXCONN)
            self._helper.start()
        except OSError:
            sock.close()
            raise
        self._listener, self.port = sock, sock.getsockname()[1]
        self._hand_over()
        return self.port

    def _hand_over(self) -> None:
        """Give the (new) child its settings (key, members), then the listening socket, then the ring."""
        chan = self._helper.chan
        assert chan is not None and self._listener is not None
        self._send_conf()
        try:
            socket.send_fds(chan, [b"listen"], [self._listener.fileno()])
        except OSError as exc:  # it died at once: the next check() restarts it
            log.debug("replica service: the socket was not handed over (%s)", exc)
            return
        self._send_ring()

    def _send(self, word: str, obj) -> None:
        if self._helper.chan is None:
            return
        try:
            self._helper.chan.send(word.encode("ascii") + b" " + json.dumps(obj).encode("utf-8"))
        except OSError as exc:  # the child died: check() restarts it and hands it everything again
            log.debug("replica service: %s was not handed over (%s)", word, exc)

    def _send_conf(self) -> None:
        """Send the key, the source and the members, and wait (up to :data:`STATS_TIMEOUT` s) until the child
        applied them: a peer told of this round only after :meth:`set_members` returned is never refused."""
        chan = self._helper.chan
        self._send("conf", {"key": self.key.hex(), "source": self.host, "members": self._members})
        try:
            if chan is not None and select.select([chan], [], [], STATS_TIMEOUT)[0]:
                chan.recv(64)  # b"conf": applied (b"": the child died; check() restarts it)
        except OSError as exc:
            log.debug("replica service: no answer to the settings (%s)", exc)

    def _send_ring(self) -> None:
        self._send("ring", [[h, p, k.hex()] for h, p, k in self._ring])

    def set_members(self, hosts: list[str] | None) -> None:
        """Serve connections only from ``hosts`` (the current round's nodes' addresses, names or IPs).

        The child resolves each name; a connection from any other address is closed before a
        byte is read. Returns once the child applied the list (or did not answer within
        :data:`STATS_TIMEOUT` seconds). When one of them is a loopback address, every loopback address is a
        member (agents on one machine). None (the default until called): any address, still
        authenticated.
        """
        members = None if hosts is None else sorted({str(h) for h in hosts})
        if members == self._members and self._listener is not None:
            return  # the child has this list (a restarted child is handed it again by check())
        self._members = members
        self._send_conf()

    def set_ring(self, peers: list[tuple[str, int, bytes]]) -> None:
        """Send this node's snapshots to ``peers`` (``(host, port, key)`` of each successor's service) from now on.

        An empty list stops sending. A successor already in the previous ring keeps its
        connection and is not sent again what it has.
        """
        self._ring = [(str(h), int(p), bytes(k)) for h, p, k in peers]
        self._send_ring()

    def check(self) -> bool:
        """Restart the child if it died (and hand it the socket and the ring); True if it was restarted.

        Cheap (one ``waitid``): for every pass of the agent's monitor. Never raises: once
        the restart budget is spent, or a restart fails, one warning, and the service
        stays off (False from then on; peers' connections are refused).
        """
        if self._listener is None:
            return False
        try:
            restarted = self._helper.check()
        except OSError as exc:  # HelperDied (budget spent), or it could not be started again
            log.warning("%s; peers' copies of this node's snapshots are not updated any more", exc)
            self._helper.stop()
            self._close_listener()
            return False
        if restarted:
            self._hand_over()
        return restarted

    def held(self) -> int:
        """Bytes of replicas this node holds (every file in ``replicas/``, receipts under way included)."""
        total = 0
        try:
            with os.scandir(os.path.join(self.node_dir, "replicas")) as entries:
                for entry in entries:
                    try:
                        total += entry.stat().st_size
                    except OSError:
                        pass  # renamed or removed meanwhile
        except OSError:
            pass
        return total

    def stats(self) -> dict[str, int]:
        """The child's counters (``_replica_child.COUNTERS``: sent, skipped, torn, received, ...).

        Raises:
            OSError: the child is not running or does not answer within :data:`STATS_TIMEOUT` seconds.
        """
        chan = self._helper.chan
        if chan is None:
            raise OSError("the replica service is not running")
        chan.send(b"stats")
        if not select.select([chan], [], [], STATS_TIMEOUT)[0]:
            raise TimeoutError("the replica service did not answer")
        reply = chan.recv(65536)
        if not reply:
            raise ConnectionError("the replica service exited")
        return json.loads(reply)

    def private_fds(self) -> tuple[int, ...]:
        """Descriptors a worker forked from the agent must close (the channel, the listening socket)."""
        own = (self._listener.fileno(),) if self._listener is not None else ()
        return (*self._helper.private_fds(), *own)

    def _close_listener(self) -> None:
        if self._listener is not None:
            self._listener.close()
            self._listener = None

    def close(self) -> None:
        """Stop the child and reap it; close the listening socket. Idempotent. ``replicas/`` stays."""
        self._helper.stop()
        self._close_listener()


def fetch(host: str, port: int, rank: int, step: int, dest_path: str, timeout: float = 60.0, *,
          key: bytes, source: str | None = None) -> bool:
    """Fetch global rank ``rank``'s snapshot of step ``step`` from a peer's replica service into ``dest_path``.

    The peer answers from its ``replicas/r<rank>`` or from its own slots. The file is
    received as ``.<name>.tmp-<pid>`` beside ``dest_path`` (0600) and renamed over it
    once whole and parsed by ``slotfile.read_info`` with that rank and step.

    Args:
        host, port: the peer's replica service.
        rank: the global rank that saved the snapshot; step: the step it must hold.
        dest_path: where the snapshot goes (its directory must exist).
        timeout: seconds the whole fetch may take.
        key: the peer's key (its service's :attr:`ReplicaService.key`).
        source: this node's address, the connection's source (``replica_wire.connect``).

    Returns:
        True when ``dest_path`` holds it; False (one log line) when the peer has no such
        snapshot, cannot be reached, fails the handshake, sends a torn or wrong one, or
        ``timeout`` passes.
        Nothing is left at ``dest_path``'s temporary name.
    """
    deadline = time.monotonic() + timeout
    where = f"rank {rank} step {step} from {host}:{port}"
    tmp = os.path.join(os.path.dirname(dest_path) or ".", f".{os.path.basename(dest_path)}.tmp-{os.getpid()}")
    try:
        with wire.connect((host, port), key, timeout, source) as sock, sock.makefile("rb") as rfile:
            wire.send_json(sock, {"op": "get", "rank": rank, "step": step})
            size = int(wire.read_json(rfile)["size"])
            if size <= 0:
                log.info("replica fetch: %s: the peer has none", where)
                return False
            mark = wire.receive_file(rfile, tmp, size, deadline, sock)
        info = slotfile.read_info(tmp)
        if mark != b"=" or info is None or (info.rank, info.step, info.size) != (rank, step, size):
            log.warning("replica fetch: %s: the copy received is not whole (a write began under it)", where)
            return False
        os.replace(tmp, dest_path)
        return True
    except (OSError, ValueError, KeyError) as exc:
        log.warning("replica fetch: %s failed: %s", where, exc)
        return False
    finally:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
