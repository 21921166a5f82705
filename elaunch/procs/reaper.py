"""A watchdog process that kills the agent's worker trees if the agent dies.

``PR_SET_PDEATHSIG`` kills each worker when the agent dies, even by ``kill -9``,
but not the worker's own children (DataLoader workers, a ``bash -c`` grandchild,
a daemon that called ``setsid``). torchrun leaves those behind; elaunch starts one
small watchdog per agent that holds the read end of a pipe from the agent. The
kernel closes the write end when the agent exits for any reason; on that EOF the
watchdog SIGKILLs every watched process group, session and descendant, and every
process carrying a watched worker's environment markers (a ``setsid`` child whose
parent died), then removes the node directories it was given
(``/dev/shm/elaunch-*``, the workers' in-memory snapshots), then exits. Until then it sleeps on the pipe: no periodic work.

The watchdog is ``python -S -E elaunch/procs/_reaper_child.py <fd>`` (no site, no
psutil, no torch: a few MB, started without waiting for it).
"""

from __future__ import annotations

import logging
import select
import os
import subprocess
import sys
from collections.abc import Iterable, Mapping

from . import _proctree
from .helper_process import end

log = logging.getLogger(__name__)

_CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_reaper_child.py")


class Reaper:
    """Handle to a running watchdog; created by :func:`start_reaper`.

    Attributes:
        pid: the watchdog's process id.
    """

    def __init__(self, proc: subprocess.Popen, wfd: int) -> None:
        self._proc = proc
        self._wfd: int | None = wfd
        self.pid = proc.pid
        self._dirs: list[str] = []  # given to remove_on_exit

    def _send(self, text: str) -> None:
        if self._wfd is None:
            return
        data = memoryview(text.encode("ascii"))
        try:
            while data:  # a signal handler can cut a long write short
                data = data[os.write(self._wfd, data):]
        except OSError as exc:  # the watchdog died: workers are no longer protected
            log.warning("reaper %d is gone (%s); workers will not be reaped if the agent is killed", self.pid, exc)
            self._close_fd()

    def watch(self, pids: Iterable[int], markers: Mapping[int, Iterable[bytes]] | None = None) -> None:
        """Protect the process trees led by ``pids`` (workers started in their own session).

        Args:
            pids: the workers (process group and session leaders).
            markers: pid -> ``NAME=value`` environment entries (bytes) that the
                worker's descendants inherit (``spawn.marker_entries``); a
                process carrying all of one worker's is killed with the trees,
                wherever it went. None or an empty set: the tree only.

        Unknown or already-exited pids are ignored.
        """
        lines = []
        markers = markers or {}
        for pid in pids:
            p = _proctree.read(pid)
            if p is not None:
                entries = sorted(markers.get(pid, ()))
                tail = " " + b"\0".join(entries).hex() if entries else ""
                lines.append(f"w {pid} {p.start}{tail}\n")
        if lines:
            self._send("".join(lines))

    def forget(self, pids: Iterable[int] | None = None) -> None:
        """Stop protecting ``pids`` (all watched ones if None); call once they were stopped."""
        if pids is None:
            self._send("f *\n")
        else:
            self._send("".join(f"f {pid}\n" for pid in pids))

    def remove_on_exit(self, path: str) -> None:
        """Have the watchdog remove the directory ``path`` when the agent dies, after killing the workers.

        Only an agent's own directory in shared memory is removed (``snapshot_dir.removable``:
        ``/dev/shm/elaunch-*`` itself: the checkpoint node directory, the workers' progress
        files); the watchdog ignores any other path. A directory already gone is fine,
        so the agent removing it first at the end of its run needs no ``forget``.
        """
        self._dirs.append(path)
        self._send(f"d {os.fsencode(path).hex()}\n")

    def sync(self, timeout: float = 10.0) -> bool:
        """Wait up to ``timeout`` seconds until the watchdog has read every command sent so far.

        Used by tests: after True, the watched pids and markers are in force.
        """
        self._send("s\n")
        out = self._proc.stdout
        if out is None or self._wfd is None:
            return False
        ready, _, _ = select.select([out], [], [], timeout)
        return bool(ready) and os.read(out.fileno(), 1) == b"s"

    def private_fds(self) -> tuple[int, ...]:
        """The agent's ends of the watchdog's pipes: a forked worker must close them.

        A worker forked from the agent (``elaunch.procs.forked``) that kept the write
        end would keep the watchdog from seeing end-of-file when the agent dies.
        """
        fds = [] if self._wfd is None else [self._wfd]
        if self._proc.stdout is not None and not self._proc.stdout.closed:
            fds.append(self._proc.stdout.fileno())
        return tuple(fds)

    def alive(self) -> bool:
        """Return True while the watchdog process runs."""
        return self._proc.poll() is None

    def _close_fd(self) -> None:
        if self._wfd is not None:
            try:
                os.close(self._wfd)
            except OSError:
                pass
            self._wfd = None

    def close(self, timeout: float = 5.0) -> None:
        """Forget every watched tree, remove the directories given to :meth:`remove_on_exit`, end the
        watchdog and reap it. Idempotent.

        The directories are removed here, as the watchdog would remove them on the end of file that
        follows: the watchdog then finds them gone and exits without importing ``snapshot_dir``
        (9 ms of a ``python -S`` start-up measured on a 2-core VM, waited for at every run's end).

        Args:
            timeout: seconds to wait for it to exit before SIGKILLing it.
        """
        self.forget()
        if self._dirs:
            from . import snapshot_dir

            for path in self._dirs:
                if snapshot_dir.removable(path):
                    snapshot_dir.remove(path)
            self._dirs = []
        self._close_fd()
        end(self._proc, timeout, sig=None)  # asked to go by EOF: it ignores SIGTERM
        if self._proc.stdout is not None:
            self._proc.stdout.close()


def start_reaper(python: str | None = None) -> Reaper:
    """Start the watchdog for this agent and return its handle.

    Call it from the agent's main thread; the pipe's write end is close-on-exec and
    so never leaks into workers. The watchdog runs in its own session and ignores
    SIGINT/SIGTERM/SIGHUP/SIGQUIT: only the agent's exit (EOF) ends it.

    Args:
        python: interpreter to run it with; default ``sys.executable``.

    Raises:
        OSError: the process could not be started.
    """
    rfd, wfd = os.pipe()
    try:
        proc = subprocess.Popen(
            [python or sys.executable, "-S", "-E", "-B", _CHILD, str(rfd)],
            pass_fds=(rfd,),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,  # acks of sync()
            start_new_session=True,
            cwd="/",
        )
    except BaseException:
        os.close(wfd)
        raise
    finally:
        os.close(rfd)
    return Reaper(proc, wfd)
