"""Starting one worker process: its own session, death with the agent, and the marks its descendants carry.

:func:`popen_worker` starts every exec'd worker (and the warm spares and the
store-host child) the same way: its own session (process group id = pid),
``PR_SET_PDEATHSIG=SIGKILL``, streams appended to its log files, and a handled
signal held back until the fork is over (``deferral``). :func:`marker_entries`
names the environment entries by which the agent and the watchdog find a
worker's descendants wherever they went; :func:`become_subreaper` makes the
agent adopt them. Watching and stopping a group of workers is
``elaunch.procs.workers``. Stdlib only (no torch: the agent imports this module).
"""

from __future__ import annotations

import ctypes
import os
import signal as _signal
import subprocess

from . import _proctree
from .deferral import deferred

_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36
_PR_GET_CHILD_SUBREAPER = 37
#: Worker env entries an adopted orphan must carry (those the worker had) to be taken
#: for one of this attempt's: together they name the run, attempt and rank.
_MARKERS = ("TORCHELASTIC_RUN_ID", "TORCHELASTIC_ERROR_FILE", "RANK", "LOCAL_RANK", "MASTER_PORT")
_SIGKILL = int(_signal.SIGKILL)
try:
    _prctl = ctypes.CDLL(None, use_errno=True).prctl
except (OSError, AttributeError):  # not Linux
    _prctl = None


def _child_setup(parent: int, mask: "set[_signal.Signals] | None" = None):
    """Return a preexec_fn: die with the agent (PDEATHSIG), even if it died during the fork.

    ``mask``: the signal mask to put back before ``exec`` (the parent blocked every
    signal around the fork, see :func:`popen_worker`); None leaves it as inherited.
    """

    def setup() -> None:
        if _prctl is not None:
            _prctl(_PR_SET_PDEATHSIG, _SIGKILL, 0, 0, 0)
        if os.getppid() != parent:
            os.kill(os.getpid(), _SIGKILL)
        if mask is not None:
            _signal.pthread_sigmask(_signal.SIG_SETMASK, mask)

    return setup


def _open(path: str | None):
    if path is None:
        return None
    if path == os.devnull:
        return subprocess.DEVNULL
    return open(path, "ab")  # noqa: SIM115 - handed to the child, closed after Popen


def popen_worker(
    cmd: list[str],
    env: dict[str, str],
    stdout_path: str | None,
    stderr_path: str | None,
    pass_fds: tuple[int, ...] = (),
) -> subprocess.Popen:
    """Start one process the way every worker is started (also used for warm spares).

    Its own session (process group id = pid), ``PR_SET_PDEATHSIG=SIGKILL``, streams
    appended to ``stdout_path``/``stderr_path`` (None: inherit the agent's). Call from
    the agent's main thread.

    Raises:
        OSError: the program could not be started.
    """
    out = _open(stdout_path)
    err = _open(stderr_path)
    proc = None
    try:
        # with a preexec_fn Popen runs the interpreter's at-fork hooks: a handled signal
        # raises once the fork is over, here (see deferral); the child starts with every
        # signal blocked (it runs Python, the agent's handlers, until exec)
        with deferred():
            mask = _signal.pthread_sigmask(_signal.SIG_BLOCK, _signal.valid_signals())
            try:
                proc = subprocess.Popen(
                    cmd,
                    env=env,
                    stdout=out,
                    stderr=err,
                    start_new_session=True,
                    preexec_fn=_child_setup(os.getpid(), mask),
                    pass_fds=pass_fds,
                )
            finally:
                _signal.pthread_sigmask(_signal.SIG_SETMASK, mask)
                for f in (out, err):
                    if f is not None and not isinstance(f, int):
                        f.close()
    except BaseException:
        if proc is not None:  # started, but the caller never gets it: leave no orphan
            _proctree.killpg([proc.pid], _SIGKILL)
            proc.wait()
        raise
    return proc


def become_subreaper() -> bool:
    """Make this process adopt its orphaned descendants (``PR_SET_CHILD_SUBREAPER``); True on success.

    A worker's child that leaves its session (``setsid``) and whose worker exits
    is then re-parented to the agent instead of init, so the agent still finds it
    (``WorkerProcesses._family``) however soon the worker exited.
    """
    return _prctl is not None and _prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0


def is_subreaper() -> bool:
    """True when this process adopts its orphaned descendants (``PR_GET_CHILD_SUBREAPER``)."""
    if _prctl is None:
        return False
    value = ctypes.c_int(0)
    return _prctl(_PR_GET_CHILD_SUBREAPER, ctypes.byref(value), 0, 0, 0) == 0 and value.value != 0


def stop_being_subreaper() -> None:
    """Let this process's orphaned descendants go to init again (undoes :func:`become_subreaper`).

    For the Python API, whose agent runs in the caller's process: once the launch
    returned, the caller's own children's orphans are none of elaunch's business.
    """
    if _prctl is not None:
        _prctl(_PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0)


def marker_entries(env: dict[str, str]) -> frozenset[bytes]:
    """The ``NAME=value`` entries of ``env`` that mark a process as one of this worker's (run, attempt, rank).

    A descendant inherits them unless it clears its environment; the agent (for the
    orphans it adopts) and the watchdog (when the agent died) find a worker's
    descendants by the whole set.
    """
    return frozenset(f"{k}={env[k]}".encode() for k in _MARKERS if k in env)
