"""The replica service's wire format: what peers' agents send each other, and how a file travels.

Used by the replica child (``_replica_child.py``: its server and its senders) and by the
agent's ``replicas.fetch``.

**Every connection is authenticated before any request is served**, both ways, by a
challenge and response over the serving node's key (32 bytes; :func:`job_key` of the
user's ``ELAUNCH_JOB_SECRET``, or a random key the node published in the round's
inventory exchange). The key itself never crosses the connection:

1. the server sends ``{"auth": "hmac-sha256", "nonce": NS}`` (32 fresh random bytes, hex);
2. the client answers ``{"nonce": NC, "mac": HMAC(key, "elaunch replica client" NUL NS NC)}``;
3. the server checks it (``hmac.compare_digest``) and answers
   ``{"mac": HMAC(key, "elaunch replica server" NUL NC NS)}``, which the client checks.

A fresh server nonce per connection makes a recorded answer useless on another
connection (no replay); the two labels keep one side's answer from serving as the
other's (no reflection). The handshake has :data:`AUTH_TIMEOUT` seconds. After it the
bytes travel in clear: the handshake keeps out whoever does not hold the key, not
someone who can read or rewrite the traffic on the path (see docs/checkpointing.md,
"Security"). Then the connecting side sends requests, each a JSON line
(:func:`send_json`, :func:`read_json`; at most :data:`MAX_LINE` bytes) answered by one:

* ``{"op": "put", "rank", "step", "seq", "time", "size", "replicated"}`` -> ``{"go": bool}``
  (false: the receiver has that snapshot or a newer one of that rank, or no room, or, of
  replicated state, its own ranks saved that step or a newer one: see the child's
  ``Server._own_has``). After a go: ``size`` bytes of the slot file and one mark byte,
  ``=`` (its seq did not change during the read) or ``x`` (a write began: discard) ->
  ``{"ok": bool}``. The bytes go to ``replicas/.r<rank>.tmp-<pid>-<n>`` (0600), renamed to
  ``replicas/r<rank>`` when marked ``=``, parsed by ``slotfile.read_info`` as announced, and
  not older than the replica there (the newest step wins).
* ``{"op": "get", "rank", "step"}`` -> ``{"size": N}``, N bytes and the mark, from
  ``replicas/r<rank>`` or a local slot of that rank and step; or ``{"size": 0}``.
* ``{"op": "ping"}`` -> ``{"ok": true}``: a sender's idle connection stays open (the
  server closes one idle for :data:`IDLE_TIMEOUT` seconds).

Bytes leave a file by ``sendfile`` (:func:`send_file`: no copy in Python; a file truncated
under it ends the send short, where a mapping would fault) and land in a mapping of the new
file whose pages were reserved (:func:`receive_file`; ``posix_fallocate``: a full
``/dev/shm`` is ENOSPC, not a SIGBUS). No torchrun counterpart.

Stdlib only, and the slot-file module: loaded by path by the child run as a script, this
module loads ``elaunch/checkpoint/slotfile.py`` by path too, without elaunch's imports; the
child uses it as ``wire.slotfile``.
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import json
import mmap
import os
import secrets
import socket
import sys
import time

if __package__:
    from . import slotfile
else:  # loaded by the child run as a script: the sibling slot-file module by path
    import importlib.util
    _spec = importlib.util.spec_from_file_location("_elaunch_slotfile", os.path.join(
        os.path.dirname(os.path.abspath(__file__)), "slotfile.py"))
    slotfile = sys.modules[_spec.name] = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(slotfile)

CHUNK = 4 << 20  #: bytes received per read into the new file's mapping
IO_TIMEOUT = 30.0  #: seconds one blocking read or write on a connection may wait for its peer
MAX_LINE = 4096  #: bytes of a request or answer line, at most
AUTH_TIMEOUT = 5.0  #: seconds a connection has to complete the handshake
IDLE_TIMEOUT = 120.0  #: seconds the server keeps an authenticated connection with no request open
NONCE_BYTES = 32  #: bytes of each side's random challenge
KEY_BYTES = 32  #: bytes of a node's key
_CLIENT, _SERVER = b"elaunch replica client\0", b"elaunch replica server\0"


class AuthError(ConnectionError):
    """The other side of a connection did not prove that it holds the key (or broke the handshake)."""


def job_key(secret: bytes, run_id: str) -> bytes:
    """The replica services' key of run ``run_id`` from the user's job secret (HMAC-SHA256, 32 bytes).

    Every node of the job derives the same key, so none is published in the rendezvous.
    """
    return hmac.new(secret, b"elaunch replica key\0" + run_id.encode("utf-8"), hashlib.sha256).digest()


def new_key() -> bytes:
    """A random node key (:data:`KEY_BYTES` bytes from ``secrets``)."""
    return secrets.token_bytes(KEY_BYTES)


def _mac(key: bytes, label: bytes, first: bytes, second: bytes) -> bytes:
    return hmac.new(key, label + first + second, hashlib.sha256).digest()


def _hex_field(obj: dict, name: str, size: int) -> bytes:
    try:
        value = bytes.fromhex(obj[name])
    except (KeyError, TypeError, ValueError) as exc:
        raise AuthError(f"bad handshake field {name!r}") from exc
    if len(value) != size:
        raise AuthError(f"bad handshake field {name!r}")
    return value


def authenticate_client(sock: socket.socket, rfile, key: bytes) -> None:
    """Server side of the handshake: challenge the connecting peer, check its answer, prove ``key`` back.

    Raises:
        AuthError: the peer's answer is missing, malformed or wrong (nothing is served then).
        OSError: the connection failed or timed out (the caller sets the socket's timeout).
    """
    ns = secrets.token_bytes(NONCE_BYTES)
    send_json(sock, {"auth": "hmac-sha256", "nonce": ns.hex()})
    answer = read_json(rfile)
    nc = _hex_field(answer, "nonce", NONCE_BYTES)
    if not hmac.compare_digest(_hex_field(answer, "mac", hashlib.sha256().digest_size), _mac(key, _CLIENT, ns, nc)):
        raise AuthError("wrong key")
    send_json(sock, {"mac": _mac(key, _SERVER, nc, ns).hex()})


def authenticate_server(sock: socket.socket, rfile, key: bytes) -> None:
    """Client side of the handshake: answer the server's challenge with ``key`` and check its proof.

    Raises:
        AuthError: the server does not speak the handshake or does not hold ``key``.
        OSError: the connection failed or timed out.
    """
    hello = read_json(rfile)
    if hello.get("auth") != "hmac-sha256":
        raise AuthError("the peer did not offer the handshake")
    ns = _hex_field(hello, "nonce", NONCE_BYTES)
    nc = secrets.token_bytes(NONCE_BYTES)
    send_json(sock, {"nonce": nc.hex(), "mac": _mac(key, _CLIENT, ns, nc).hex()})
    proof = read_json(rfile)
    if not hmac.compare_digest(_hex_field(proof, "mac", hashlib.sha256().digest_size), _mac(key, _SERVER, nc, ns)):
        raise AuthError("the peer does not hold the job's key")


def connect(peer: tuple[str, int], key: bytes, timeout: float, source: str | None = None) -> socket.socket:
    """A tuned connection to ``peer``'s replica service, authenticated with ``key``.

    Args:
        peer: ``(host, port)``.
        key: the peer's key.
        timeout: seconds for the connection and for each later blocking call on it.
        source: this node's address, bound as the connection's source so that the peer's
            member check sees the address the round knows (default: the kernel's choice;
            also when that address cannot be bound here).

    Raises:
        AuthError: the handshake failed. OSError: the peer cannot be reached.
    """
    try:
        sock = socket.create_connection(peer, timeout=timeout, source_address=(source, 0) if source else None)
    except OSError as exc:
        if not source or exc.errno != errno.EADDRNOTAVAIL:
            raise
        sock = socket.create_connection(peer, timeout=timeout)  # that address is not this host's: no binding
    try:
        tune(sock)
        with sock.makefile("rb", buffering=0) as rfile:
            authenticate_server(sock, rfile, key)
    except BaseException:
        sock.close()
        raise
    return sock


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
    whole = slotfile.still_at(fd, info)  # fenced: the seq is read after the bytes it vouches for
    sock.sendall(b"=" if whole else b"x")
    return whole
