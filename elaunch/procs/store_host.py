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
lives in its agent: a worker's exit never takes the store from the others. The
child is one of the agent's helpers (``helper_process``), started, watched and
stopped as each is; its policy is to report: a store host that died took the
round's keys with it, so a new one would not help (the next round's ``serve``
raises ``HelperDied``). Stdlib only.
"""

from __future__ import annotations

import logging
import os
import select
import socket

from .helper_process import HelperProcess

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
        self._helper = HelperProcess("store host", _CHILD, env=env, reaper=reaper)  # report; SIGKILL at close
        self._port: int | None = None  # the port of the store being served

    def serve(self, host: str, port: int) -> int:
        """Host this round's store at ``host:port`` (port 0: any free one); return the port.

        The socket listens when this returns; the store behind it is up as soon as
        the child has imported torch. The previous round's store is closed first (on
        the same port, this waits until the child freed it).

        Raises:
            HelperDied: the child exited since the previous round (an OSError).
            OSError: the port cannot be bound, or the child cannot be started.
        """
        if not self._helper.check() and self._port is not None and self._port == port:  # check: died -> raise
            self._close_store()
        self._helper.start()  # the first round's; it lives until close()
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(("::" if family == socket.AF_INET6 else "", port))  # every interface, as TCPStore
            sock.listen(socket.SOMAXCONN)
            bound = sock.getsockname()[1]
            assert self._helper.chan is not None
            socket.send_fds(self._helper.chan, [f"serve {host} {bound}".encode("ascii")], [sock.fileno()])
        finally:
            sock.close()  # the child holds its own copy
        self._port = bound
        return bound

    def _close_store(self) -> None:
        """Ask the child to destroy the current store and wait until it did (its port is then free)."""
        chan = self._helper.chan
        assert chan is not None
        chan.send(b"close")
        ready, _, _ = select.select([chan], [], [], CLOSE_TIMEOUT)
        if not ready:
            log.warning("the store host did not close the store on port %s within %g s", self._port, CLOSE_TIMEOUT)
            return
        while True:
            reply = chan.recv(4096).decode("ascii", "replace")
            if not reply or reply == "closed":
                break
            if reply.startswith("error"):
                log.warning("store host: %s", reply[6:])
            # an earlier "ok PORT" answer: read on to this one's
        self._port = None

    @property
    def name(self) -> str:
        """``"store host"``: how the supervisor names it."""
        return self._helper.name

    def check(self) -> bool:
        """Its policy is report (see :meth:`serve`, which checks it at each round).

        Raises:
            HelperDied: the child exited (an OSError).
        """
        return self._helper.check()

    def private_fds(self) -> tuple[int, ...]:
        """File descriptors a worker forked from the agent must close (the channel to the child)."""
        return self._helper.private_fds()

    @property
    def pid(self) -> int | None:
        """The child's process id, once started."""
        return self._helper.pid

    def close(self) -> None:
        """Stop the child (the store goes with it) and reap it. Idempotent."""
        self._helper.stop()
        self._port = None
