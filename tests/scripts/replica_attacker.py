"""An attacker of a replica service: a process outside the job that knows the wire format but not the key.

``replica_attacker.py HOST PORT MODE ARGS...``, one JSON line on stdout:

* ``get RANK STEP KEY``: a ``get`` of that snapshot; KEY is ``-`` (no handshake at all: the request
  straight away) or a hex key to answer the handshake with (a wrong one). ``{"served": N, "closed": bool}``:
  N bytes arrived after the server's first line (0: nothing served).
* ``replay ANSWER RANK STEP``: answer the server's challenge with ANSWER (a line recorded from another
  connection's handshake, JSON), then the ``get``; same output.
* ``put FILE STEP KEY``: offer FILE (a slot file) as rank 0's replica of STEP, with KEY as for ``get``;
  ``{"go": ..., "ok": ..., "closed": bool}``.
* ``flood N SECONDS``: open N connections and hold them idle for SECONDS, or until the server closed
  every one; ``{"opened": N, "closed": K}``: K of them were closed by the server meanwhile.
"""
import json
import os
import socket
import sys
import time

from elaunch.checkpoint import replica_wire as wire


def first_line(sock):
    line = b""
    while not line.endswith(b"\n"):
        got = sock.recv(1)
        if not got:
            break
        line += got
    return line


def drain(sock, deadline=10.0):
    """Bytes the server sends until it closes (or ``deadline`` seconds)."""
    sock.settimeout(deadline)
    total = 0
    try:
        while True:
            got = sock.recv(65536)
            if not got:
                return total, True
            total += len(got)
    except (TimeoutError, socket.timeout):
        return total, False
    except OSError:
        return total, True


def answer_with(sock, key_hex):
    """Answer the handshake with a key (``-``: skip the handshake)."""
    if key_hex == "-":
        return
    rfile = sock.makefile("rb", buffering=0)
    try:
        wire.authenticate_server(sock, rfile, bytes.fromhex(key_hex))
    except OSError:
        pass  # refused: the server closes; what follows shows nothing is served


def get(host, port, rank, step, key_hex, answer=None):
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        if answer is not None:
            first_line(sock)  # the challenge, ignored: the recorded answer goes back
            sock.sendall(answer.encode() + b"\n")
        else:
            if key_hex == "-":
                first_line(sock)
            answer_with(sock, key_hex)
        try:
            wire.send_json(sock, {"op": "get", "rank": int(rank), "step": int(step)})
        except OSError:
            return {"served": 0, "closed": True}
        served, closed = drain(sock)
        return {"served": served, "closed": closed}


def put(host, port, path, step, key_hex):
    size = os.path.getsize(path)
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        if key_hex == "-":
            first_line(sock)
        answer_with(sock, key_hex)
        try:
            wire.send_json(sock, {"op": "put", "rank": 0, "step": int(step), "seq": 2, "time": time.time(),
                                  "size": size, "replicated": True})
            with open(path, "rb") as f:
                sock.sendall(f.read() + b"=")
        except OSError:
            return {"go": None, "ok": None, "closed": True}
        served, closed = drain(sock)
        return {"go": None, "ok": None, "answered": served, "closed": closed}


def flood(host, port, n, seconds):
    socks = []
    for _ in range(int(n)):
        try:
            socks.append(socket.create_connection((host, int(port)), timeout=10))
        except OSError:
            break
    deadline = time.monotonic() + float(seconds)
    closed = set()
    while time.monotonic() < deadline and len(closed) < len(socks):  # done once the server closed them all
        for i, s in enumerate(socks):
            if i in closed:
                continue
            s.setblocking(False)
            try:
                while True:
                    got = s.recv(4096)
                    if not got:
                        closed.add(i)
                        break
            except (BlockingIOError, InterruptedError):
                pass
            except OSError:
                closed.add(i)
        time.sleep(0.05)
    for s in socks:
        s.close()
    return {"opened": len(socks), "closed": len(closed)}


def main(argv):
    host, port, mode, *rest = argv
    if mode == "get":
        out = get(host, port, *rest)
    elif mode == "replay":
        answer, rank, step = rest
        out = get(host, port, rank, step, None, answer=answer)
    elif mode == "put":
        out = put(host, port, *rest)
    elif mode == "flood":
        out = flood(host, port, *rest)
    else:
        raise SystemExit(f"unknown mode {mode}")
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
