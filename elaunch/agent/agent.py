"""The per-node elastic agent: rendezvous, start, watch, restart.

Mirrors torch's ``LocalElasticAgent`` (``torch.distributed.elastic.agent.server``):
one WorkerGroup per node, the whole group restarted on any failure (counted
against ``--max-restarts``) or when nodes wait to join (not counted). The
decisions live in ``decide.py``; this module observes and applies them.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import socket
import time
from collections.abc import Callable, Mapping

from elaunch.agent.decide import Step, Verdict
from elaunch.agent.events import EVENTS_FILE, AgentEvents, event_echo
from elaunch.agent.failures import collect_failures, describe_exits, signal_name, with_root
from elaunch.agent.hang_watchdog import HangWatchdog
from elaunch.agent.published import agent_record, publish
from elaunch.agent.job import JobView, local_record
from elaunch.agent.monitor import GroupMonitor, failed_elsewhere
from elaunch.agent.watchdog import Alarm, Watchdog
from elaunch.agent.env import EnvOptions, worker_env
from elaunch.agent.ranks import assign_ranks
from elaunch.agent.stuck import UninterruptibleWatch, timeout_from_env
from elaunch.procs import AttemptLogs, LogsSpec, WorkerLauncher, WorkerProcesses, line_prefix
from elaunch.rendezvous.api import (
    FailureRecord,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousJobFailedError,
)
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
        hang_timeout: ``--hang-timeout``: seconds without ``elaunch.progress()`` (after a
            first call) that make a worker hung; 0 (default) = off.
        fork_target: run each worker as a fork of this process calling
            ``fork_target(local_rank)`` (``elastic_launch`` of a function with
            ``start_method="fork"``; see ``WorkerLauncher``); None: exec ``spec.cmd``.
        event_log_handler: ``--event-log-handler``: where a copy of each event of
            ``events.jsonl`` goes (``elaunch.agent.events.event_echo``; "null": none).

    Raises:
        ValueError: ``event_log_handler`` is not a torch event handler name.
    """

    def __init__(
        self,
        spec: WorkerSpec,
        rdzv: RendezvousHandler,
        logs: LogsSpec,
        env_opts: EnvOptions,
        *,
        shutdown_timeout: float,
        exit_barrier_timeout: float = DEFAULT_EXIT_BARRIER_TIMEOUT,
        base_env: Mapping[str, str] | None = None,
        hostname: str | None = None,
        warm_modules: tuple[str, ...] | None = None,
        hang_timeout: float = 0.0,
        fork_target: Callable[[int], int] | None = None,
        event_log_handler: str = "null",
    ) -> None:
        self._spec = spec
        self._rdzv = rdzv
        self._logs = logs
        self._env_opts = env_opts
        self._shutdown_timeout = shutdown_timeout
        self._exit_barrier_timeout = exit_barrier_timeout
        self._base_env = dict(os.environ if base_env is None else base_env)
        self._hostname = hostname or socket.gethostname()
        self._launcher = WorkerLauncher(logs, env_opts.run_id, warm_modules, fork_target=fork_target)
        self._procs: WorkerProcesses | None = None
        self._exits_told: WorkerProcesses | None = None  # the procs whose exits are in the event log
        self._group: WorkerGroup | None = None
        self._attempt_logs: AttemptLogs | None = None
        self._job = JobView(rdzv, spec.max_restarts, spec.monitor_interval)
        self._hang_timeout = hang_timeout
        stuck_after = timeout_from_env(self._base_env)
        # the D-state watch; run() adds the file timer's and the hang watchdog (they create files)
        self._watchdogs: list[Watchdog] = [UninterruptibleWatch(stuck_after, hostname=self._hostname)] if stuck_after else []
        self._monitor: GroupMonitor | None = None  # made in run(), with the watchdogs and the event log
        self._echo = event_echo(event_log_handler)
        self._events = AgentEvents(None, "", self._hostname, spec.max_restarts)  # run() opens the real one

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
        root = self.log_root
        node = self._rdzv.job_channel().node_id or f"{self._hostname}_{os.getpid()}"
        self._events = AgentEvents(os.path.join(root, EVENTS_FILE) if root and root != os.devnull else None,
                                   node, self._hostname, self._spec.max_restarts, self._echo)
        self._watchdogs.append(HangWatchdog(self._hang_timeout, range(self._spec.local_world_size), self._rdzv,
                                            self._hostname))
        self._watchdogs[:0] = self._file_timer()
        self._monitor = GroupMonitor(self._rdzv, self._job, self._events, self._spec.monitor_interval,
                                     self._watchdogs)
        try:
            result = self._invoke_run()
            self._events.job_end(result)
            return result
        except SignalException as exc:
            log.warning("received %s, stopping workers", signal.Signals(exc.sigval).name)
            self._launcher.no_more_attempts()
            self._stop_workers(exc.sigval)
            self._events.job_end(sig=exc.sigval)
            raise
        except BaseException as exc:
            self._events.job_end(error=exc)
            raise
        finally:
            self._launcher.no_more_attempts()
            self._stop_workers(signal.SIGKILL, grace=0.0)
            self._launcher.close()
            for watchdog in self._watchdogs:
                watchdog.close()
            self._events.close()

    def forward_signal(self, sig: int) -> None:
        """Forward a notice (``--forward-signals``, e.g. Slurm's SIGUSR1) to every worker; keep running.

        Safe to call from a signal handler in the main thread.
        """
        procs = self._procs
        if procs is not None:
            procs.notify(sig)
        self._events.notice(sig)
        log.warning("received %s: forwarded to the workers (a notice; the job keeps running)", signal_name(-sig))

    def _file_timer(self) -> list[Watchdog]:
        """torch's hang guard: with ``TORCHELASTIC_ENABLE_FILE_TIMER=1``, a watchdog serving ``FileTimerClient`` scopes.

        Its ``env`` gives the workers the FIFO's path; without it a set
        ``TORCHELASTIC_TIMER_FILE`` reaches them with the rest of the environment, as under torch.
        """
        if "TORCHELASTIC_ENABLE_FILE_TIMER" not in self._base_env:
            return []  # the usual case: not even the module is loaded
        from elaunch.agent.file_timer import FileTimerWatchdog, file_timer_env

        enabled, path = file_timer_env(self._base_env)
        return [FileTimerWatchdog(path)] if enabled else []

    def _invoke_run(self) -> RunResult:
        restarts = 0  # the job's failure restarts so far (the rendezvous' count where it keeps one)
        attempt = 0
        announce: tuple[int, FailureRecord, int] | None = None  # a restart to log once the next round formed
        while True:
            self._events.rendezvous_joining()
            try:
                info = self._rdzv.next_rendezvous()
            except RendezvousJobFailedError as exc:
                # JOINING -> FAILED: another node declared the job failed while we joined
                self._launcher.no_more_attempts()
                return self._job.failed_elsewhere(exc.failure, restarts)
            self._events.rendezvous_complete(info, self._rdzv.job_channel().round_members)
            if announce is not None:
                # every node of the failed round recorded its report before this round formed:
                # the root cause read now is the job's final one, the same on every node
                self._announce_restart(*announce)
                announce = None
            if info.restart_count is not None:
                restarts = info.restart_count
            try:
                group = self._start_workers(info, restarts, attempt)
            except OSError as exc:
                # INIT -> FAILED: the workers cannot even start; no restart fixes that
                return self._unstartable(info, exc, restarts)
            attempt += 1
            verdict = self._monitor.watch(self._procs, group, self._attempt_logs, self.log_root)
            if verdict is Verdict.SUCCEEDED:
                return self._succeeded(group, restarts)
            # which workers failed is fixed now; their error files are read once the rest
            # are stopped, so a restart does not wait for that
            exited = (self._procs.poll(), self._procs.exit_times()) if verdict is Verdict.FAILED else None
            self._stop_workers(signal.SIGTERM)
            if verdict is Verdict.JOB_FAILED:
                # HEALTHY -> FAILED: the job failed on another node; it published the root cause
                group.state = WorkerState.FAILED
                self._launcher.no_more_attempts()
                return self._job.failed_elsewhere(self._job.state.failure, restarts)
            if verdict is Verdict.MEMBERSHIP_CHANGE:
                # HEALTHY -> STOPPED: re-form with the new membership (not counted)
                group.state = WorkerState.STOPPED
                self._reform_event(restarts)
                continue
            alarm = self._monitor.alarm or Alarm("", {})
            if not alarm.restart:
                # HEALTHY -> FAILED: e.g. a worker stuck in the kernel; a restart beside it would fight it
                return self._fail_at_once(info, alarm.reported(self._procs.poll()), restarts)
            failures = {**self._failures(group, *exited), **alarm.reported(self._procs.poll())}
            from elaunch.errors import root_cause

            first = failures.get(alarm.culprit) or root_cause(failures)
            record = local_record(first, info.round, hung=first.global_rank in alarm.failures,
                                  blocked=first.global_rank == alarm.culprit and alarm.blocked)
            step, restarts, root = self._job.count_failure(record, restarts)
            if step is Step.REJOIN:
                # HEALTHY -> STOPPED: the workers failed because a member node is gone (not counted)
                group.state = WorkerState.STOPPED
                lost = self._job.state.lost
                log.warning(
                    "membership changed (0 node(s) waiting to join, %d lost); re-forming the group"
                    " (not counted as a restart): the workers exited (%s) after node(s) %s stopped answering",
                    len(lost), describe_exits(exited[0]), ", ".join(lost),
                )
                self._events.restart(False, restarts, "node_lost", record)
                continue
            if step is Step.FINISH_FAILED:
                # HEALTHY -> FAILED: no restart is left for the job
                self._launcher.no_more_attempts()
                group.state = WorkerState.FAILED
                return RunResult(WorkerState.FAILED, failures=with_root(failures, root, self._job.state.node),
                                 restarts=restarts, root_rank=root.rank)
            # HEALTHY -> STOPPED: restart after a failure (counted once for the job)
            group.state = WorkerState.STOPPED
            announce = (info.round, root, restarts)
            if not self._job.state.node:  # no job state: this agent alone knows the root cause
                self._announce_restart(*announce)
                announce = None
            ended = self._job.sit_out_if_blamed(restarts)
            if ended is not None:
                # STOPPED -> SUCCEEDED/FAILED: the job ended while this node sat out
                self._launcher.no_more_attempts()
                return ended

    def _succeeded(self, group: WorkerGroup, restarts: int) -> RunResult:
        """HEALTHY -> SUCCEEDED: every worker exited 0; end the run and wait at the exit barrier."""
        self._launcher.no_more_attempts()
        group.state = WorkerState.SUCCEEDED
        self._stop_workers(signal.SIGKILL, grace=0.0)
        result = RunResult(WorkerState.SUCCEEDED, restarts=restarts,
                           global_ranks={w.local_rank: w.global_rank for w in group.workers})
        self._events.job_end(result)
        self._events.close()  # a temporary log directory goes now, events.jsonl with it
        self._launcher.remove_log_dir_if_temporary()
        self._rdzv.exit_barrier(self._exit_barrier_timeout)
        self._job.succeed()  # after the exit barrier: the nodes of the round are done
        return result

    def _reform_event(self, restarts: int) -> None:
        """The ``restart`` event of a re-form: the job's restart when the round failed on another node."""
        job = self._job.state
        if failed_elsewhere(job, self._group.round):  # the reporting node counts it: the job's count is known once re-formed
            self._events.restart_after_rendezvous(job.failure)
        else:
            self._events.restart(False, restarts, "membership")

    def _announce_restart(self, round: int, root: FailureRecord, restarts: int) -> None:
        """Log a counted restart with the job's root cause of ``round`` (as the rendezvous has it now)."""
        final = self._job.root_of(round)
        root = final if final is not None else root
        self._events.restart(True, restarts, "failure", root, failed_round=round)
        log.warning(
            "worker group failed (rank %d on %s, exitcode %d%s); restart %d/%d",
            root.rank, root.host, root.exitcode, f" {signal_name(root.exitcode)}" if root.exitcode < 0 else "",
            restarts, self._spec.max_restarts,
        )

    def _unstartable(self, info: RendezvousInfo, exc: OSError, restarts: int) -> RunResult:
        """The workers could not be started (e.g. no such program): the job fails at once."""
        failure = ProcessFailure(local_rank=0, global_rank=info.rank * self._spec.local_world_size, pid=-1,
                                 exitcode=1, timestamp=time.time(), hostname=self._hostname,
                                 detail=f"could not start the workers: {exc}")
        return self._fail_at_once(info, {failure.global_rank: failure}, restarts)

    def _fail_at_once(self, info: RendezvousInfo, failures: dict[int, ProcessFailure], restarts: int) -> RunResult:
        """A failure no restart can fix: declare the job failed with the first of ``failures`` as root cause."""
        self._launcher.no_more_attempts()
        first = min(failures.values(), key=lambda f: f.global_rank)
        root = self._job.fail(local_record(first, info.round))
        return RunResult(WorkerState.FAILED, failures=with_root(failures, root, self._job.state.node),
                         restarts=restarts, root_rank=root.rank)

    def _start_workers(self, info: RendezvousInfo, restarts: int, attempt: int) -> WorkerGroup:
        spec = self._spec
        workers = assign_ranks(info.nodes, info.rank, info.world_size, spec.role, spec.local_world_size)
        master_addr, master_port = info.master_addr, info.master_port
        if info.host_store:  # as torchrun's agent: every worker is a client of a store this agent hosts
            master_port = self._launcher.serve_store(master_addr, master_port)
        group = WorkerGroup(
            spec=spec,
            workers=workers,
            round=info.round,
            group_rank=info.rank,
            group_world_size=info.world_size,
            master_addr=master_addr,
            master_port=master_port,
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
            for watchdog in self._watchdogs:
                envs[lr].update(watchdog.env(lr))
            prefixes[lr] = line_prefix(self._logs.line_prefix_template, spec.role, w.global_rank, lr)
        for watchdog in self._watchdogs:
            watchdog.new_attempt(info.round)
        may_follow = restarts < spec.max_restarts or self._rdzv.can_reform
        self._procs = self._launcher.start(attempt, logs, cmds, envs, prefixes, another_may_follow=may_follow)
        self._attempt_logs = logs
        for w in workers:
            w.pid = self._procs.pids[w.local_rank]
        self._events.workers_started(attempt, workers, self._procs.pids, f"{group.master_addr}:{group.master_port}")
        # INIT -> HEALTHY: workers started
        group.state = WorkerState.HEALTHY
        self._group = group
        record = agent_record(info.round, [w.global_rank for w in workers], spec.max_restarts, restarts, spec.role,
                              self._hostname, self.log_root)
        publish(self._rdzv.job_channel(), "agent", record)
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

    def _failures(self, group: WorkerGroup, codes: dict[int, int | None],
                  times: dict[int, float]) -> dict[int, ProcessFailure]:
        return collect_failures(group.workers, codes, times, self._procs.poll(), self._attempt_logs,
                                self._hostname)

    def _stop_workers(self, sig: int, grace: float | None = None) -> None:
        procs = self._procs
        if procs is None or procs is self._exits_told:
            return
        before = procs.poll()
        procs.stop(sig, self._shutdown_timeout if grace is None else grace)
        procs.close()
        self._exits_told = procs
        self._events.workers_exited(self._group.workers, before, procs.poll(), procs.exit_times())
