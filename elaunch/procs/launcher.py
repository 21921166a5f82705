"""The worker launcher: starts each attempt's workers and owns what outlives one attempt.

One :class:`WorkerLauncher` per agent run holds the run's log directory
(:class:`~elaunch.procs.logs.RunLogDir`), the watchdog that kills the workers if
the agent dies (:mod:`elaunch.procs.reaper`) and the warm pool
(:class:`~elaunch.procs.warm.WarmPool`, or :class:`NoWarmPool` when
``--warm-start`` is off), so the agent only says *what* to start. Every helper
process of the run, and the watchdog last, is owned by its one
:class:`~elaunch.supervision.Supervisor` (:attr:`WorkerLauncher.supervisor`):
a worker forked from the agent closes the descriptors it names, and
:meth:`WorkerLauncher.close` stops them all in their declared order. torch's
``LocalElasticAgent`` keeps these in the agent itself.

No torch import here: the agent imports this module.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
from collections.abc import Mapping
from typing import Callable

from . import return_barrier
from .forked import ForkedProcess, fork_worker
from .logs import AttemptLogs, LogsSpec, RunLogDir, SpecsLogDir
from .reaper import Reaper, start_reaper
from .store_host import StoreHost
from elaunch.supervision import LAUNCH, SPARES, STORE, Supervisor
from .warm import WarmPool
from .spawn import marker_entries, popen_worker
from .workers import WorkerProcesses

log = logging.getLogger(__name__)


class NoWarmPool:
    """The warm pool when ``--warm-start`` is off: never has a spare, prepares none."""

    name = "warm pool"
    enabled = False
    used = 0

    def logs_for(self, attempt: int) -> AttemptLogs | None:
        """Return None: no spare ever writes logs."""
        return None

    def prepare(self, attempt: int, logs: AttemptLogs, cmds: Mapping, envs: Mapping, nice: int = 0,
                templates: bool = True, lock_dir: str | None = None) -> int:
        """Start nothing; return 0."""
        return 0

    handoff = None  #: no adopt hook: every worker starts cold

    def discard(self) -> None:
        """Nothing to discard."""

    def close(self) -> None:
        """Nothing to close."""


class WorkerLauncher:
    """Starts the workers of each attempt of one agent run.

    Args:
        logs: where worker output goes (``--log-dir``, ``-r``, ``-t``, filters).
        run_id: the job id, part of the log directory's name.
        warm_modules: ``--warm-start``: modules each spare imports in advance, or
            None for no warm pool (every worker starts cold, as under torchrun).
        reaper_factory: starts the watchdog (injectable for tests).
        fork_target: ``elastic_launch`` with a function and ``start_method="fork"``:
            each worker is a fork of this process (``elaunch.procs.forked``) that
            calls ``fork_target(local_rank)`` and exits with the status it returns;
            the worker argv is not run. None (default): every worker execs its argv.
        spare_hook: ``module:function`` each warm spare calls while it waits
            (``warm.WARM_HOOK_ENV``; the agent names the checkpoint feature's), or None.
        supervisor: the launch's supervisor (``elaunch.launch`` makes one for the whole launch:
            the metrics server and the rendezvous' threads are on it too), or None for one of its own.

    Attributes:
        pool: the warm pool (a :class:`NoWarmPool` when warm start is off, or before
            :meth:`open`).
        supervisor: the owner of the run's helpers and, last, of its watchdog: features add
            theirs to it (``supervisor.add``); :meth:`close` stops them (the launch's own helpers,
            tiers from ``LAUNCH`` on, stay for the launch's close).
    """

    def __init__(
        self,
        logs: LogsSpec,
        run_id: str,
        warm_modules: tuple[str, ...] | None = None,
        reaper_factory: Callable[[], Reaper] = start_reaper,
        fork_target: Callable[[int], int] | None = None,
        spare_hook: str | None = None,
        supervisor: Supervisor | None = None,
    ) -> None:
        self._logs = logs
        self._spare_hook = spare_hook
        self._run_id = run_id
        self._warm_modules = warm_modules
        self._reaper_factory = reaper_factory
        self._log_dir: RunLogDir | SpecsLogDir | None = None
        self._reaper: Reaper | None = None
        self._fork_target = fork_target
        self.pool: WarmPool | NoWarmPool = NoWarmPool()
        self._store_host: StoreHost | None = None
        self._barrier_root: str | None = None  # return_barrier's files, made when first needed
        self.supervisor = supervisor if supervisor is not None else Supervisor()  # open() gives it the watchdog

    @property
    def log_root(self) -> str | None:
        """The run's log directory once :meth:`open` made it (``os.devnull`` when discarding)."""
        return self._log_dir.root if self._log_dir is not None else None

    def open(self) -> None:
        """Create the run's log directory and start the watchdog (and the warm pool).

        With a torch LogsSpecs (``--logs-specs``) the files are its, and no warm
        pool starts: spares open their log files before the group's environments
        exist, which the LogsSpecs needs to name them.

        Raises:
            NotADirectoryError: ``--log-dir`` names a file.
            OSError: the directory or the watchdog cannot be created.
        """
        specs = self._logs.specs
        self._log_dir = RunLogDir(self._logs, self._run_id) if specs is None else SpecsLogDir(specs)
        self._reaper = self._reaper_factory()
        self.supervisor.reaper = self._reaper  # the one supervisor of __init__: nothing added before is dropped
        if self._warm_modules is not None and specs is None:
            self.pool = WarmPool(self._warm_modules, self._reaper, hook=self._spare_hook)
            self.supervisor.add(self.pool, SPARES, watched=False)  # a dead spare is found at its handoff
        elif self._warm_modules is not None:
            log.warning("--warm-start is off with --logs-specs: spares cannot open the files a LogsSpecs names")

    def attempt_logs(self, attempt: int, local_world_size: int) -> AttemptLogs:
        """Return the destinations of ``attempt``: its warm spares' when they are ready, else new ones.

        Raises:
            RuntimeError: :meth:`open` was not called.
            OSError: the attempt's directories cannot be created.
        """
        ready = self.pool.logs_for(attempt)
        return ready if ready is not None else self._run_dir().attempt(attempt, local_world_size)

    def start(
        self,
        attempt: int,
        logs: AttemptLogs,
        cmds: dict[int, list[str]],
        envs: dict[int, dict[str, str]],
        prefixes: dict[int, str],
        another_may_follow: bool,
        keep: "Callable[[int, list[str], dict[str, str]], subprocess.Popen | None] | None" = None,
    ) -> WorkerProcesses:
        """Start one worker per local rank (handing them to warm spares where possible).

        Args:
            attempt: the attempt number (>= 0), as given to :meth:`attempt_logs`.
            logs: that attempt's destinations.
            cmds, envs: local rank -> argv / full environment.
            prefixes: local rank -> console prefix of tee'd lines.
            another_may_follow: True when an attempt may follow this one; then the
                warm pool prepares its spares while this one runs.
            keep: an ``adopt`` hook tried before the warm pool's: a process that already runs
                and takes the local rank (in-process restart's survivors,
                ``elaunch.inprocess.restarts``), or None.

        Function workers (``--run-path``, ``elastic_launch`` of a callable) of more
        than one local worker get :mod:`~elaunch.procs.return_barrier`'s variable: one
        that returned waits for its siblings, as under torch's ``MultiprocessContext``.

        Raises:
            OSError: a worker could not be started (those already started are killed).
        """
        pool = self.pool
        self._run_dir().reify(logs, envs)  # a --logs-specs LogsSpecs names the files now
        barrier = self._attempt_barrier(attempt, cmds)
        if barrier is not None:
            envs = {lr: {**env, **barrier.env(lr)} for lr, env in envs.items()}
        adopt = pool.handoff if self._fork_target is None else self._forker(logs, barrier)
        if keep is not None:
            adopt = _first(keep, adopt)
        if barrier is not None:
            adopt = self._with_barrier(barrier, logs, adopt)
        try:
            procs = WorkerProcesses.start(cmds, envs, logs, self._logs, prefixes, reaper=self._reaper, adopt=adopt,
                                          supervisor=self.supervisor)
        except BaseException:
            if barrier is not None:
                barrier.close()
                barrier.release()  # no worker runs
            raise
        if barrier is not None:
            barrier.close()  # every worker holds its own lock now
            barrier.read_returns()  # releases the workers once every one returned, as torch's parent
        pool.discard()  # spares this attempt did not use
        if pool.enabled and another_may_follow:
            # prepare the next attempt's spares, writing to its log files
            local_world_size = len(cmds)
            pool.prepare(attempt + 1, self._run_dir().attempt(attempt + 1, local_world_size), cmds, envs,
                         lock_dir=self._lock_dir(cmds))
        return procs

    def prestart(self, local_rank: int, cmd: list[str], env: Mapping[str, str],
                 extra_env: Mapping[str, str]) -> "subprocess.Popen | None":
        """Hand the next attempt's warm spare of ``local_rank`` a worker now, before that attempt starts.

        In-process restart's replacement of a dead worker (``elaunch.inprocess``): the spare gets the
        dead worker's ``(cmd, env)`` and ``extra_env`` (the mark that makes it wait for its round) as
        soon as the death is seen, and is adopted by the next attempt's ``keep`` hook. None (nothing
        started; the rank starts at the attempt, as before) without ``--warm-start``, for function
        workers, or when the spare is not ready to be handed over without a wait.
        """
        pool = self.pool
        if not pool.enabled or self._fork_target is not None or return_barrier.target(env) is not None:
            return None
        if not pool.ready(local_rank):
            return None
        return pool.handoff(local_rank, cmd, env, extra_env)

    # ------------------------------------------------------------ return barrier

    def _lock_dir(self, cmds: Mapping[int, list[str]]) -> str | None:
        """The directory of the run's barrier files when ``cmds``' workers wait for their siblings, else None.

        Raises:
            OSError: it cannot be created.
        """
        first = next(iter(cmds.values()), ())
        if not return_barrier.applies(first, len(cmds), forked=self._fork_target is not None):
            return None
        if self._barrier_root is None:
            from .snapshot_dir import SHM_ROOT

            self._barrier_root = return_barrier.make_root(SHM_ROOT, os.getpid())
            if self._reaper is not None:  # after a kill -9 of the agent, the watchdog removes it
                self._reaper.remove_on_exit(self._barrier_root)
        return self._barrier_root

    def _attempt_barrier(self, attempt: int, cmds: Mapping[int, list[str]]) -> return_barrier.AttemptBarrier | None:
        """``attempt``'s barrier, every rank's file locked (earlier attempts' removed), or None when none applies."""
        root = self._lock_dir(cmds)
        if root is None:
            return None
        for name in os.listdir(root):  # the workers of earlier attempts are gone
            if name.startswith("attempt_"):
                shutil.rmtree(os.path.join(root, name), ignore_errors=True)
        return return_barrier.AttemptBarrier(os.path.join(root, f"attempt_{attempt}"), sorted(cmds))

    @staticmethod
    def _with_barrier(barrier: return_barrier.AttemptBarrier, logs: AttemptLogs, adopt) -> Callable:
        """Wrap ``adopt``: a worker no spare or fork took starts cold with its lock's descriptor;
        the agent's copy is closed once the worker holds the lock."""

        def start(local_rank: int, argv: list[str], env: dict[str, str]) -> "subprocess.Popen | ForkedProcess":
            proc = adopt(local_rank, argv, env) if adopt is not None else None
            if proc is None:
                proc = popen_worker(argv, env, logs.stdout.get(local_rank), logs.stderr.get(local_rank),
                                    pass_fds=(barrier.fd(local_rank),))
            barrier.started(local_rank)
            return proc

        return start

    def prewarm(self, attempt: int, cmds: dict[int, list[str]], envs: dict[int, dict[str, str]]) -> None:
        """Start ``attempt``'s spares before its round forms (warm start only).

        The node's template starts now and imports at normal priority (no group runs on this
        node yet); it forks the spares of every local rank once, and every later attempt's.
        ``envs`` may lack what a round sets (``warm.ROUND_KEYS``): the handoff brings it.
        """
        if self.pool.enabled and self._fork_target is None:
            self.pool.prepare(attempt, self._run_dir().attempt(attempt, len(cmds)), cmds, envs, nice=0,
                              lock_dir=self._lock_dir(cmds))

    def serve_store(self, host: str, port: int) -> int:
        """Host this round's workers' store at ``host:port`` (0: a free port); return the port.

        The first call starts the store-host child (``procs.store_host``); each call
        replaces the previous round's store with a fresh one.

        Raises:
            OSError: the port cannot be bound or the child cannot be started.
        """
        if self._store_host is None:
            # a dead store host is reported at the next round's serve, not by the monitor
            self._store_host = self.supervisor.add(StoreHost(self._reaper), STORE, watched=False)
        return self._store_host.serve(host, port)

    @property
    def reaper(self) -> Reaper | None:
        """The watchdog that outlives the agent, once :meth:`open` started it."""
        return self._reaper

    def _forker(self, logs: AttemptLogs, barrier: return_barrier.AttemptBarrier | None = None,
                ) -> Callable[[int, list[str], dict[str, str]], ForkedProcess]:
        """The ``adopt`` hook that forks each worker of ``logs``' attempt to run the fork target
        (closing its siblings' barrier locks in the child)."""
        target, reaper = self._fork_target, self._reaper
        private = self.supervisor.private_fds()  # every helper's channels and the watchdog's pipes

        def fork(local_rank: int, argv: list[str], env: dict[str, str]) -> ForkedProcess:
            # the watchdog knows the worker before it runs a line of the target: a child it
            # forks at once and a kill -9 of the agent right after still find it watched
            watch = None if reaper is None else lambda pid: reaper.watch([pid], {pid: marker_entries(env)})
            siblings = barrier.others(local_rank) if barrier is not None else ()
            return fork_worker(lambda: target(local_rank), env, logs.stdout.get(local_rank),
                               logs.stderr.get(local_rank), close_fds=(*private, *siblings), before_run=watch)

        return fork

    def no_more_attempts(self) -> None:
        """Kill the warm spares: nothing will use them."""
        self.pool.close()

    def remove_log_dir_if_temporary(self) -> None:
        """Delete the log directory when it is a temporary one (after a successful run)."""
        if self._log_dir is not None:
            self._log_dir.remove_if_temporary()

    def close(self) -> None:
        """Stop every helper (the spares among them) in the supervisor's order, then the watchdog.
        Idempotent; the log directory is kept."""
        if self._barrier_root is not None:  # first: nothing below that raises leaves it behind
            shutil.rmtree(self._barrier_root, ignore_errors=True)
            self._barrier_root = None
        self._store_host = None
        self._reaper = None
        self.supervisor.close(below=LAUNCH)  # the run's helpers, then the watchdog; the launch's stay

    def _run_dir(self) -> RunLogDir | SpecsLogDir:
        if self._log_dir is None:
            raise RuntimeError("WorkerLauncher.open() was not called")
        return self._log_dir


def _first(hook: Callable, then: Callable | None) -> Callable:
    """An ``adopt`` hook that tries ``hook``, then ``then`` (None: start cold)."""

    def adopt(local_rank: int, argv: list[str], env: dict[str, str]):
        proc = hook(local_rank, argv, env)
        if proc is None and then is not None:
            proc = then(local_rank, argv, env)
        return proc

    return adopt
