"""The workers' store on the agent's side (``TORCHELASTIC_USE_AGENT_STORE=True``), without torch in the agent.

torchrun's agent hosts the workers' TCPStore itself under ``--standalone`` and
static rendezvous, so every worker is a client and no worker has to outlive its
peers to keep the store up. elaunch's agent stays free of torch: it binds and
listens on the store's socket itself (stdlib, at once, so a worker that connects
early waits in the socket's backlog instead of retrying) and hands the socket to
one small child that imports torch while the first workers do, and then hosts a
fresh ``TCPStore`` on each round's socket (``_store_host_child.py``). The child,
and the store with it, lives until the agent's run ends (``WorkerLauncher.close``,
after every worker of the last round exited or was stopped), as torchrun's store
lives in its agent: a worker's exit never takes the store from the others. Stdlib only.
"""

from __future__ import annotations

import logging
import os
import select
import socket
import subprocess
import sys

from .spawn import popen_worker

log = logging.getLogger(__name__)

_CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_store_host_child.py")
#: Seconds to wait for the child to free a port before binding it again (it may still be importing torch).
CLOSE_TIMEOUT = 60.0


class StoreHost:
    """One agent's store-host child and the socket of the current round.

    Args:
        reaper: the watchdog (``Reaper``) that kills the child if the agent dies, or None.
        env: the child's environment (default: the agent's).

    Use from the agent's main thread (``PR_SET_PDEATHSIG`` follows the starting thread).
    """

    def __init__(self, reaper=None, env: dict[str, str] | None = None) -> None:
        self._reaper = reaper
        self._env = env
        self._proc: subprocess.Popen | None = None
        self._chan: socket.socket | None = None
        self._port: int | None = None  # the port of the store being served

    def serve(self, host: str, port: int) -> int:
        """Host this round's store at ``host:port`` (port 0: any free one); return the port.

        The socket listens when this returns; the store behind it is up as soon as
        the child has imported torch. The previous round's store is closed first (on
        the same port, this waits until the child freed it).

        Raises:
            OSError: the port cannot be bound, or the child cannot be started.
        """
        if self._proc is None:
            self._start()
        elif self._port is not None and self._port == port:
            self._close_store()
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(("::" if family == socket.AF_INET6 else "", port))  # every interface, as TCPStore
            sock.listen(socket.SOMAXCONN)
            bound = sock.getsockname()[1]
            assert self._chan is not None
            socket.send_fds(self._chan, [f"serve {host} {bound}".encode("ascii")], [sock.fileno()])
        finally:
            sock.close()  # the child holds its own copy
        self._port = bound
        return bound

    def _start(self) -> None:
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            env = dict(os.environ if self._env is None else self._env)
            env.setdefault("OMP_NUM_THREADS", "1")
            self._proc = popen_worker([sys.executable, _CHILD, str(theirs.fileno())], env, None, None,
                                      pass_fds=(theirs.fileno(),))
        except OSError:
            mine.close()
            raise
        finally:
            theirs.close()
        self._chan = mine
        if self._reaper is not None:
            self._reaper.watch([self._proc.pid])

    def _close_store(self) -> None:
        """Ask the child to destroy the current store and wait until it did (its port is then free)."""
        assert self._chan is not None
        self._chan.send(b"close")
        ready, _, _ = select.select([self._chan], [], [], CLOSE_TIMEOUT)
        if not ready:
            log.warning("the store host did not close the store on port %s within %g s", self._port, CLOSE_TIMEOUT)
            return
        while True:
            reply = self._chan.recv(4096).decode("ascii", "replace")
            if not reply or reply == "closed":
                break
            if reply.startswith("error"):
                log.warning("store host: %s", reply[6:])
            # an earlier "ok PORT" answer: read on to this one's
        self._port = None

    def private_fds(self) -> tuple[int, ...]:
        """File descriptors a worker forked from the agent must close (the channel to the child)."""
        return (self._chan.fileno(),) if self._chan is not None else ()

    @property
    def pid(self) -> int | None:
        """The child's process id, once started."""
        return self._proc.pid if self._proc is not None else None

    def close(self) -> None:
        """Stop the child (the store goes with it) and reap it. Idempotent."""
        if self._chan is not None:
            self._chan.close()
            self._chan = None
        if self._proc is not None:
            self._proc.kill()  # nothing to flush: the job is over
            self._proc.wait()
            if self._reaper is not None:
                self._reaper.forget([self._proc.pid])
            self._proc = None
        self._port = None
