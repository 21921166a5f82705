"""The per-node elastic agent: rendezvous, start, watch, restart.

Mirrors torch's ``LocalElasticAgent`` (``torch.distributed.elastic.agent.server``):
one WorkerGroup per node, the whole group restarted on any failure (counted
against ``--max-restarts``) or when nodes wait to join (not counted). The
decisions live in ``decide.py``; this module observes and applies them.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import os
import signal
import socket
import time
from collections.abc import Mapping

from elaunch.agent.decide import Step, Verdict, judge, next_step
from elaunch.agent.env import EnvOptions, worker_env
from elaunch.agent.ranks import assign_ranks
from elaunch.procs import AttemptLogs, LogsSpec, WorkerLauncher, WorkerProcesses, line_prefix
from elaunch.rendezvous.api import RendezvousError, RendezvousHandler, RendezvousInfo
from elaunch.spec import ProcessFailure, RunResult, WorkerGroup, WorkerSpec, WorkerState

log = logging.getLogger("elaunch.agent")

#: Seconds a finished node waits for the others before it exits (torchrun: 300).
DEFAULT_EXIT_BARRIER_TIMEOUT = 300.0


class SignalException(Exception):
    """Raised in the agent's main thread when it receives a handled signal.

    Attributes:
        sigval: the signal number received.
    """

    def __init__(self, sigval: int) -> None:
        super().__init__(f"agent received {signal.Signals(sigval).name}")
        self.sigval = sigval


class ElasticAgent:
    """Runs one node's WorkerGroup until it succeeds, fails for good, or a signal.

    Args:
        spec: what to run.
        rdzv: the rendezvous handler (the agent knows only its interface).
        logs: where worker output goes (``--log-dir``, ``-r``, ``-t``, filters).
        env_opts: per-job worker environment inputs.
        shutdown_timeout: seconds between the stop signal and SIGKILL when stopping
            workers (``--shutdown-timeout``).
        exit_barrier_timeout: seconds a finished node waits for the others.
        base_env: environment the workers inherit; defaults to ``os.environ``.
        hostname: name shown in failure summaries; defaults to ``socket.gethostname()``.
        warm_modules: ``--warm-start``: while a group runs, keep one spare interpreter per
            local rank with these modules imported, to run the next attempt's workers
            (``elaunch.procs.warm``); None (default) starts every worker cold, as torchrun.
    """

    def __init__(
        self,
        spec: WorkerSpec,
        rdzv: RendezvousHandler,
        logs: LogsSpec,
        env_opts: EnvOptions,
        *,
        shutdown_timeout: float = 30.0,
        exit_barrier_timeout: float = DEFAULT_EXIT_BARRIER_TIMEOUT,
        base_env: Mapping[str, str] | None = None,
        hostname: str | None = None,
        warm_modules: tuple[str, ...] | None = None,
    ) -> None:
        self._spec = spec
        self._rdzv = rdzv
        self._logs = logs
        self._env_opts = env_opts
        self._shutdown_timeout = shutdown_timeout
        self._exit_barrier_timeout = exit_barrier_timeout
        self._base_env = dict(os.environ if base_env is None else base_env)
        self._hostname = hostname or socket.gethostname()
        self._launcher = WorkerLauncher(logs, env_opts.run_id, warm_modules)
        self._errors_loaded = False
        self._procs: WorkerProcesses | None = None
        self._group: WorkerGroup | None = None
        self._attempt_logs: AttemptLogs | None = None

    @property
    def log_root(self) -> str | None:
        """The job-level log directory, once ``run()`` created it."""
        return self._launcher.log_root

    def run(self) -> RunResult:
        """Run to completion.

        Returns:
            RunResult: SUCCEEDED, or FAILED with the last round's failures.

        Raises:
            SignalException: a handled signal arrived; workers were sent that signal
                and stopped (SIGKILL after ``shutdown_timeout``) before this is raised.
            RendezvousError: the rendezvous failed (timeout, closed, unreachable).
        """
        self._launcher.open()
        try:
            return self._invoke_run()
        except SignalException as exc:
            log.warning("received %s, stopping workers", signal.Signals(exc.sigval).name)
            self._launcher.no_more_attempts()
            self._stop_workers(exc.sigval)
            raise
        finally:
            self._launcher.no_more_attempts()
            self._stop_workers(signal.SIGKILL, grace=0.0)
            self._launcher.close()

    def _invoke_run(self) -> RunResult:
        restarts = 0
        attempt = 0
        while True:
            info = self._rdzv.next_rendezvous()
            group = self._start_workers(info, restarts, attempt)
            attempt += 1
            verdict = self._monitor()
            step = next_step(verdict, restarts, self._spec.max_restarts)
            if step in (Step.FINISH_OK, Step.FINISH_FAILED):
                self._launcher.no_more_attempts()
            if step is Step.FINISH_OK:
                # HEALTHY -> SUCCEEDED: every worker exited 0
                group.state = WorkerState.SUCCEEDED
                self._procs.close()
                self._launcher.remove_log_dir_if_temporary()
                self._rdzv.exit_barrier(self._exit_barrier_timeout)
                return RunResult(WorkerState.SUCCEEDED, restarts=restarts)
            # which workers failed is fixed now; their error files are read once the rest
            # are stopped, so a restart does not wait for that
            exited = (self._procs.poll(), self._procs.exit_times()) if verdict is Verdict.FAILED else None
            self._stop_workers(signal.SIGTERM)
            failures = self._failures(group, *exited) if exited else {}
            if step is Step.FINISH_FAILED:
                # HEALTHY -> FAILED: a worker failed and no restart is left
                group.state = WorkerState.FAILED
                return RunResult(WorkerState.FAILED, failures=failures, restarts=restarts)
            # HEALTHY -> STOPPED: restart after a failure (counted) or a membership change
            group.state = WorkerState.STOPPED
            if step is Step.RESTART:
                restarts += 1
                from elaunch.errors import root_cause

                first = root_cause(failures)
                log.warning(
                    "worker group failed (rank %d exitcode %d%s); restart %d/%d",
                    first.global_rank,
                    first.exitcode,
                    f" {first.signal_name}" if first.signal_name else "",
                    restarts,
                    self._spec.max_restarts,
                )

    def _start_workers(self, info: RendezvousInfo, restarts: int, attempt: int) -> WorkerGroup:
        spec = self._spec
        workers = assign_ranks(info.nodes, info.rank, info.world_size, spec.role, spec.local_world_size)
        group = WorkerGroup(
            spec=spec,
            workers=workers,
            round=info.round,
            group_rank=info.rank,
            group_world_size=info.world_size,
            master_addr=spec.master_addr or info.master_addr,
            master_port=spec.master_port or info.master_port,
        )
        opts = self._env_opts
        if opts.use_agent_store != info.use_agent_store:
            opts = dataclasses.replace(opts, use_agent_store=info.use_agent_store)
        logs = self._launcher.attempt_logs(attempt, spec.local_world_size)
        cmds, envs, prefixes = {}, {}, {}
        for w in workers:
            lr = w.local_rank
            cmds[lr] = spec.worker_cmd(lr)
            envs[lr] = worker_env(self._base_env, w, group, restarts, logs.error_file[lr], opts)
            prefixes[lr] = line_prefix(self._logs.line_prefix_template, spec.role, w.global_rank, lr)
        may_follow = restarts < spec.max_restarts or self._rdzv.can_reform()
        self._procs = self._launcher.start(attempt, logs, cmds, envs, prefixes, another_may_follow=may_follow)
        self._attempt_logs = logs
        for w in workers:
            w.pid = self._procs.pids[w.local_rank]
        # INIT -> HEALTHY: workers started
        group.state = WorkerState.HEALTHY
        self._group = group
        log.info(
            "round %d: node %d/%d started ranks %d-%d of %d (master %s:%s)",
            info.round,
            info.rank,
            info.world_size,
            workers[0].global_rank,
            workers[-1].global_rank,
            workers[0].world_size,
            group.master_addr,
            group.master_port,
        )
        return group

    def _monitor(self) -> Verdict:
        """Wait until the group is no longer RUNNING; child exits wake this at once."""
        interval = self._spec.monitor_interval
        while True:
            codes = self._procs.poll()
            verdict = judge(codes, 0)
            if verdict is Verdict.FAILED:
                new = self._new_nodes()
                verdict = judge(codes, 0, new)
                if verdict is Verdict.MEMBERSHIP_CHANGE:
                    log.warning(
                        "workers exited (%s) while %d new node(s) joined; re-forming the group"
                        " (a scale-up, not counted as a restart)", _describe_exits(codes), new,
                    )
            elif verdict is Verdict.RUNNING:
                waiting, lost = self._rdzv.num_nodes_waiting(), self._rdzv.num_nodes_lost()
                verdict = judge(codes, waiting + lost)
                if verdict is Verdict.MEMBERSHIP_CHANGE:
                    log.warning(
                        "membership changed (%d node(s) waiting to join, %d lost); re-forming the group"
                        " (not counted as a restart)", waiting, lost,
                    )
            if verdict is not Verdict.RUNNING:
                return verdict
            self._procs.wait(interval)
            if not self._errors_loaded:
                # needed at the next failure: load it now that the workers are up, not on the restart's clock
                importlib.import_module("elaunch.errors")
                self._errors_loaded = True

    def _new_nodes(self) -> int:
        """``num_nodes_new()`` of the rendezvous; 0 when it cannot be read (the failure then counts)."""
        try:
            return self._rdzv.num_nodes_new()
        except RendezvousError as exc:
            log.warning("could not check for new nodes after a worker failure: %s", exc)
            return 0

    def _failures(
        self, group: WorkerGroup, codes: dict[int, int | None], times: dict[int, float]
    ) -> dict[int, ProcessFailure]:
        from elaunch.errors import read_error_file, tail_file  # only on failure: keeps start-up light

        out: dict[int, ProcessFailure] = {}
        final = self._procs.poll()  # after the stop: what the survivors of the check became
        for w in group.workers:
            code = codes.get(w.local_rank)
            error_file = self._attempt_logs.error_file[w.local_rank]
            data = read_error_file(error_file)
            if code is None or code == 0:
                # Still running when the failure was seen. If it wrote an error file it
                # failed on its own (often first: a peer then crashed on its closed
                # socket before this one finished exiting), so it is reported too.
                if not data or data.get("unreadable"):
                    continue
                code = final.get(w.local_rank) or 1
            stderr_path = self._attempt_logs.stderr.get(w.local_rank)
            out[w.global_rank] = ProcessFailure(
                local_rank=w.local_rank,
                global_rank=w.global_rank,
                pid=w.pid or -1,
                exitcode=code,
                timestamp=times.get(w.local_rank, time.time()),
                hostname=self._hostname,
                error_file=error_file,
                error_data=data,
                stderr_tail=tail_file(stderr_path) if data is None or data.get("unreadable") else "",
                error_time=_mtime(error_file) if data else None,
            )
        return out

    def _stop_workers(self, sig: int, grace: float | None = None) -> None:
        if self._procs is None:
            return
        self._procs.stop(sig, self._shutdown_timeout if grace is None else grace)
        self._procs.close()


def _mtime(path: str) -> float | None:
    """Return ``path``'s modification time in seconds (float), None if it is gone."""
    try:
        return os.stat(path).st_mtime_ns / 1e9
    except OSError:
        return None


def _describe_exits(codes: Mapping[int, int | None]) -> str:
    """``"local rank 0: exitcode 1, local rank 1: SIGTERM"`` for the workers that failed."""
    parts = []
    for lr, code in sorted(codes.items()):
        if code is None or code == 0:
            continue
        if code < 0:
            try:
                what = signal.Signals(-code).name
            except ValueError:
                what = f"signal {-code}"
        else:
            what = f"exitcode {code}"
        parts.append(f"local rank {lr}: {what}")
    return ", ".join(parts)
