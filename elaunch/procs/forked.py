"""Workers forked from the agent's own process (``elastic_launch`` with ``start_method="fork"``).

torch runs a function entrypoint with ``torch.multiprocessing`` and the
``fork`` start method when asked to: the child already holds the function,
so one defined in a notebook (which cannot be pickled) works. elaunch forks
the same way, and gives the child everything an exec'd worker gets from
:func:`elaunch.procs.spawn.popen_worker`: its own session (process group id =
pid), ``PR_SET_PDEATHSIG=SIGKILL`` (and death if the agent already died),
stdout/stderr appended to its log files, and its complete environment in
``os.environ``. It also closes the agent's private descriptors (the reaper's
pipe: a worker holding it would keep the watchdog from seeing the agent die)
and puts the signal handlers back to an interpreter's defaults.

:func:`fork_worker` returns once the child is set up (as ``Popen`` returns
after ``exec``), with a :class:`ForkedProcess` that the agent watches and
stops exactly like a ``Popen``.

No torch import here: the agent imports this module.
"""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Iterable, Mapping
from typing import Callable

from . import launch_env
from .deferral import deferred
from .spawn import _child_setup

#: Seconds between ``waitpid`` polls in :meth:`ForkedProcess.wait`.
_POLL = 0.01


class ForkedProcess:
    """A forked worker, with the part of ``subprocess.Popen``'s interface the agent uses.

    Attributes:
        pid: the child's process id (also its process group and session id).
        returncode: None while it runs; its exit status, ``-signum`` if a signal
            killed it (``Popen``'s convention).
    """

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        """Reap the child if it exited; return ``returncode``."""
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped elsewhere: the status is lost (Popen says 0 too)
                self.returncode = 0
                return 0
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """Wait for the child to exit (at most ``timeout`` seconds); return ``returncode``.

        Raises:
            subprocess.TimeoutExpired: it still runs after ``timeout`` seconds.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"forked worker {self.pid}", timeout)
            time.sleep(_POLL)
        return self.returncode  # type: ignore[return-value]


def _open_append(path: str | None) -> int | None:
    return None if path is None else os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)


def _rebind(fd: int, name: str) -> None:
    """Point fd 1 or 2 and ``sys.stdout``/``sys.stderr`` at ``fd``, unbuffered like ``python -u``."""
    target = 1 if name == "stdout" else 2
    os.dup2(fd, target)
    stream = io.TextIOWrapper(io.FileIO(target, "w", closefd=False), line_buffering=True, write_through=True,
                              errors="backslashreplace" if name == "stderr" else None)
    setattr(sys, name, stream)


def _default_signals() -> None:
    """Undo the agent's signal handlers: SIGINT raises KeyboardInterrupt, the rest are SIG_DFL."""
    for sig in signal.valid_signals():
        try:
            handler = signal.getsignal(sig)
        except (OSError, ValueError):
            continue
        if callable(handler) and handler is not signal.default_int_handler:
            signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)


def _child(run: Callable[[], int], env: Mapping[str, str], out: int | None, err: int | None,
           close_fds: Iterable[int], ready: int, go: int, parent: int, mask: Iterable[int]) -> None:
    """The forked child: set up like an exec'd worker, tell the parent, wait for its go, run, ``os._exit``.

    Signals are blocked on entry; they are unblocked (``mask``) once the handlers are
    an interpreter's defaults again. End-of-file instead of the go (the parent died or
    gave up on this child) ends the child before it runs anything.
    """
    code = 1
    try:
        os.setsid()
        _child_setup(parent)()
        _default_signals()
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        for fd in close_fds:
            try:
                os.close(fd)
            except OSError:
                pass
        for fd, name in ((out, "stdout"), (err, "stderr")):
            if fd is not None:
                _rebind(fd, name)
                os.close(fd)
        os.environ.clear()
        os.environ.update(env)
        launch_env.record(env)  # what the script then sets itself, @restartable sets again each round
        os.write(ready, b"1")
        os.close(ready)
        if os.read(go, 1) != b"1":
            os._exit(1)
        os.close(go)
        code = run()
    except KeyboardInterrupt:
        _flush()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)  # exit as an interpreter does: killed by SIGINT
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:
        traceback.print_exc()
    finally:
        _flush()
        os._exit(code & 0xFF if code >= 0 else 1)


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass


def fork_worker(
    run: Callable[[], int],
    env: Mapping[str, str],
    stdout_path: str | None,
    stderr_path: str | None,
    close_fds: Iterable[int] = (),
    before_run: Callable[[int], None] | None = None,
) -> ForkedProcess:
    """Fork this process into one worker that calls ``run()`` and exits with its status.

    Call from the agent's main thread (``PR_SET_PDEATHSIG`` follows the forking
    thread). The child inherits this process's memory (the function to call, its
    arguments, imported modules) and descriptors, minus ``close_fds``.

    Args:
        run: called in the child once it is set up; returns the exit status (0-255).
            An exception escaping it is printed to the child's stderr (status 1);
            ``KeyboardInterrupt`` kills the child with SIGINT, as an interpreter exits.
        env: the worker's complete environment; the child's ``os.environ`` is replaced by it.
        stdout_path, stderr_path: files the streams are appended to (``os.devnull``
            included); None inherits the agent's.
        close_fds: descriptors of the agent the child must not hold.
        before_run: called with the child's pid once it is set up and before it calls
            ``run()`` (the child waits for it): e.g. registering it with the watchdog,
            so that not even a child the worker forks at once outlives a ``kill -9``
            of the agent. If it raises, the child is killed and reaped and the
            exception propagates.

    Returns:
        The child's :class:`ForkedProcess`, once it runs in its own session with its
        streams and environment in place (and ``before_run`` returned).

    Raises:
        OSError: a log file cannot be opened, ``fork`` failed, or the child died
            before it was set up (it is reaped).
    """
    fds: dict[str, int | None] = {}  # closed in this process once the child runs, or failed
    pid = 0
    try:
        # a handled signal raises once the fork and the closing of the descriptors are over, here (see
        # deferral): one whose handler ran as the closing began (outside the block) left the child running
        with deferred():
            try:
                fds["out"] = _open_append(stdout_path)
                fds["err"] = _open_append(stderr_path)
                fds["ready_read"], fds["ready"] = os.pipe()
                fds["go_read"], fds["go"] = os.pipe()
                _flush()  # what this process printed must not be printed again by the child
                pid = _fork(run, env, fds, close_fds)
                started = _handshake(pid, fds, before_run)
                proc = ForkedProcess(pid)
            finally:
                _close_all(fds)
    except BaseException:  # e.g. a handled signal: no child behind
        _kill_and_reap(pid)
        raise
    if not started:
        code = proc.wait()
        raise OSError(f"forked worker {pid} exited ({code}) before it was set up")
    return proc


def _kill_and_reap(pid: int) -> None:
    """SIGKILL and reap ``pid`` (0: no child yet); no handled signal cuts this short."""
    with deferred():
        if pid:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)


def _close_all(fds: Mapping[str, int | None]) -> None:
    """Close every descriptor of ``fds``; no handled signal between two closes leaks the rest."""
    with deferred():
        for fd in fds.values():
            if fd is not None:
                os.close(fd)


def _fork(run: Callable[[], int], env: Mapping[str, str], fds: Mapping[str, int | None],
          close_fds: Iterable[int]) -> int:
    """Fork; return the child's pid. The child keeps its ends of the pipes and becomes the worker
    (:func:`_child`), starting with every signal blocked: it runs the agent's handlers until it reset them."""
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, ())  # this thread's mask, unchanged
    parent = os.getpid()
    signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())
    try:
        pid = os.fork()
        if pid == 0:
            os.close(fds["ready_read"])
            os.close(fds["go"])
            _child(run, env, fds["out"], fds["err"], close_fds, fds["ready"], fds["go_read"], parent, mask)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    return pid


def _handshake(pid: int, fds: dict[str, int | None], before_run: Callable[[int], None] | None) -> bool:
    """Wait until the child is set up, call ``before_run(pid)``, let the child run; False if it died first
    (this process closes its copies of the child's ends first, so that the death reads as end-of-file)."""
    os.close(fds.pop("ready"))
    os.close(fds.pop("go_read"))
    if not os.read(fds["ready_read"], 1):
        return False
    if before_run is not None:
        before_run(pid)
    os.write(fds["go"], b"1")
    return True
