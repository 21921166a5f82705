"""Warm restart (``--warm-start``): spare worker interpreters with the heavy modules imported.

torchrun restarts a failed group with fresh interpreters, each re-importing
torch (about a second of CPU per worker). A :class:`WarmPool` keeps one spare per
local rank for the *next* attempt: a direct child of the agent started exactly like
a worker (own session, ``PR_SET_PDEATHSIG``, the next attempt's log files,
registered with the reaper), with the environment known in advance (the agent's,
``OMP_NUM_THREADS``, ``LOCAL_RANK``...), forked from the node's one template
(``warm_template``), which imported the configured modules (``--warm-start-modules``)
once, and blocks on a pipe. When the next
group starts, the agent hands each spare its argv and complete environment
(rank-specific variables included) and the spare runs the script as
``python script.py`` / ``python -m module`` would (see ``_warm_child.py``).

A spare is used only when nothing the cold worker would read at interpreter
start differs: same argv, and the same environment apart from
:data:`ROUND_KEYS`; otherwise it is discarded and the worker starts cold.
``--no-python`` workers cannot be warmed (ignored with a log line).

A spare for function workers (``--run-path``, ``elastic_launch`` of a callable)
holds a locked file from its start (``prepare(lock_dir=...)``); the handoff renames
it over its rank's file of the attempt's return barrier
(:mod:`elaunch.procs.return_barrier`).

No torch import here: the agent imports this module.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from . import return_barrier
from ._warm_child import IMPORT_NICE
from .helper_process import end
from .spawn import become_subreaper, popen_worker
from .warm_template import CHILD, FORK_TIMEOUT, IMPORT_WAIT, Template, handoff_pipe

if TYPE_CHECKING:
    from .forked import ForkedProcess
    from .logs import AttemptLogs
    from .reaper import Reaper

log = logging.getLogger(__name__)


#: A spare's variable naming the hook (``module:function``) it calls while it waits, with a wait in
#: seconds: a feature's preparation of the worker the spare becomes (the agent names the checkpoint
#: feature's slot pre-mapping). Only the spare's own environment has it: the handoff replaces that
#: environment with the worker's. ``_warm_child.py`` repeats the name.
WARM_HOOK_ENV = "ELAUNCH_WARM_HOOK"
#: Worker variables that may change from one round to the next: set only at handoff.
ROUND_KEYS = frozenset(
    {
        "RANK",
        "GROUP_RANK",
        "ROLE_RANK",
        "WORLD_SIZE",
        "GROUP_WORLD_SIZE",
        "ROLE_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
        "TORCHELASTIC_RESTART_COUNT",
        "TORCHELASTIC_USE_AGENT_STORE",
        "TORCHELASTIC_ERROR_FILE",
        "ELAUNCH_CHECKPOINT_RESTORE",  # the round's restore plan (checkpoint.keeper)
        "ELAUNCH_CHECKPOINT_STEP",
        return_barrier.ENV,  # the attempt's lock file and descriptor
    }
)
#: Interpreter options a warmable worker argv may carry before its script (``build_cmd``'s).
_PY_FLAGS = ("-u",)


@dataclass(frozen=True)
class WarmTarget:
    """What a python worker argv runs, as the spare needs it.

    Attributes:
        python: the interpreter (``argv[0]``).
        flags: interpreter options before the script (``("-u",)``).
        mode: ``"script"`` or ``"module"``.
        target: the script path as given, or the module name.
        args: the script's arguments.
        path0: the cold worker's ``sys.path[0]``: the script's directory (symlinks of the
            file resolved, as CPython does), or the working directory for ``-m``.
    """

    python: str
    flags: tuple[str, ...]
    mode: str
    target: str
    args: tuple[str, ...]
    path0: str


def parse_worker_cmd(cmd: list[str] | tuple[str, ...], cwd: str | None = None) -> WarmTarget | None:
    """Return the WarmTarget of a ``python [-u] script|-m module args`` argv, or None.

    None means the argv cannot be warmed (``--no-python``, unknown interpreter options, a script that is a
    directory or a zip file).
    """
    cmd = list(cmd)
    if len(cmd) < 2 or not os.path.basename(cmd[0]).startswith("python"):
        return None
    i = 1
    while i < len(cmd) and cmd[i] in _PY_FLAGS:
        i += 1
    flags = tuple(cmd[1:i])
    cwd = cwd or os.getcwd()
    if i + 1 < len(cmd) and cmd[i] == "-m":
        return WarmTarget(cmd[0], flags, "module", cmd[i + 1], tuple(cmd[i + 2 :]), cwd)
    if i < len(cmd) and not cmd[i].startswith("-"):
        path = os.path.join(cwd, cmd[i])
        for _ in range(40):  # CPython resolves the script's own symlinks for sys.path[0]
            if not os.path.islink(path):
                break
            path = os.path.join(os.path.dirname(path), os.readlink(path))
        if os.path.isdir(path) or (os.path.isfile(path) and zipfile.is_zipfile(path)):
            return None  # a directory or zip file with __main__.py: a spare runs source files only
        return WarmTarget(cmd[0], flags, "script", cmd[i], tuple(cmd[i + 1 :]), os.path.dirname(path))
    return None


def encode_handoff(target: WarmTarget, argv: list[str], env: Mapping[str, str]) -> bytes:
    """Encode one handoff for ``_warm_child.py`` (NUL-separated, file-system encoding)."""
    fields = [target.mode, target.target, str(len(target.args)), *target.args, str(len(argv)), *argv]
    for key, value in env.items():
        fields += [key, value]
    return b"\0".join(os.fsencode(f) for f in fields)


def spawn_env(env: Mapping[str, str]) -> dict[str, str]:
    """Return the part of a worker's environment known before its round: all but ROUND_KEYS."""
    return {k: v for k, v in env.items() if k not in ROUND_KEYS}


def _shared_env(envs: Mapping[int, Mapping[str, str]]) -> dict[str, str]:
    """The variables every local rank's pre-round environment has with the same value: the node's template
    imports with these; each spare it forks is given the rest of its own (``LOCAL_RANK``...) with its request."""
    first, *rest = envs.values()
    return {k: v for k, v in first.items() if all(e.get(k) == v for e in rest)}


class _Spare:
    """A spare: ``proc`` None while its template has not forked it yet (``template``, the request's
    ``ticket``); ``lock`` the path of the barrier file it holds (``return_barrier.spare_lock``), None if
    it holds none."""

    def __init__(self, proc: "subprocess.Popen | ForkedProcess | None", wfd: int, cmd: list[str],
                 env: dict[str, str], target: WarmTarget, template: Template | None = None,
                 lock: str | None = None, ticket: int = -1):
        self.proc, self.wfd, self.cmd, self.env, self.target = proc, wfd, cmd, env, target
        self.template, self.ticket = template, ticket
        self.lock = lock

    def close_pipe(self) -> None:
        if self.wfd >= 0:
            os.close(self.wfd)
            self.wfd = -1

    def drop_lock(self) -> None:
        """Remove the file of a spare that will not run a worker (its lock goes with the process)."""
        _remove_lock(self.lock)
        self.lock = None


def _remove_lock(path: str | None) -> None:
    """Remove a spare's barrier file (``_new_lock``'s path; None: there is none)."""
    if path is not None:
        try:
            os.unlink(path)
        except OSError:
            pass


def _new_lock(lock_dir: str | None) -> tuple[int | None, str | None]:
    """A locked file for a spare in ``lock_dir`` (``(fd, path)``), or ``(None, None)`` without one.

    Raises:
        OSError: it cannot be created.
    """
    return return_barrier.spare_lock(lock_dir) if lock_dir is not None else (None, None)


class WarmPool:
    """One attempt's worth of warm spares, prepared while the current attempt runs.

    One helper of the run's supervisor (``elaunch.supervision``, tier ``SPARES``): its templates and
    spares are stopped together by :meth:`close`, and a worker forked from the agent closes the
    descriptors :meth:`private_fds` names.

    Use from the agent's main thread (``PR_SET_PDEATHSIG`` follows the starting thread).

    Args:
        modules: modules each spare imports before it waits (e.g. ``("torch",)``).
        reaper: watchdog that kills the spares if the agent is killed, or None.
        hook: ``module:function`` a spare calls while it waits (:data:`WARM_HOOK_ENV`), or None. It is
            in the spares' own environment only: the worker a spare becomes, like a cold one, never sees it.
    """

    def __init__(self, modules: tuple[str, ...], reaper: "Reaper | None" = None, hook: str | None = None) -> None:
        self._modules = tuple(modules)
        self._reaper = reaper
        self._extra = {WARM_HOOK_ENV: hook} if hook else {}  # the spares' own variables
        self._attempt: int | None = None
        self._logs: "AttemptLogs | None" = None
        self._spares: dict[int, _Spare] = {}
        self._template: Template | None = None  # the node's template: it forks every local rank's spares
        self._no_template = False  # True once a template could not fork: spares start as interpreters
        self._warned = False
        self.name = "warm pool"
        self.enabled = True  # False once the workers turned out not to be warmable
        self.used = 0  # spares handed a worker so far (for tests and logs)
        self._handed = 0  # spares of the prepared attempt handed a worker so far

    def logs_for(self, attempt: int) -> "AttemptLogs | None":
        """Return the log destinations the spares of ``attempt`` write to, or None if none are ready and
        none was handed a worker before the attempt (``WorkerLauncher.prestart``: its files must stay)."""
        return self._logs if self._attempt == attempt and (self._spares or self._handed) else None

    def prepare(
        self, attempt: int, logs: "AttemptLogs", cmds: Mapping[int, list[str]], envs: Mapping[int, Mapping[str, str]],
        nice: int = IMPORT_NICE, lock_dir: str | None = None,
    ) -> int:
        """Start one spare per local rank for ``attempt``, replacing any earlier ones.

        Each spare is asked of the node's template (``warm_template``): forked at once where it is
        ready, else once it imported. A template starts where none serves (one for every local rank:
        the modules are imported once per node, not once per rank); where a template could not fork,
        an interpreter is started that imports the modules.

        Args:
            attempt: the attempt number the spares will serve.
            logs: that attempt's destinations (``RunLogDir.attempt``); spares write there.
            cmds, envs: the current attempt's argv and environment per local rank; the
                spares get ``spawn_env(env)``.
            nice: the nice value of the importing thread: :data:`IMPORT_NICE`
                (idle CPU only) while a group runs, 0 before the first one.
            lock_dir: the workers wait for their siblings (``return_barrier``): each
                spare holds a locked file made here from its start. None: they do not.

        Returns:
            The number of spares started (0 when the workers cannot be warmed).
        """
        self.discard()
        self._attempt, self._logs, self._handed = attempt, logs, 0
        spawned = {lr: spawn_env(env) for lr, env in envs.items()}
        shared = _shared_env(spawned)
        for lr in sorted(cmds):
            target = parse_worker_cmd(cmds[lr])
            if target is None:
                if not self._warned:
                    log.warning("--warm-start does not apply to %s; workers start cold", cmds[lr][0])
                    self._warned = True
                self.enabled = False
                break
            env = spawned[lr]
            try:
                spare = self._fork(lr, cmds[lr], env, shared, target, logs, nice, lock_dir)
                if spare is None:
                    spare = self._spawn(lr, cmds[lr], env, target, logs, nice, lock_dir)
            except OSError as exc:
                log.warning("could not start a warm spare for local rank %d: %s", lr, exc)
                break
            self._spares[lr] = spare
        if self._reaper is not None and self._spares:
            self._reaper.watch(s.proc.pid for s in self._spares.values() if s.proc is not None)
        if not self._spares and logs.dir != os.devnull:
            shutil.rmtree(logs.dir, ignore_errors=True)  # made for spares that did not start
        log.info("warm spares for attempt %d: %s", attempt,
                 {lr: s.proc.pid if s.proc is not None else "forked once its template imported"
                  for lr, s in self._spares.items()})
        return len(self._spares)

    def _fork(self, lr: int, cmd: list[str], env: dict[str, str], shared: dict[str, str], target: WarmTarget,
              logs: "AttemptLogs", nice: int, lock_dir: str | None = None) -> _Spare | None:
        """A spare of ``lr`` asked of the node's template (forked now if it is ready), or None; a template
        starts where none serves, importing at ``nice`` (the spare then forks once it imported). ``shared``: the
        pre-round environment every local rank has (:func:`_shared_env`), the template's own."""
        tmpl = self._template
        if tmpl is not None and not tmpl.usable():  # it refused to fork, failed or died
            self._retire()
            return None
        if tmpl is not None and (tmpl.cmd != cmd or tmpl.env != shared):
            self._end_template()  # the workers changed: it serves no more
            tmpl = None
        if tmpl is None:
            if self._no_template or self._reaper is None or not become_subreaper():
                return None
            tmpl = self._template = Template.start([target.python, *target.flags], target.path0,
                                                   self._modules, cmd, shared, nice, self._extra)
            self._reaper.watch([tmpl.proc.pid])
        lock_fd, lock = _new_lock(lock_dir)
        try:
            own = {k: v for k, v in env.items() if shared.get(k) != v}  # LOCAL_RANK...: the spare's own
            asked = tmpl.request(logs.stdout.get(lr), logs.stderr.get(lr), lock_fd, own)
        finally:
            if lock_fd is not None:
                os.close(lock_fd)  # the template holds it now (or it failed: the lock goes)
        if asked is None:
            _remove_lock(lock)
            return None
        wfd, ticket = asked
        spare = _Spare(None, wfd, cmd, env, target, tmpl, lock, ticket)
        if tmpl.ready() and not self._collect(spare, FORK_TIMEOUT):
            self._retire()
            return None
        return spare

    def _retire(self) -> None:
        """End the template that cannot fork, with one warning; spares start as interpreters from now on."""
        if self._template is None:
            return
        log.warning("the warm template %d cannot fork spares (a module it imported starts a thread or "
                    "initializes CUDA, or it failed); spares start as interpreters", self._template.proc.pid)
        self._end_template()
        self._no_template = True

    def _collect(self, spare: _Spare, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for a spare asked of a template to be forked; False if it was not."""
        if spare.proc is None:
            spare.proc = spare.template.collect(spare.ticket, timeout)
            if spare.proc is None:
                spare.close_pipe()
                spare.drop_lock()
                return False
            if self._reaper is not None:
                self._reaper.watch([spare.proc.pid])
        return True

    def _spawn(self, lr: int, cmd: list[str], env: dict[str, str], target: WarmTarget, logs: "AttemptLogs",
               nice: int, lock_dir: str | None = None) -> _Spare:
        """A spare started as a new interpreter that imports the modules (at ``nice``), holding a
        lock made in ``lock_dir`` (passed as its last argument) when that is not None.

        Raises:
            OSError: it could not be started.
        """
        lock_fd, lock = _new_lock(lock_dir)
        rfd, wfd = handoff_pipe()
        try:
            argv = [target.python, *target.flags, CHILD, str(rfd), target.path0, ",".join(self._modules), str(nice)]
            fds = (rfd,) if lock_fd is None else (rfd, lock_fd)
            proc = popen_worker(argv + [str(fd) for fd in fds[1:]], {**env, **self._extra}, logs.stdout.get(lr),
                                logs.stderr.get(lr), pass_fds=fds)
        except OSError:
            os.close(wfd)
            _remove_lock(lock)
            raise
        finally:
            os.close(rfd)
            if lock_fd is not None:
                os.close(lock_fd)  # the spare holds it now
        return _Spare(proc, wfd, cmd, env, target, lock=lock)

    def ready(self, local_rank: int) -> bool:
        """True when :meth:`handoff` of ``local_rank`` would not wait: its spare runs, or its template's
        fork of it has been answered. Never blocks."""
        spare = self._spares.get(local_rank)
        if spare is None:
            return False
        if spare.proc is None:
            return spare.template is not None and spare.template.answered(spare.ticket)
        return spare.proc.poll() is None

    def handoff(self, local_rank: int, cmd: list[str], env: Mapping[str, str],
                extra_env: Mapping[str, str] | None = None) -> subprocess.Popen | None:
        """Give the worker ``(cmd, env)`` to the spare of ``local_rank``; return its Popen, or None.

        None (start the worker cold) when there is no spare, it died, or the worker's
        argv or pre-round environment differs from what the spare was started with,
        or the worker waits for its siblings and the spare holds no lock. Once the
        handoff is written, the spare's locked file replaces the rank's file of the
        attempt's return barrier. Usable as ``WorkerProcesses.start(adopt=...)``.

        ``extra_env``: variables handed over besides ``env`` and left out of the comparison (in-process
        restart's mark on a replacement started before its round, ``elaunch.inprocess.wire.PRESTART_ENV``).
        """
        spare = self._spares.pop(local_rank, None)
        if spare is None:
            return None
        now = spawn_env(env)
        rank_file = return_barrier.target(env)
        if rank_file is not None and spare.lock is None:
            log.info("local rank %d: the spare holds no barrier lock; starting cold", local_rank)
            self._kill(spare)
            return None
        if spare.cmd != list(cmd) or spare.env != now:
            changed = sorted(k for k in spare.env.keys() | now.keys() if spare.env.get(k) != now.get(k))
            log.info("local rank %d: %s changed since the spare started; starting cold", local_rank,
                     "argv" if spare.cmd != list(cmd) else f"environment ({', '.join(changed)})")
            self._kill(spare)
            return None
        if not self._collect(spare, IMPORT_WAIT):
            log.warning("local rank %d: the warm template did not fork a spare (it cannot, or not within %.0f s); "
                        "starting cold", local_rank, IMPORT_WAIT)
            return None
        data = encode_handoff(spare.target, list(cmd), {**env, **(extra_env or {})})
        try:
            if spare.proc.poll() is not None:
                raise BrokenPipeError(f"spare exited with {spare.proc.returncode}")
            view = memoryview(data)
            while view:
                view = view[os.write(spare.wfd, view) :]
        except OSError as exc:
            log.warning("local rank %d: warm spare %d unusable (%s); starting cold", local_rank, spare.proc.pid, exc)
            self._kill(spare)
            return None
        spare.close_pipe()
        if rank_file is not None:  # the spare's lock, held since it started, is the rank's from now on
            try:
                os.replace(spare.lock, rank_file)
            except OSError as exc:
                log.warning("local rank %d: warm spare %d's barrier lock cannot be placed (%s); starting cold",
                            local_rank, spare.proc.pid, exc)
                self._kill(spare)
                return None
            spare.lock = None
        spare.drop_lock()  # a lock the worker does not use
        self.used += 1
        self._handed += 1
        return spare.proc

    def discard(self) -> None:
        """Kill and reap every spare not handed a worker (call once the attempt started)."""
        spares, self._spares = list(self._spares.values()), {}
        for spare in spares:
            self._kill(spare)
        self._logs = self._attempt = None

    def close(self) -> None:
        """Kill the spares and the templates; if no spare was used, remove the log directory made
        for them. Idempotent."""
        logs = self._logs if self._spares else None
        self.discard()
        if self._template is not None:
            self._end_template()
        if logs is not None and logs.dir != os.devnull:
            shutil.rmtree(logs.dir, ignore_errors=True)

    def check(self) -> bool:
        """Nothing to restart: a spare that died is found at its handoff and its worker starts cold."""
        return False

    def private_fds(self) -> tuple[int, ...]:
        """Descriptors a worker forked from the agent must close: the spares' handoff pipes, the templates' channels."""
        fds = [s.wfd for s in self._spares.values() if s.wfd >= 0]
        if self._template is not None:
            fds.extend(self._template.private_fds())
        return tuple(fds)

    def pids(self) -> list[int]:
        """Return the pids of the spares waiting for a worker (not those a template has yet to fork)."""
        return [s.proc.pid for s in self._spares.values() if s.proc is not None]

    def _end_template(self) -> None:
        tmpl, self._template = self._template, None
        tmpl.close()
        if self._reaper is not None:
            self._reaper.forget([tmpl.proc.pid])

    def _kill(self, spare: _Spare) -> None:
        spare.close_pipe()
        spare.drop_lock()
        if spare.proc is None:  # not forked yet: its template reaps it once it is (or goes first)
            spare.template.drop(spare.ticket)
            return
        end(spare.proc)  # SIGKILL to its group, reaped
        if self._reaper is not None:
            self._reaper.forget([spare.proc.pid])
