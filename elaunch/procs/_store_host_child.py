"""The store-host child: hosts the workers' TCPStore on sockets the agent listens on.

``python elaunch/procs/_store_host_child.py FD``: FD is this end of a
``SOCK_SEQPACKET`` socket pair with the agent. It imports torch at once (while
the first workers import it too), then serves the agent's messages, one per
packet:

* ``serve HOST PORT`` with one file descriptor attached: a socket the agent bound
  and listens on. The previous round's store is destroyed, and a new
  ``TCPStore(is_master=True, master_listen_fd=fd)`` serves the connections waiting
  in that socket's backlog and every later one. Answer: ``ok PORT``.
* ``close``: destroy the current store (its port is free again). Answer: ``closed``.
* end of file (the agent closed its end, or died): exit.

Errors are answered as ``error TEXT`` and the child goes on.
"""

from __future__ import annotations

import datetime
import os
import socket
import sys


def main(fd: int) -> int:
    chan = socket.socket(fileno=fd)
    from torch.distributed import TCPStore

    store = None
    while True:
        try:
            msg, fds, _flags, _addr = socket.recv_fds(chan, 4096, 1)
        except OSError:
            return 0
        if not msg:
            return 0  # the agent is gone: nothing left to serve
        words = msg.decode("ascii", "replace").split()
        try:
            if words[:1] == ["serve"] and len(words) == 3 and fds:
                store = None  # the previous round's store goes first: a fresh one per round
                store = TCPStore(words[1], int(words[2]), is_master=True, wait_for_workers=False,
                                 master_listen_fd=fds[0], timeout=datetime.timedelta(seconds=1800))
                reply = f"ok {store.port}"
            elif words[:1] == ["close"]:
                store = None
                reply = "closed"
            else:
                reply = f"error unknown message {msg[:80]!r}"
        except Exception as exc:  # noqa: BLE001 - reported to the agent, which logs it
            reply = f"error {type(exc).__name__}: {exc}".replace("\n", " ")
        finally:
            for extra in fds[1:] if words[:1] == ["serve"] else fds:
                os.close(extra)
        chan.send(reply.encode("ascii", "replace")[:4096])


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1])))
