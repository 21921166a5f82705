"""A node's presence port: a refused connection shows its agent is gone, without waiting for missed heartbeats.

When a node's agent is killed outright (``kill -9``, the OOM killer, a container that
crashed) while its host stays up, its peers' workers fail at once on the closed
sockets, but the rendezvous learns of the loss only when the node's heartbeat lags
by ``lost_after`` seconds (3 s by default), or when it does not answer a failure's
probe within ``probe_timeout`` (3 s): the whole job waits that long to re-form. So
each running member of a dynamic rendezvous (c10d, etcd) listens on a TCP port of
its address for the handler's whole life (:class:`Presence`), publishes it beside
the state (the node key ``presence``: ``{"addr": ..., "port": ...}``) and, once per
round, connects to each ring neighbour's port (``liveness.ring_neighbours``, the same
nodes whose heartbeats it judges) to see that it is reachable. When a local worker
fails, the job channel connects to those verified ports again, every 50 ms while it
waits for the other members' answers (:meth:`Presence.refused`): a neighbour whose host
answers with a refusal (no process listens on the port any more: the agent died, its
kernel closed the socket) is lost now, and the channel removes it from the state in the same breath
(``job_channel.record_failure``). A neighbour that cannot be reached at all (its
machine is gone, a link is cut) is not judged here: the heartbeat rules still
decide, as before. A port never reached when the round began (a firewall that
rejects it) is never judged either.

The listener accepts and closes connections and reads nothing: a peer proves
nothing by connecting, and nothing it sends is looked at. A process that fills the
listen queue only makes the neighbours' probes inconclusive (they fall back to the
heartbeats); one that publishes a false port for a node cannot make it look dead,
since an endpoint is judged only after it was reached. The keep-alive thread
empties the queue at each tick (:meth:`Presence.tick`). torchrun has no
counterpart: its agents learn of a lost node from missed heartbeats alone.
Stdlib only.
"""

from __future__ import annotations

import errno
import ipaddress
import json
import logging
import selectors
import socket
import threading
import time
from collections.abc import Collection, Sequence

from elaunch.rendezvous.contract import RendezvousError
from elaunch.rendezvous.dynamic.backend import RendezvousBackend

log = logging.getLogger(__name__)

#: The node key the endpoint is published under (``{prefix}/presence/{node}``).
KIND = "presence"
#: Pending connections the listener queues between two ticks of the keep-alive.
BACKLOG = 128
#: Seconds a round's first connection to a neighbour's port may take (it must succeed to be judged later).
VERIFY_TIMEOUT = 0.5
#: Ticks of a round during which a neighbour's port not yet published is looked for again.
READS_PER_ROUND = 8
#: Seconds a failure's probe of the verified ports may take in all; a port that neither accepts
#: nor refuses by then is "not known" (the heartbeat rules decide).
PROBE_TIMEOUT = 0.25


class Presence:
    """This node's presence port and its round's verified neighbours' ports (see the module docstring).

    A helper of the launch's supervisor (``elaunch.supervision``, tier ``RENDEZVOUS``): it holds
    the listening socket, which a worker forked from the agent must close (:meth:`private_fds`),
    and has no health to check. Its handler opens it before its first round and closes it when
    the node leaves the rendezvous for good.

    Args:
        node_id: this node's id in the state.
        addr: the address peers reach this node on (its ``NodeInfo.addr``, ``--local-addr``).
        backend: where the endpoint is published and the neighbours' are read (node keys).
    """

    name = "rendezvous presence port"

    def __init__(self, node_id: str, addr: str, backend: RendezvousBackend) -> None:
        self._node_id = node_id
        self._addr = addr
        self._backend = backend
        self._listener: socket.socket | None = None
        self._published = False
        self._lock = threading.Lock()  # the round's ports: learnt by the keep-alive, probed by the main thread
        self._round: tuple[str, ...] = ()  # the neighbours the ports below are for
        self._tried: set[str] = set()  # neighbours whose published port was connected to this round
        self._reads_left = READS_PER_ROUND
        self._verified: dict[str, tuple[str, int]] = {}

    @property
    def endpoint(self) -> tuple[str, int] | None:
        """``(host, port)`` of the listening socket, or None when closed or it could not be bound."""
        sock = self._listener
        return sock.getsockname()[:2] if sock is not None else None

    def open(self) -> bool:
        """Bind and listen on a free port of the node's address; False (logged at DEBUG) when that fails.

        Without a port the node is judged by its heartbeats only, as before. Idempotent.
        """
        if self._listener is not None:
            return True
        try:
            infos = socket.getaddrinfo(self._addr, 0, type=socket.SOCK_STREAM)
            family, _, _, _, sockaddr = infos[0]
            sock = socket.socket(family, socket.SOCK_STREAM)
            try:
                sock.bind(sockaddr)
                sock.listen(BACKLOG)
                sock.setblocking(False)
            except OSError:
                sock.close()
                raise
        except (OSError, IndexError) as exc:
            log.debug("node %s: no presence port on %s (%s); its loss is found by heartbeats only",
                      self._node_id, self._addr, exc)
            return False
        self._listener = sock
        return True

    def check(self) -> bool:
        """Nothing to restart: the socket cannot die while the agent lives."""
        return False

    def private_fds(self) -> tuple[int, ...]:
        """The listening socket: a forked worker must not keep it open after the agent died."""
        sock = self._listener
        return (sock.fileno(),) if sock is not None else ()

    def close(self) -> None:
        """Close the listening socket (peers then find this node's port refused). Idempotent."""
        sock, self._listener = self._listener, None
        self._published = False  # a port opened again is a new one
        if sock is not None:
            sock.close()

    def tick(self, neighbours: Sequence[str]) -> None:
        """The keep-alive's tick: publish the port if not yet done, empty the listen queue, learn the round's ports.

        ``neighbours``: the members whose heartbeats this node judges (its ring neighbours).
        Each neighbour's port is read and connected to once per round (a port not yet published
        is looked for again at the next ticks, :data:`READS_PER_ROUND` reads); only those reached
        are judged by :meth:`refused`. Never raises: a backend error leaves the ports unknown
        (heartbeats decide).
        """
        if self._listener is None:
            return
        self._drain()
        try:
            self.publish()
            self._learn(tuple(neighbours))
        except RendezvousError as exc:
            log.debug("node %s: presence ports: %s", self._node_id, exc)

    def refused(self, nodes: Collection[str], timeout: float = PROBE_TIMEOUT) -> set[str]:
        """Connect to the verified ports of ``nodes`` at once; return those whose host refused.

        A refusal (``ECONNREFUSED``: nothing listens there any more) means the node's agent is
        gone. Nodes without a verified port this round, and ports that accept, time out or fail
        otherwise within ``timeout`` seconds in all, are not returned; a port that gave no answer
        at all within ``timeout`` (its host is gone, or the link) is not tried again this round.
        """
        with self._lock:
            targets = {n: self._verified[n] for n in nodes if n in self._verified}
        outcomes = connect_all(targets, timeout)
        silent = [n for n, outcome in outcomes.items() if outcome is None]
        if silent:  # a host that does not answer at all is the heartbeats' to judge: not tried again this round
            with self._lock:
                for n in silent:
                    if self._verified.get(n) == targets[n]:
                        del self._verified[n]
        return {n for n, outcome in outcomes.items() if outcome == errno.ECONNREFUSED}

    def _drain(self) -> None:
        """Accept and close what the queue holds, at most :data:`BACKLOG` connections: a peer that connects
        faster than they are closed cannot keep the keep-alive thread from its next beat."""
        sock = self._listener
        for _ in range(BACKLOG if sock is not None else 0):
            try:
                conn, _ = sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # too many open files, a closed socket: the next tick tries again
                log.debug("node %s: presence port accept: %s", self._node_id, exc)
                return
            conn.close()

    def publish(self) -> None:
        """Publish the port (the node key ``presence``) if not yet done.

        Raises:
            RendezvousConnectionError: the backend cannot be reached (:meth:`tick` logs it and tries again).
        """
        if self._published or self.endpoint is None:
            return
        host, port = self.endpoint
        self._backend.put_node_key(KIND, self._node_id, json.dumps({"addr": host, "port": port}).encode())
        self._published = True

    def _learn(self, neighbours: tuple[str, ...]) -> None:
        with self._lock:
            if neighbours != self._round:
                self._round, self._tried, self._verified = neighbours, set(), {}
                self._reads_left = READS_PER_ROUND
            todo = [n for n in neighbours if n not in self._tried]
            if not todo or self._reads_left <= 0:
                return
            self._reads_left -= 1
        own = self.endpoint
        ports = {n: port for n, port in _decode(self._backend.get_node_keys(KIND, todo)).items()
                 if own is not None and judgeable(port[0], own[0])}
        reached = {n for n, outcome in connect_all(ports, VERIFY_TIMEOUT).items() if outcome == 0}
        with self._lock:
            if neighbours != self._round:
                return  # a new round began meanwhile
            self._tried.update(ports)
            self._verified.update({n: ports[n] for n in reached})
        unreached = sorted(set(ports) - reached)
        if unreached:
            log.debug("node %s: presence ports of %s not reached; their loss is found by heartbeats only",
                      self._node_id, ", ".join(unreached))


def _decode(docs: dict[str, bytes]) -> dict[str, tuple[str, int]]:
    """Node key documents -> ``{node: (addr, port)}``; a malformed one is left out."""
    out: dict[str, tuple[str, int]] = {}
    for node, raw in docs.items():
        try:
            doc = json.loads(raw)
            addr, port = doc["addr"], doc["port"]
        except (ValueError, TypeError, KeyError):
            continue
        if isinstance(addr, str) and type(port) is int and 0 < port < 65536:
            out[node] = (addr, port)
    return out


def judgeable(addr: str, own: str) -> bool:
    """Whether a refusal at ``addr`` can speak for the node that published it, seen from the node whose
    own presence port is bound to ``own``.

    Not a loopback address of another host's: a node whose name resolves to ``127.0.1.1`` (Debian's
    ``/etc/hosts``) publishes a port that any other host would look up on itself. A loopback address
    is judged only where this node's port is bound to the same one (nodes of one host).
    """
    try:
        loopback = ipaddress.ip_address(addr).is_loopback
    except ValueError:
        return False
    return not loopback or addr == own


def connect_all(targets: dict[str, tuple[str, int]], timeout: float) -> dict[str, int | None]:
    """Start a non-blocking connection to each ``(host, port)`` at once; return each one's outcome.

    Outcome: 0 (connected; closed at once, nothing sent), an ``errno`` (``ECONNREFUSED``,
    ``EHOSTUNREACH``, ...), or None (no answer within ``timeout`` seconds, or the address
    could not be used).
    """
    outcomes: dict[str, int | None] = {n: None for n in targets}
    sel = selectors.DefaultSelector()
    socks: list[socket.socket] = []
    try:
        for node, (host, port) in targets.items():
            try:
                family = socket.AF_INET6 if ":" in host else socket.AF_INET
                sock = socket.socket(family, socket.SOCK_STREAM)
            except OSError:
                continue
            socks.append(sock)
            sock.setblocking(False)
            code = sock.connect_ex((host, port))
            if code in (0, errno.EINPROGRESS, errno.EAGAIN):
                sel.register(sock, selectors.EVENT_WRITE, node)
            else:
                outcomes[node] = code
        deadline = time.monotonic() + timeout
        while sel.get_map():
            left = deadline - time.monotonic()
            if left <= 0:
                break
            for key, _ in sel.select(left):
                sel.unregister(key.fileobj)
                outcomes[key.data] = key.fileobj.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
    finally:
        sel.close()
        for sock in socks:
            sock.close()
    return outcomes
