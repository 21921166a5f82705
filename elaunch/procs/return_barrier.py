"""A worker whose function returned waits for its local siblings (``--run-path`` and function workers).

torch runs a function entrypoint (``--run-path`` makes the script one) under
``MultiprocessContext``: a worker whose function returned puts its value on a
queue, then waits on ``queue_finished_reading_event`` until the launcher read
every worker's value (``_wrap``). So no worker begins to exit while a sibling is
still inside its last collective; exiting then can abort that sibling (gloo's
"terminate called without an active exception"). elaunch's function workers are
processes of their own, so this module gives them the same wait:

* The agent (:class:`AttemptBarrier`) creates one file per local rank,
  ``<attempt dir>/rank_<lr>``, and takes an exclusive ``flock`` on each *before
  any worker of the attempt starts*. Each worker gets the locked open file as an
  inherited descriptor (a cold or forked worker), or a warm spare, which holds a
  locked file of its own since it started (:func:`spare_lock`), has that file
  renamed over its rank's placeholder once the handoff is written.
* The worker (:func:`claim` at its start, :func:`arrive` once its function
  returned) holds the lock while its function runs, releases it, then takes each
  sibling's lock shared: ``flock`` blocks in the kernel until that sibling
  returned too, or died (the kernel drops a dead process's lock). No polling.
* The agent reads the returns, as torch's parent reads the queue: it also holds
  ``<attempt dir>/go`` locked from before the workers start, and a thread of its
  own (:meth:`AttemptBarrier.read_returns`) takes every rank's lock in turn, then
  releases ``go``. A worker, once its siblings returned, waits for ``go`` too. So
  the *last* worker to return blocks as well, until the agent saw every return
  (torch's last worker waits on the event until the parent's next poll), instead
  of running straight into interpreter shutdown: while it sleeps, a gloo thread
  that still needs the GIL to drop the all-reduced tensor gets it.
* A sibling that failed: the agent's monitor sees its exit and stops the group at
  once, waiting workers included (SIGTERM ends a ``flock`` wait). A sibling that
  exited 0 without returning (``os._exit(0)``) releases its lock as it dies.

A worker started alone (one local worker), a plain script, and any process started
without the variable :data:`ENV` (a script run without elaunch) never wait.
Stdlib only, no torch: ``elaunch.runpath`` and the agent import this module.
"""

from __future__ import annotations

import fcntl
import os
import stat

TYPE_CHECKING = False  # not typing.TYPE_CHECKING: importing typing costs ~2 ms in every worker
if TYPE_CHECKING:
    from collections.abc import Iterable, MutableMapping, Sequence

#: The worker's variable: ``"<fd>:<path>"``, its held lock descriptor and its rank file.
#: ``_warm_child.py`` (stdlib only, no elaunch import) repeats the name.
ENV = "ELAUNCH_RETURN_BARRIER"
#: The worker modules whose workers run a function (``python -m MODULE``).
FUNCTION_MODULES = frozenset({"elaunch.runpath", "elaunch.procs._fn_worker"})
_RANK_PREFIX = "rank_"
#: The agent's file in the attempt directory: locked until the agent saw every worker return.
GO = "go"


def applies(cmd: Sequence[str], local_world_size: int, forked: bool = False) -> bool:
    """Whether the workers of ``cmd`` wait for their siblings: function workers, more than one local worker.

    Args:
        cmd: a worker argv; ``python [-u] -m elaunch.runpath|elaunch.procs._fn_worker ...`` runs a function.
        local_world_size: the number of workers on this node.
        forked: the workers are forks calling a function (``start_method="fork"``).
    """
    if local_world_size < 2:
        return False
    if forked:
        return True
    args = list(cmd[1:])
    while args and args[0] == "-u":
        args.pop(0)
    return len(args) >= 2 and args[0] == "-m" and args[1] in FUNCTION_MODULES


def _locked(path: str) -> int:
    """Create ``path`` (it must not exist) and return a descriptor holding its exclusive lock."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a new file: nobody else can hold it
    except BaseException:
        os.close(fd)
        raise
    return fd


#: The barrier directory's name: ``elaunch-barrier-<random>-<agent pid>``.
ROOT_PREFIX = "elaunch-barrier-"


def make_root(shm_root: str, pid: int) -> str:
    """Create the run's barrier directory (mode 0700) and return its path.

    In ``shm_root`` (``/dev/shm``) when it is writable: a directory there named
    ``elaunch-*`` is one the agent's watchdog removes after a ``kill -9`` of the agent
    (``Reaper.remove_on_exit``). Else in the temporary directory (``TMPDIR``, ``/tmp``),
    which the watchdog leaves alone: only a normal end of the agent removes it there.

    Args:
        shm_root: the shared-memory root (``snapshot_dir.SHM_ROOT``).
        pid: the agent's pid, the name's last part (as the node directories').

    Raises:
        OSError: neither place can hold it.
    """
    import tempfile  # the agent's side only: workers never load it

    try:
        return tempfile.mkdtemp(prefix=ROOT_PREFIX, suffix=f"-{pid}", dir=shm_root)
    except OSError:
        return tempfile.mkdtemp(prefix=ROOT_PREFIX, suffix=f"-{pid}")


def spare_lock(directory: str) -> tuple[int, str]:
    """Create a locked file in ``directory`` for a warm spare: ``(descriptor, path)``.

    The spare inherits the descriptor and holds the lock from its start; the agent
    closes its own copy once the spare has it.

    Raises:
        OSError: the file cannot be created.
    """
    import tempfile  # the agent's side only: workers never load it

    fd, path = tempfile.mkstemp(prefix="spare-", dir=directory)
    try:
        os.set_inheritable(fd, False)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BaseException:
        os.close(fd)
        os.unlink(path)
        raise
    return fd, path


def target(env: MutableMapping[str, str] | dict[str, str]) -> str | None:
    """The rank file a worker environment names (a spare's file is renamed over it), or None."""
    value = env.get(ENV)
    return value.partition(":")[2] or None if value else None


class AttemptBarrier:
    """The agent's side for one attempt: every rank's file, locked before any worker starts.

    Args:
        directory: a directory for this attempt alone (created; it must not exist).
        local_ranks: the attempt's local ranks.

    Raises:
        OSError: the directory or a file cannot be created (nothing is left open).
    """

    def __init__(self, directory: str, local_ranks: Iterable[int]) -> None:
        os.makedirs(directory)
        self.directory = directory
        self._fds: dict[int, int] = {}
        self._ranks = sorted(local_ranks)
        self._go: int | None = None
        try:
            self._go = _locked(os.path.join(directory, GO))
            for lr in self._ranks:
                self._fds[lr] = _locked(self.path(lr))
        except BaseException:
            self.close()
            self.release()
            raise

    def path(self, local_rank: int) -> str:
        """The rank file of ``local_rank``."""
        return os.path.join(self.directory, f"{_RANK_PREFIX}{local_rank}")

    def env(self, local_rank: int) -> dict[str, str]:
        """The worker's variable (:data:`ENV`): the descriptor it inherits and its rank file."""
        return {ENV: f"{self._fds[local_rank]}:{self.path(local_rank)}"}

    def fd(self, local_rank: int) -> int:
        """The agent's descriptor of ``local_rank``'s lock (to hand a cold worker: ``pass_fds``)."""
        return self._fds[local_rank]

    def others(self, local_rank: int) -> tuple[int, ...]:
        """The descriptors a worker of ``local_rank`` forked from the agent must close: its siblings' locks
        and the agent's ``go`` (a fork holding it would keep every worker waiting)."""
        go = () if self._go is None else (self._go,)
        return (*(fd for lr, fd in self._fds.items() if lr != local_rank), *go)

    def started(self, local_rank: int) -> None:
        """Close the agent's copy once ``local_rank``'s worker holds its lock (inherited, or a spare's file)."""
        fd = self._fds.pop(local_rank, None)
        if fd is not None:
            os.close(fd)

    def close(self) -> None:
        """Close every copy of a rank's lock the agent still holds (idempotent); the files stay for the workers.

        ``go`` stays locked: :meth:`read_returns` releases it, or :meth:`release`.
        """
        for lr in list(self._fds):
            self.started(lr)

    def release(self) -> None:
        """Release ``go``: every worker waiting on its siblings may exit now (idempotent)."""
        fd, self._go = self._go, None
        if fd is not None:
            os.close(fd)

    def read_returns(self) -> "threading.Thread":
        """Start the agent's reader: a daemon thread that releases ``go`` once every worker returned or died.

        Call it once every worker started (:meth:`close` done). The thread blocks in
        ``flock`` on each rank's file in turn (no polling); a worker killed by the
        agent's stop releases its lock as it dies, and a rank file removed with the
        attempt's directory counts as released, so the thread always ends once the
        attempt's workers are gone.

        Returns:
            The started thread (the caller may join it).
        """
        import threading

        def read() -> None:
            try:
                for lr in self._ranks:
                    _wait_returned(self.path(lr))
            finally:
                self.release()

        thread = threading.Thread(target=read, name=f"elaunch-return-reader-{os.path.basename(self.directory)}",
                                  daemon=True)
        thread.start()
        return thread


# ---------------------------------------------------------------------------- worker side


class Held:
    """A worker's lock, held from :func:`claim` until :func:`arrive` (a plain class: no dataclasses import).

    Attributes:
        fd: the descriptor holding the exclusive lock.
        path: the worker's rank file; its siblings' are beside it.
    """

    __slots__ = ("fd", "path")

    def __init__(self, fd: int, path: str) -> None:
        self.fd = fd
        self.path = path

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Held) and (self.fd, self.path) == (other.fd, other.path)

    def __repr__(self) -> str:
        return f"Held(fd={self.fd}, path={self.path!r})"


def claim(environ: MutableMapping[str, str] | None = None) -> Held | None:
    """Take the worker's lock from :data:`ENV` and remove the variable (the script never sees it).

    Args:
        environ: the environment to read (default ``os.environ``).

    Returns:
        The held lock; None when the variable is absent (started alone, or without
        elaunch) or names no open regular file (a copy without the descriptor).
    """
    environ = os.environ if environ is None else environ
    value = environ.pop(ENV, None)
    if not value:
        return None
    fd_text, _, path = value.partition(":")
    try:
        fd = int(fd_text)
        if not stat.S_ISREG(os.fstat(fd).st_mode) or not path:
            return None
        os.set_inheritable(fd, False)  # programs the script starts do not hold it
    except (ValueError, OSError):
        return None
    return Held(fd, path)


def arrive(held: Held | None) -> None:
    """Release the worker's lock, block until every local sibling returned or died, then until the agent saw it.

    Mirrors torch's ``_wrap`` waiting on ``queue_finished_reading_event``, which the
    parent sets once it read every worker's return value: the last worker to return
    waits too (for ``go``, released by :meth:`AttemptBarrier.read_returns`). Blocks in
    ``flock(2)``: a signal's default action (the agent's SIGTERM) ends the wait.
    None (no barrier): returns at once.
    """
    if held is None:
        return
    fcntl.flock(held.fd, fcntl.LOCK_UN)
    os.close(held.fd)
    directory, own = os.path.split(held.path)
    try:
        names = sorted(os.listdir(directory))
    except OSError:  # the attempt is over (the agent removed it)
        return
    for name in names:
        if name.startswith(_RANK_PREFIX) and name != own:
            _wait_returned(os.path.join(directory, name))
    _wait_returned(os.path.join(directory, GO))


def _wait_returned(path: str) -> None:
    """Block until the holder of ``path``'s lock released it, following a placeholder replaced meanwhile."""
    while True:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
            try:
                now = os.stat(path)
            except FileNotFoundError:
                return
            if os.path.samestat(os.fstat(fd), now):
                return
            # the agent's placeholder, replaced by a spare's file (renamed over it): wait on that one
        finally:
            os.close(fd)
