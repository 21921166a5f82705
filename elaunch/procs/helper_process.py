"""The agent's helper processes: one shape for every long-lived child that is not a worker.

A helper is a small child the agent keeps for the whole run beside its workers:
today the store host (``store_host.py``); next the snapshot holder, the persister
and the replica service. Every helper is a :class:`HelperProcess`, and so:

* **started** the way a worker is (``spawn.popen_worker``): ``python SCRIPT FD ARGS...``
  in its own session (process group = pid), ``PR_SET_PDEATHSIG=SIGKILL``, the
  agent's streams, ``OMP_NUM_THREADS=1`` unless set; FD is the child's end of a
  ``SOCK_SEQPACKET`` socket pair with the agent (:attr:`HelperProcess.chan`): one
  message per packet, descriptors attached with ``socket.send_fds``. End of file
  on it means the agent is gone or done: the child exits.
* **registered with the reaper** (``reaper.py``) while it runs, so a ``kill -9`` of
  the agent kills the helper's whole process group, not just the helper.
* **watched** by :meth:`HelperProcess.poll` (its exit status, or None; one
  ``waitid(WNOHANG)``, cheap enough for every pass of the agent's monitor) and
  :meth:`HelperProcess.check`, which applies the helper's policy when it died
  while still needed: **restart** it while its budget (``restarts``) lasts, with
  one warning line, or **report** it (budget 0, or spent): raise
  :class:`HelperDied`, one line naming the helper, its pid and how it ended.
  Whatever a dead helper forked (its process group) is killed as it is reaped.
* **stopped and reaped** by :meth:`HelperProcess.stop`: the channel closed, then
  :func:`end`: SIGTERM to its group, ``grace`` seconds, SIGKILL, ``waitpid``; the
  reaper forgets it.

The helpers today: the store host (``store_host.py``: report), the replica service
(``replicas.py``: restart 3 times, then off, since a dead one loses no training) and
the checkpoint persister (``persister.py``: restart 3 times, then report; the keeper
turns it off with a warning and the job goes on). The node
check's child (``agent/node_check.py``) is one too, started for each round. Adding one
is: a ``_NAME_child.py`` whose ``main(fd)`` serves its channel until end of file; a
``NAME.py`` with the logic, owning one ``HelperProcess(...)`` and offering ``name``,
``check()``, ``private_fds()`` and ``close()``; and adding it to the run's supervisor
(``elaunch/supervision.py``, ``WorkerLauncher.supervisor.add``) with its stop tier and
policy: its channels are then closed in forked workers, it is checked at each look of
the agent's monitor (unless its feature checks it where it uses it: the store host at
each round's ``serve``), and stopped at the end of the run in its tier's turn. The reaper's ``d PATH``
command removes the node directory of shared memory segments the helpers and
workers leave behind after a ``kill -9`` of the agent.

torchrun has no such processes: its agent hosts the store in-process, and torch
keeps no snapshots.

The reaper itself is not a helper: it must outlive the agent, so it has no
``PR_SET_PDEATHSIG`` and reads a pipe, not a channel; it is stopped with
:func:`end` all the same, as the warm pool's spares are. Stdlib only (no torch:
the agent imports this module).
"""

from __future__ import annotations

import logging
import os
import select
import signal
import socket
import subprocess
import sys
import time
from typing import TYPE_CHECKING

from elaunch.spec import signal_name
from elaunch.supervision import HelperDied  # noqa: F401 - raised here, defined with the supervisor

from . import _proctree
from .spawn import popen_worker

if TYPE_CHECKING:
    from .reaper import Reaper

log = logging.getLogger(__name__)

_PAUSE = 0.01  #: seconds between looks at a child given a grace period, where pidfds are unavailable


def how_it_ended(code: int) -> str:
    """``"exited with status N"`` or ``"was killed by SIGNAME"`` for a Popen returncode."""
    return f"exited with status {code}" if code >= 0 else f"was killed by {signal_name(code)}"


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    _proctree.killpg([proc.pid], sig)  # the process and whatever it forked
    try:
        os.kill(proc.pid, sig)  # also when it is not a group leader
    except OSError:
        pass


def _exited(proc: subprocess.Popen, timeout: float) -> bool:
    """Wait up to ``timeout`` seconds for ``proc`` to exit, without reaping it: True once it exited.

    Unreaped, its pid (its process group's id) cannot be reused: its group can still be signalled.
    The wait sleeps on a pidfd (Linux >= 5.3), so it ends when the child exits, not at the next
    look; elsewhere it looks every :data:`_PAUSE` seconds.
    """
    deadline = time.monotonic() + timeout
    pidfd = -1
    try:
        while True:
            try:
                if os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
                    return True
            except ChildProcessError:  # reaped already
                return True
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            if pidfd < 0:
                pidfd = _pidfd(proc.pid)
            if pidfd >= 0:
                select.select([pidfd], [], [], left)  # readable once the child exited (a signal: look again)
            else:
                time.sleep(min(_PAUSE, left))
    finally:
        if pidfd >= 0:
            os.close(pidfd)


def _pidfd(pid: int) -> int:
    """A pidfd of ``pid`` (still unreaped, so it is our child), or -1 where the kernel or Python has none."""
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return -1


def end(proc: subprocess.Popen, grace: float = 0.0, sig: int | None = signal.SIGTERM) -> int:
    """Stop ``proc`` and reap it: ``sig`` to its process group, ``grace`` seconds, then SIGKILL.

    The SIGKILL goes to the group also when ``proc`` exited by itself in the grace
    period (what it forked goes with it), and always before ``proc`` is reaped, so
    its group id is still its own.

    Args:
        proc: the child (a group leader, as ``popen_worker`` and ``start_new_session`` make it).
        grace: seconds to wait after ``sig`` before SIGKILL; 0: SIGKILL at once.
        sig: the polite signal; None when the caller already asked it to go
            another way (end of file on its pipe).

    Returns:
        Its returncode (negative: the signal that killed it).
    """
    if proc.returncode is None:
        if grace > 0 and sig is not None:
            _signal_group(proc, sig)
        _exited(proc, grace)
        _signal_group(proc, signal.SIGKILL)
    return proc.wait()


class HelperProcess:
    """One helper child of the agent (see the module docstring).

    Use from the agent's main thread (``PR_SET_PDEATHSIG`` follows the starting thread).

    Args:
        name: how log lines and errors name it (``"store host"``).
        script: the child's program, run as ``python SCRIPT FD *args``.
        args: more arguments after FD.
        env: the child's environment (default: the agent's).
        reaper: the watchdog that kills its group if the agent dies, or None.
        restarts: how many times :meth:`check` restarts it after an unexpected
            exit; 0 (default): report at once.
        grace: seconds :meth:`stop` waits after SIGTERM before SIGKILL; 0 (default):
            SIGKILL at once (nothing to flush).

    Attributes:
        chan: the agent's end of the channel while it runs, else None.
        restarted: restarts done so far.
    """

    def __init__(self, name: str, script: str, *args: str, env: dict[str, str] | None = None,
                 reaper: "Reaper | None" = None, restarts: int = 0, grace: float = 0.0) -> None:
        self.name = name
        self._argv = [sys.executable, script]
        self._args = list(args)
        self._env = env
        self._reaper = reaper
        self._budget = restarts
        self._grace = grace
        self._proc: subprocess.Popen | None = None
        self.chan: socket.socket | None = None
        self.restarted = 0

    @property
    def pid(self) -> int | None:
        """The running child's process id, or None."""
        return self._proc.pid if self._proc is not None else None

    def start(self) -> None:
        """Start the child (once stopped or never started; else nothing).

        Raises:
            OSError: the child cannot be started.
        """
        if self._proc is not None:
            return
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            env = dict(os.environ if self._env is None else self._env)
            env.setdefault("OMP_NUM_THREADS", "1")
            argv = [*self._argv, str(theirs.fileno()), *self._args]
            self._proc = popen_worker(argv, env, None, None, pass_fds=(theirs.fileno(),))
        except OSError:
            mine.close()
            raise
        finally:
            theirs.close()
        self.chan = mine
        if self._reaper is not None:
            self._reaper.watch([self._proc.pid])

    def poll(self) -> int | None:
        """Return the child's exit status once it exited, else None (also when not started).

        A child found exited is reaped, and what it forked (its process group) killed.
        """
        if self._proc is None or not _exited(self._proc, 0):
            return None
        return end(self._proc)  # what it forked goes with it

    def check(self) -> bool:
        """Apply the policy if the child exited: restart it, or raise; return True if it was restarted.

        After True, :attr:`chan` is the new child's: the owner hands it its state again.

        Raises:
            HelperDied: it exited and its restart budget is spent (or 0).
            OSError: it could not be restarted.
        """
        code = self.poll()
        if code is None:
            return False
        what = f"{self.name} (pid {self.pid}) {how_it_ended(code)}"
        self.stop()  # reaped already: closes the channel and tells the reaper
        if self.restarted >= self._budget:
            raise HelperDied(what)
        self.restarted += 1
        log.warning("%s; restarting it (%d of %d)", what, self.restarted, self._budget)
        self.start()
        return True

    def private_fds(self) -> tuple[int, ...]:
        """Descriptors a worker forked from the agent must close (the channel)."""
        return (self.chan.fileno(),) if self.chan is not None else ()

    def stop(self) -> int | None:
        """Close the channel, stop the child (SIGTERM, ``grace``, SIGKILL) and reap it. Idempotent.

        Returns:
            Its returncode, or None if it was not running.
        """
        if self.chan is not None:
            self.chan.close()
            self.chan = None
        proc, self._proc = self._proc, None
        if proc is None:
            return None
        code = end(proc, self._grace)
        if self._reaper is not None:
            self._reaper.forget([proc.pid])
        return code
