"""A warm template (``--warm-start``): one interpreter per node that forks the spares of every local rank.

An exec'd spare imports torch afresh for every attempt: seconds of CPU each time,
which on a busy node slowed the training steps of the group it waits beside (the
goodput run: about 4 % slower steps for 17 s after every restart). A
:class:`Template` imports the warm modules once, at the lowest CPU priority, then
forks one spare per request (``_warm_child.py --template``): the fork takes
milliseconds, and the spares share the template's pages until they write them.
A request sent while the template still imports is answered once it is done
(:meth:`Template.collect` waits for its ticket's answer; answers come in the order of
the requests); the agent asks for the first attempt's spares as it starts the template,
before its first round. One template serves every local rank (it imports with the
environment they share; each request brings the spare's own variables): the modules
are imported once per node, not once per worker.

Each spare is forked through an intermediate child that exits at once, so the spare
is re-parented to the agent (``PR_SET_CHILD_SUBREAPER``, see ``spawn.become_subreaper``):
the agent waits for it like any worker (a :class:`~elaunch.procs.forked.ForkedProcess`).
It leads its own session, takes ``PR_SET_PDEATHSIG=SIGKILL`` once it is the agent's
child, and gets its log files as descriptors with the request.

What a forked spare shares with the template, unlike an exec'd one: the hash seed of
``str`` (``PYTHONHASHSEED``) and what the imported modules computed at import
time. Python's ``random`` and numpy's global generator are seeded afresh in each
spare; torch's default generator is seeded with the same constant in every
interpreter anyway. The template's own output (import warnings) is discarded.

No torch import here: the agent imports this module.
"""

from __future__ import annotations

import fcntl
import os
import select
import socket
from collections.abc import Mapping

from .forked import ForkedProcess, _open_append
from .helper_process import end
from .spawn import popen_worker

#: Seconds to wait for a ready template's answer to a fork request (a fork takes milliseconds).
FORK_TIMEOUT = 10.0
#: Seconds a handoff waits for a template still importing to fork the spare (then the worker starts cold).
IMPORT_WAIT = 120.0
_F_SETPIPE_SZ = 1031  # Linux fcntl: grow a pipe
#: The spare's (and the template's) main program.
CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_warm_child.py")


def handoff_pipe() -> tuple[int, int]:
    """A spare's handoff pipe ``(read end, write end)``, grown to 1 MiB so the agent's write never blocks.

    Raises:
        OSError: no pipe could be made.
    """
    rfd, wfd = os.pipe()
    try:
        fcntl.fcntl(wfd, _F_SETPIPE_SZ, 1 << 20)
    except OSError:
        pass
    return rfd, wfd


def _stream(path: str | None, fd: int) -> int:
    """A descriptor for a spare's stream: ``path`` opened for appending, or a copy of the agent's ``fd``."""
    return os.dup(fd) if path is None else _open_append(path)


class Template:
    """The node's template process: it forks the spares of every local rank. Use from the agent's main thread.

    Attributes:
        proc: the template process (a direct child of the agent, its own session).
        cmd, env: the worker argv and the pre-round environment every local rank shares
            (``warm._shared_env``) it serves; it imports with that environment.
    """

    def __init__(self, proc, chan: socket.socket, cmd: list[str], env: dict[str, str]) -> None:
        self.proc, self._chan, self.cmd, self.env = proc, chan, cmd, env
        self._state: bool | None = None  # None: importing; True: forks; False: unusable
        self._next = 0  # the next request's ticket
        self._waiting: list[int] = []  # tickets of the requests not answered yet, oldest first (answers come in order)
        self._pids: dict[int, int] = {}  # answered tickets not collected yet: the spare's pid (0: not forked)
        self._dropped: set[int] = set()  # tickets given up: their spares are reaped once answered

    @classmethod
    def start(cls, argv_head: list[str], path0: str, modules: tuple[str, ...], cmd: list[str],
              env: Mapping[str, str], nice: int, extra_env: Mapping[str, str] | None = None) -> "Template":
        """Start a template: ``argv_head`` is the interpreter and its options (``python -u``).

        ``env`` is the pre-round environment every local rank shares (compared at each prepare);
        ``extra_env`` is added to its process's environment only (the spares' hook).

        Raises:
            OSError: the interpreter could not be started.
        """
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            argv = [*argv_head, CHILD, "--template", str(child.fileno()), path0, ",".join(modules), str(nice)]
            proc = popen_worker(argv, {**env, **(extra_env or {})}, os.devnull, os.devnull,
                                pass_fds=(child.fileno(),))
        except BaseException:
            parent.close()
            raise
        finally:
            child.close()
        return cls(proc, parent, list(cmd), dict(env))

    def ready(self) -> bool:
        """True once the imports are done and the template forks (never blocks)."""
        if self._state is None and self.proc.poll() is None and self._readable():
            self._act(self._read(0.0))  # the first message: R, or N (every request is answered: no spare)
        return bool(self._state) and self.proc.poll() is None

    def usable(self) -> bool:
        """False once the template refused to fork, failed, or exited."""
        return self._state is not False and self.proc.poll() is None

    def request(self, stdout_path: str | None, stderr_path: str | None, lock_fd: int | None = None,
                env: Mapping[str, str] | None = None) -> tuple[int, int] | None:
        """Ask for a spare writing to these files (None: the agent's streams); return its handoff fd and
        the request's ticket (for :meth:`collect`, :meth:`answered` and :meth:`drop`).

        ``lock_fd``: a barrier lock the spare is to hold (``return_barrier.spare_lock``),
        sent with the request; the caller still closes its own copy. ``env``: variables the
        spare sets in its own environment once forked (its local rank's ``LOCAL_RANK``...:
        what its hook reads while it waits; the handoff replaces the whole environment).

        The template forks it once its imports are done (:meth:`collect` returns it).
        The spare reads its handoff (``warm.encode_handoff``) from the returned pipe
        end; closing it unwritten dismisses the spare. None when the request could not
        be sent (the template is then unusable).
        """
        fds: list[int] = []
        wfd = None
        try:
            rfd, wfd = handoff_pipe()
            fds.append(rfd)
            fds.append(_stream(stdout_path, 1))
            fds.append(_stream(stderr_path, 2))
            if lock_fd is not None:
                fds.append(os.dup(lock_fd))
            pairs = [os.fsencode(f) for k, v in (env or {}).items() for f in (k, v)]
            socket.send_fds(self._chan, [b"\0".join([b"F", *pairs])], fds)
        except OSError:
            self._state = False
            if wfd is not None:
                os.close(wfd)
            return None
        finally:
            for fd in fds:
                os.close(fd)
        ticket, self._next = self._next, self._next + 1
        self._waiting.append(ticket)
        return wfd, ticket

    def collect(self, ticket: int, timeout: float = FORK_TIMEOUT) -> ForkedProcess | None:
        """The spare of request ``ticket``: wait up to ``timeout`` seconds for it (and the answers before it).

        None when the template refused or failed, or did not answer in time (it is then
        stopped: an answer after that would fork a spare that nothing waits for).
        """
        while ticket not in self._pids and self._waiting and self._state is not False:
            self._act(self._read(timeout))
        pid = self._pids.pop(ticket, 0)
        return ForkedProcess(pid) if pid else None

    def answered(self, ticket: int) -> bool:
        """True when the template's answer to request ``ticket`` is in (:meth:`collect` then returns at once);
        never blocks."""
        while ticket not in self._pids and self._waiting and self._readable():
            self._act(self._read(0.0))
        return ticket in self._pids

    def drop(self, ticket: int) -> None:
        """Give up request ``ticket`` (its handoff fd is closed): its spare is reaped once forked."""
        pid = self._pids.pop(ticket, 0)
        if pid:
            end(ForkedProcess(pid))
        elif ticket in self._waiting:
            self._dropped.add(ticket)

    def _take(self, pid: int) -> bool:
        """Give the oldest waiting request the answer ``pid`` (0: refused or failed: every waiting request gets
        none); False for 0. A dropped request's spare is reaped."""
        if not pid:
            for ticket in self._waiting:
                self._dropped.discard(ticket)
                self._pids[ticket] = 0
            self._waiting.clear()
            return False
        ticket = self._waiting.pop(0)
        if ticket in self._dropped:
            self._dropped.discard(ticket)
            end(ForkedProcess(pid))
        else:
            self._pids[ticket] = pid
        return True

    def _readable(self) -> bool:
        """True when a message (or the end of the channel) waits to be read; never blocks."""
        return self._chan.fileno() >= 0 and bool(select.select([self._chan], [], [], 0)[0])

    def _read(self, timeout: float) -> int | None:
        """Read the template's next message, waiting up to ``timeout`` seconds, and return what it answers:
        a fork's pid, 0 when the fork failed, the template refuses (``N``), the channel ended or nothing came
        in time, and None for the ``R`` (ready: no fork answered yet). ``R``, ``N`` and the channel's end set
        the state."""
        try:
            self._chan.settimeout(timeout)
            msg = self._chan.recv(32)
        except OSError:  # timed out, or the channel failed
            return 0
        finally:
            self._chan.settimeout(None)
        if msg in (b"R", b"N", b""):
            self._state = msg == b"R"
            return None if self._state else 0
        try:
            return int(msg)
        except ValueError:
            return 0

    def _act(self, pid: int | None) -> None:
        """Act on an answer of :meth:`_read`: a pid goes to the oldest waiting request; 0 fails every waiting
        request and stops the template."""
        if pid is not None and not self._take(pid):
            self._fail()

    def _fail(self) -> None:
        self._state = False
        end(self.proc)

    def private_fds(self) -> tuple[int, ...]:
        """The channel to the template (a worker forked from the agent closes it), while open."""
        return () if self._chan.fileno() < 0 else (self._chan.fileno(),)

    def close(self) -> None:
        """Stop the template; reap the spares it forked that nothing collected. Idempotent."""
        end(self.proc)
        while self._waiting and self._readable():  # answers already sent: this agent's children now
            pid = self._read(0.0)
            if pid == 0:
                break
            if pid:
                self._take(pid)  # a dropped request's spare is reaped here, the others below
        self._waiting.clear()
        self._dropped.clear()
        for pid in self._pids.values():
            if pid:
                end(ForkedProcess(pid))
        self._pids.clear()
        self._chan.close()
