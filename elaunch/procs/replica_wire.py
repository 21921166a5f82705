"""The replica service's wire format: what peers' agents send each other, and how a file travels.

Used by the replica child (``_replica_child.py``: its server and its senders) and by the
agent's ``replicas.fetch``. The connecting side sends requests, each a JSON line
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

Bytes leave a file by ``sendfile`` (:func:`send_file`: no copy in Python; a file truncated
under it ends the send short, where a mapping would fault) and land in a mapping of the new
file whose pages were reserved (:func:`receive_file`; ``posix_fallocate``: a full
``/dev/shm`` is ENOSPC, not a SIGBUS). No torchrun counterpart.

Stdlib only, and the slot-file module: loaded by path by the child run as a script, this
module loads ``elaunch/checkpoint/slotfile.py`` by path too, without elaunch's imports; the
child uses it as ``wire.slotfile``.
"""

from __future__ import annotations

import json
import mmap
import os
import socket
import sys
import time

if __package__:
    from ..checkpoint import slotfile
else:  # loaded by the child run as a script: the sibling package's slot-file module by path
    import importlib.util
    _spec = importlib.util.spec_from_file_location("_elaunch_slotfile", os.path.join(
        os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "checkpoint", "slotfile.py"))
    slotfile = sys.modules[_spec.name] = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(slotfile)

CHUNK = 4 << 20  #: bytes received per read into the new file's mapping
IO_TIMEOUT = 30.0  #: seconds one blocking read or write on a connection may wait for its peer
MAX_LINE = 4096  #: bytes of a request or answer line, at most


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
