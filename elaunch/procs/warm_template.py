"""A warm template (``--warm-start``): one interpreter per local rank that forks the spares.

An exec'd spare imports torch afresh for every attempt: seconds of CPU each time,
which on a busy node slowed the training steps of the group it waits beside (the
goodput run: about 4 % slower steps for 17 s after every restart). A
:class:`Template` imports the warm modules once, at the lowest CPU priority, then
forks one spare per request (``_warm_child.py --template``): the fork takes
milliseconds, and the spares share the template's pages until they write them.
A request sent while the template still imports is answered once it is done
(:meth:`Template.collect` waits); the agent asks for the second attempt's spares
as it starts the template.

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
    """One local rank's template process. Use from the agent's main thread.

    Attributes:
        proc: the template process (a direct child of the agent, its own session).
        cmd, env: the worker argv and pre-round environment (``warm.spawn_env``) it serves.
    """

    def __init__(self, proc, chan: socket.socket, cmd: list[str], env: dict[str, str]) -> None:
        self.proc, self._chan, self.cmd, self.env = proc, chan, cmd, env
        self._state: bool | None = None  # None: importing; True: forks; False: unusable
        self._asked: list[bool] = []  # requests not collected yet, oldest first (False: given up)

    @classmethod
    def start(cls, argv_head: list[str], path0: str, modules: tuple[str, ...], cmd: list[str],
              env: Mapping[str, str], nice: int, extra_env: Mapping[str, str] | None = None) -> "Template":
        """Start a template: ``argv_head`` is the interpreter and its options (``python -u``).

        ``env`` is the pre-round environment it serves (compared at each request);
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
        if self._state is None and self.proc.poll() is None:
            if select.select([self._chan], [], [], 0)[0]:
                self._state = self._chan.recv(16) == b"R"
        return bool(self._state) and self.proc.poll() is None

    def usable(self) -> bool:
        """False once the template refused to fork, failed, or exited."""
        return self._state is not False and self.proc.poll() is None

    def request(self, stdout_path: str | None, stderr_path: str | None, lock_fd: int | None = None) -> int | None:
        """Ask for a spare writing to these files (None: the agent's streams); return its handoff fd.

        ``lock_fd``: a barrier lock the spare is to hold (``return_barrier.spare_lock``),
        sent with the request; the caller still closes its own copy.

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
            socket.send_fds(self._chan, [b"F"], fds)
        except OSError:
            self._state = False
            if wfd is not None:
                os.close(wfd)
            return None
        finally:
            for fd in fds:
                os.close(fd)
        self._asked.append(True)
        return wfd

    def collect(self, timeout: float = FORK_TIMEOUT) -> ForkedProcess | None:
        """The spare of the oldest request not collected: wait up to ``timeout`` seconds for it.

        None when the template refused or failed, or did not answer in time (it is then
        stopped: an answer after that would fork a spare that nothing waits for).
        """
        while self._asked:
            pid = self._answer(timeout)
            wanted = self._asked.pop(0)
            if not pid:
                self._fail()
                return None
            if wanted:
                return ForkedProcess(pid)
            end(ForkedProcess(pid))  # a request given up (:meth:`drop`): its spare goes
        return None

    def answered(self) -> bool:
        """True when the template's answer to the oldest request is waiting to be read (:meth:`collect`
        then returns at once); never blocks."""
        if not self._asked or self._chan.fileno() < 0:
            return False
        return bool(select.select([self._chan], [], [], 0)[0])

    def drop(self) -> None:
        """Give up the oldest request not collected (its handoff fd is closed): its spare is reaped once forked."""
        if self._asked:
            self._asked[self._asked.index(True)] = False

    def _answer(self, timeout: float) -> int:
        """The next fork's pid (0: refused, failed or timed out); reads the ``R``/``N`` first if not read yet."""
        try:
            self._chan.settimeout(timeout)
            while True:
                msg = self._chan.recv(32)
                if msg in (b"R", b"N"):
                    self._state = msg == b"R"
                    if msg == b"N":
                        return 0
                    continue
                return int(msg or b"0")
        except (OSError, ValueError):
            return 0
        finally:
            self._chan.settimeout(None)

    def _fail(self) -> None:
        self._state = False
        end(self.proc)

    def private_fds(self) -> tuple[int, ...]:
        """The channel to the template (a worker forked from the agent closes it), while open."""
        return () if self._chan.fileno() < 0 else (self._chan.fileno(),)

    def close(self) -> None:
        """Stop the template; reap the spares it forked that nothing collected. Idempotent."""
        end(self.proc)
        while self._asked:  # answers already sent: those spares are this agent's children now
            pid = self._answer(0.0)
            self._asked.pop(0)
            if pid:
                end(ForkedProcess(pid))
        self._chan.close()
