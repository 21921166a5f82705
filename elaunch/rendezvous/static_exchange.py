"""How the agents of a static job learn each other's role and ``--nproc-per-node``. Stdlib only.

torch's static rendezvous has the agent of node rank 0 host a TCPStore at the
endpoint; every agent writes its role and local world size there and rank 0
hands out the ranks (``SimpleElasticAgent._assign_worker_ranks``). elaunch's
static agents import no torch, so they meet once, before round 0, over a plain
TCP connection to the same endpoint:

* node rank 0 listens on ``MASTER_PORT`` (every interface, as TCPStore does) and
  waits until every other node rank said hello;
* every other node connects (retrying until node rank 0 listens) and sends one
  JSON line ``{"elaunch": 1, "rank", "nnodes", "role", "local_world_size", "addr"}``;
* node rank 0 closes its listener, then answers each with one JSON line
  ``{"nodes": [[addr, role, local_world_size], ...]}`` (group-rank order) or
  ``{"error": message}``; each node reads it and closes first.

The listener is closed before any node learns the table, so no worker can reach
it: the port is free for worker rank 0's store of round 0. The table never
changes (a static job's nodes and ``--nproc-per-node`` are fixed), so restarts do
not meet again.
"""

from __future__ import annotations

import json
import logging
import selectors
import socket
import time

from elaunch.rendezvous.contract import (
    NodeInfo,
    RendezvousConfigError,
    RendezvousConnectionError,
    RendezvousTimeoutError,
)

log = logging.getLogger("elaunch")

PROTOCOL = 1
#: Longest hello or answer accepted, in bytes (a table of thousands of nodes fits).
MAX_LINE = 1 << 22
#: How long node rank 0 waits for the others to close after reading the table, in seconds.
CLOSE_WAIT = 2.0
#: Longest pause between two connection attempts of a joining node, in seconds (short: a
#: refused attempt costs microseconds, and a late retry delays the whole job's start).
MAX_RETRY_DELAY = 0.02


def listen(port: int) -> socket.socket:
    """Return a listening socket on ``port`` of every interface (IPv4 and, where possible, IPv6).

    Raises:
        RendezvousConnectionError: the port cannot be bound (e.g. already in use).
    """
    try:
        if socket.has_dualstack_ipv6():
            return socket.create_server(("", port), family=socket.AF_INET6, dualstack_ipv6=True, backlog=128)
        return socket.create_server(("", port), backlog=128)
    except OSError as exc:
        raise RendezvousConnectionError(f"static rendezvous: node rank 0 cannot listen on port {port}: {exc}") from exc


def gather(listener: socket.socket, me: NodeInfo, nnodes: int, timeout: float) -> tuple[NodeInfo, ...]:
    """On node rank 0: wait for every other node's hello, answer each with the table, return it.

    Closes ``listener`` (before answering) and every accepted connection. A
    connection that is not an elaunch agent is dropped with a warning; a node that
    goes away before the table is complete frees its rank for another attempt.

    Args:
        listener: from :func:`listen`.
        me: this node (group rank 0).
        nnodes: the job's number of nodes (``--nnodes``), >= 2.
        timeout: how long to wait for the others, in seconds (``--rdzv-conf timeout``).

    Returns:
        Every node's NodeInfo, in group-rank order.

    Raises:
        RendezvousTimeoutError: some node rank did not join within ``timeout``.
        RendezvousConfigError: a node was started with another ``--nnodes``
            (every node that joined is told the same message).
    """
    deadline = time.monotonic() + timeout
    joined: dict[int, tuple[socket.socket, NodeInfo]] = {}
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ)
    conns: dict[socket.socket, bytearray] = {}
    try:
        while len(joined) < nnodes - 1 or _prune(joined, sel, conns):
            left = deadline - time.monotonic()
            if left <= 0:
                missing = ", ".join(str(r) for r in range(1, nnodes) if r not in joined)
                raise RendezvousTimeoutError(
                    f"static rendezvous: node rank(s) {missing} of {nnodes} did not join within {timeout:g} s "
                    f"(--rdzv-conf timeout)")
            for key, _ in sel.select(left):
                if key.fileobj is listener:
                    _accept(listener, sel, conns)
                else:
                    _read(key.fileobj, sel, conns, joined, nnodes)  # type: ignore[arg-type]
        listener.close()  # before anyone learns the table: no worker ever reaches this listener
        table = (me, *(joined[r][1] for r in range(1, nnodes)))
        _answer([s for s, _ in joined.values()], {"nodes": [[n.addr, n.role, n.local_world_size] for n in table]})
        return table
    except _NodesDisagree as exc:
        _answer([*(s for s, _ in joined.values()), exc.sock], {"error": str(exc)})
        raise
    finally:
        listener.close()
        sel.close()
        for sock in conns:
            sock.close()


class _NodesDisagree(RendezvousConfigError):
    """Node rank 0 and the node on ``sock`` were started with different ``--nnodes``."""

    def __init__(self, message: str, sock: socket.socket) -> None:
        super().__init__(message)
        self.sock = sock


def _accept(listener: socket.socket, sel: selectors.BaseSelector, conns: dict[socket.socket, bytearray]) -> None:
    try:
        sock, _ = listener.accept()
    except OSError:
        return  # the peer gave up between select and accept
    sock.setblocking(False)
    conns[sock] = bytearray()
    sel.register(sock, selectors.EVENT_READ)


def _read(sock: socket.socket, sel: selectors.BaseSelector, conns: dict[socket.socket, bytearray],
          joined: dict[int, tuple[socket.socket, NodeInfo]], nnodes: int) -> None:
    """Read what ``sock`` sent; register its node once its hello line is complete."""
    buf = conns[sock]
    try:
        data = sock.recv(65536)
    except OSError:
        data = b""
    member = next((r for r, (s, _) in joined.items() if s is sock), None)
    if not data or member is None and len(buf) + len(data) > MAX_LINE:
        if member is not None:
            _leave(member, joined, sel, conns)
        else:
            _drop(sock, sel, conns)
        return
    if member is not None:
        return  # nothing more is expected before the answer
    buf += data
    if b"\n" not in buf:
        return
    peer = _peer(sock)
    try:
        hello = json.loads(bytes(buf).split(b"\n", 1)[0])
        ok = isinstance(hello, dict) and hello.get("elaunch") == PROTOCOL
        rank, other_nnodes = int(hello["rank"]), int(hello["nnodes"])
        node = NodeInfo(str(hello.get("addr") or peer), str(hello["role"]), int(hello["local_world_size"]))
    except (ValueError, KeyError, TypeError, AttributeError):
        ok = False
    if not ok:
        log.warning("static rendezvous: ignored a connection from %s: not an elaunch agent of this version", peer)
        _drop(sock, sel, conns)
        return
    if other_nnodes != nnodes:
        raise _NodesDisagree(
            f"--nnodes={other_nnodes} on node rank {rank} ({node.addr}) but --nnodes={nnodes} on node rank 0: "
            f"every node of a static job needs the same --nnodes", sock)
    if rank in joined and not _alive(joined[rank][0]):
        _leave(rank, joined, sel, conns)  # a node restarted before the others came: the new one takes its rank
    if rank in joined or not 0 < rank < nnodes:
        taken = "node rank 0" if rank == 0 else (joined[rank][1].addr if rank in joined else "")
        _answer([sock], {"error": f"--node-rank={rank} of {node.addr} is already taken by {taken}: every node "
                                  f"of a static job needs its own --node-rank"})
        _drop(sock, sel, conns)
        return
    joined[rank] = (sock, node)


def _alive(sock: socket.socket) -> bool:
    """False when the peer of ``sock`` (non-blocking) closed its side or the connection broke."""
    try:
        return sock.recv(1, socket.MSG_PEEK) != b""
    except BlockingIOError:
        return True
    except OSError:
        return False


def _leave(rank: int, joined: dict[int, tuple[socket.socket, NodeInfo]], sel: selectors.BaseSelector,
           conns: dict[socket.socket, bytearray]) -> None:
    """JOINED -> gone: node ``rank``'s agent died or gave up; its rank is free for another attempt."""
    sock, node = joined.pop(rank)
    log.warning("static rendezvous: node rank %d (%s) left before every node joined", rank, node.addr)
    _drop(sock, sel, conns)


def _prune(joined: dict[int, tuple[socket.socket, NodeInfo]], sel: selectors.BaseSelector,
           conns: dict[socket.socket, bytearray]) -> bool:
    """Let the joined nodes that are gone leave; return True when one did."""
    gone = [rank for rank, (sock, _) in joined.items() if not _alive(sock)]
    for rank in gone:
        _leave(rank, joined, sel, conns)
    return bool(gone)


def _drop(sock: socket.socket, sel: selectors.BaseSelector, conns: dict[socket.socket, bytearray]) -> None:
    sel.unregister(sock)
    del conns[sock]
    sock.close()


def _peer(sock: socket.socket) -> str:
    try:
        host = sock.getpeername()[0]
    except OSError:
        return "?"
    return host.removeprefix("::ffff:")  # an IPv4 peer of a dual-stack listener


def _answer(socks: list[socket.socket], message: dict) -> None:
    """Send ``message`` to each of ``socks``, then wait (up to CLOSE_WAIT s) for each to close first.

    The peers close first so that no connection of this port waits in TIME_WAIT
    on this side when worker rank 0 binds it. A peer that cannot be reached is
    logged: its agent is gone, and the job fails when its workers do not come.
    """
    line = json.dumps(message).encode() + b"\n"
    for sock in socks:
        try:
            sock.setblocking(True)
            sock.settimeout(CLOSE_WAIT)
            sock.sendall(line)
        except OSError as exc:
            log.warning("static rendezvous: could not answer %s: %s", _peer(sock), exc)
    deadline = time.monotonic() + CLOSE_WAIT
    for sock in socks:
        try:
            sock.settimeout(max(deadline - time.monotonic(), 0.001))
            while sock.recv(4096):
                pass
        except OSError:
            pass


def join(host: str, port: int, me: NodeInfo, rank: int, nnodes: int, timeout: float) -> tuple[NodeInfo, ...]:
    """On node rank > 0: say hello to node rank 0 at ``host:port`` and return the table it answers.

    Connection attempts are retried (after 1 ms at first, then up to every
    ``MAX_RETRY_DELAY`` s) until node rank 0 listens.

    Args:
        host, port: the static endpoint (``--master-addr``/``--master-port``).
        me: this node; ``me.addr`` "" lets node rank 0 record the address it sees.
        rank: this node's group rank (``--node-rank``), 1 <= rank < nnodes.
        nnodes: the job's number of nodes (``--nnodes``).
        timeout: how long to wait for the answer, in seconds (``--rdzv-conf timeout``).

    Returns:
        Every node's NodeInfo, in group-rank order.

    Raises:
        RendezvousTimeoutError: no answer within ``timeout``.
        RendezvousConfigError: node rank 0 refused this node (another ``--nnodes``,
            a ``--node-rank`` taken twice); the message says which.
        RendezvousConnectionError: the endpoint answered something that is not
            an elaunch static rendezvous.
    """
    deadline = time.monotonic() + timeout
    hello = {"elaunch": PROTOCOL, "rank": rank, "nnodes": nnodes, "role": me.role,
             "local_world_size": me.local_world_size, "addr": me.addr}
    delay = 0.001
    # an ASCII name as bytes: getaddrinfo then needs no idna codec (a millisecond of imports)
    address = (host.encode() if host.isascii() else host, port)
    while True:
        try:
            sock = socket.create_connection(address, timeout=max(deadline - time.monotonic(), 0.001))
            break
        except OSError as exc:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RendezvousTimeoutError(
                    f"static rendezvous: node rank 0 at {host}:{port} did not answer within {timeout:g} s "
                    f"(--rdzv-conf timeout): {exc}") from exc
            time.sleep(min(delay, left))
            delay = min(delay * 2, MAX_RETRY_DELAY)
    with sock:
        try:
            sock.sendall(json.dumps(hello).encode() + b"\n")
            sock.settimeout(max(deadline - time.monotonic(), 0.001))
            line = sock.makefile("rb").readline(MAX_LINE)
        except socket.timeout as exc:
            raise RendezvousTimeoutError(
                f"static rendezvous: the other nodes did not all join within {timeout:g} s "
                f"(--rdzv-conf timeout)") from exc
        except OSError as exc:
            raise RendezvousConnectionError(
                f"static rendezvous: {host}:{port} broke the connection without sending the node table ({exc}): "
                f"is node rank 0 an elaunch agent of this job?") from exc
    return _parse_answer(line, f"{host}:{port}", nnodes)


def _parse_answer(line: bytes, endpoint: str, nnodes: int) -> tuple[NodeInfo, ...]:
    try:
        answer = json.loads(line)
        if "error" in answer:
            raise RendezvousConfigError(str(answer["error"]))
        table = tuple(NodeInfo(str(a), str(r), int(n)) for a, r, n in answer["nodes"])
    except (ValueError, KeyError, TypeError) as exc:
        if isinstance(exc, RendezvousConfigError):
            raise
        raise RendezvousConnectionError(
            f"static rendezvous: {endpoint} closed or answered without the node table: is node rank 0 "
            f"an elaunch agent of this job?") from exc
    if len(table) != nnodes:
        raise RendezvousConnectionError(f"static rendezvous: {endpoint} answered {len(table)} nodes for --nnodes={nnodes}")
    return table
