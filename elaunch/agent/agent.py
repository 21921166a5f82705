"""The per-node elastic agent: rendezvous, start, watch, restart.

Mirrors torch's ``LocalElasticAgent`` (``torch.distributed.elastic.agent.server``):
one WorkerGroup per node, the whole group restarted on any failure (counted
against ``--max-restarts``) or when nodes wait to join (not counted). The
decisions live in ``decide.py`` (``next_step``, the one table), the restart budget
in ``job.py`` (``JobView``); this module observes and applies them: join, start,
watch, decide, act, with one small method per action.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from elaunch.agent.decide import Step, Verdict
from elaunch.agent.events import EVENTS_FILE, AgentEvents, event_echo
from elaunch.agent.failures import describe_exits, with_root
from elaunch.agent.node_check import NodeCheck, node_check_for
from elaunch.agent.notices import Notices
from elaunch.agent.progress_watch import ProgressWatchdog
from elaunch.agent.published import agent_record
from elaunch.agent.job import JobView, local_record
from elaunch.agent.monitor import GroupMonitor, failed_elsewhere
from elaunch.agent.stopped import Stopped, unstartable
from elaunch.agent.watchdog import Alarm, Watchdog
from elaunch.agent.watchdogs import HelperChecks, open_watchdogs
from elaunch.agent.env import EnvOptions
from elaunch.agent.group_start import GroupStarter
from elaunch.checkpoint.keeper import CheckpointKeeper
from elaunch.checkpoint.spare import HOOK as SPARE_HOOK
from elaunch.inprocess.restarts import InProcess, open_inprocess
from elaunch.procs import AttemptLogs, LogsSpec, WorkerLauncher, WorkerProcesses
from elaunch.supervision import SERVICES
from elaunch.rendezvous.job_channel import publish
from elaunch.rendezvous.contract import (
    FailureRecord,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousJobFailedError,
)
from elaunch.spec import RunResult, WorkerGroup, WorkerSpec, WorkerState, signal_name

if TYPE_CHECKING:
    from elaunch.config import LaunchConfig

log = logging.getLogger("elaunch.agent")

#: Seconds a finished node waits for the others before it exits (torchrun: 300).
DEFAULT_EXIT_BARRIER_TIMEOUT = 300.0


class SignalException(BaseException):
    """Raised in the agent's main thread when it receives a handled signal.

    A ``BaseException``, as ``KeyboardInterrupt`` is: the handler raises it wherever the main
    thread happens to be, and an ``except Exception`` there (a user's event handler, a
    best-effort exchange, an etcd watch's wait, a library's retry) must not take it for its own
    error and drop it (an agent SIGTERMed while it waited in an etcd rendezvous never stopped).
    The torch-compatible entry points (``elaunch.launcher``, ``elaunch.run``) raise torch's
    ``SignalException`` in its place, as torch's agent does.

    Its message is torch's (``"Process <pid> got signal: <signum>"``), so the launcher's error file
    reads as torchrun's (``SignalException: Process 7 got signal: 15``).

    Attributes:
        sigval: the signal number received.
    """

    def __init__(self, sigval: int) -> None:
        super().__init__(f"Process {os.getpid()} got signal: {int(sigval)}")
        self.sigval = sigval


class ElasticAgent:
    """Runs one node's WorkerGroup until it succeeds, fails for good, or a signal.

    Args:
        spec: what to run.
        rdzv: the rendezvous handler (the agent knows only its interface).
        logs: where worker output goes (``--log-dir``, ``-r``, ``-t``, filters).
        env_opts: per-job worker environment inputs.
        config: the launch's options; the agent applies ``max_restarts`` (the job's
            budget, see :class:`~elaunch.agent.job.JobView`), ``monitor_interval``
            (seconds), ``shutdown_timeout`` (seconds between the stop signal and SIGKILL
            when stopping workers), ``inprocess_timeout`` (seconds an interrupted survivor of an
            in-process restart has to say "ready"), the watchdogs' options (:mod:`elaunch.agent.watchdogs`),
            ``warm_start_modules`` (``--warm-start``: one spare interpreter per local
            rank with these imported runs the next attempt's workers; None: cold, as
            torchrun) and ``event_log_handler`` (where a copy of each event of
            ``events.jsonl`` goes, ``elaunch.agent.events.event_echo``; "null": none).
        exit_barrier_timeout: seconds a finished node waits for the others.
        base_env: environment the workers inherit; defaults to ``os.environ``.
        hostname: name shown in failure summaries; defaults to ``socket.gethostname()``.
        fork_target: run each worker as a fork of this process calling
            ``fork_target(local_rank)`` (``elastic_launch`` of a function with
            ``start_method="fork"``; see ``WorkerLauncher``); None: exec ``spec.cmd``.
        metrics: ``--metrics-port``'s serving ``elaunch.agent.metrics.AgentMetrics``
            (``run()`` has it watch the run's events and state), or None.
        supervisor: the launch's ``elaunch.supervision.Supervisor`` (the run's helpers join the
            launch's own on it; ``run()`` stops the run's at its end), or None for one of the run's own.

    Raises:
        ValueError: ``event_log_handler`` is not a torch event handler name.
    """

    def __init__(
        self,
        spec: WorkerSpec,
        rdzv: RendezvousHandler,
        logs: LogsSpec,
        env_opts: EnvOptions,
        config: LaunchConfig,
        *,
        exit_barrier_timeout: float = DEFAULT_EXIT_BARRIER_TIMEOUT,
        base_env: Mapping[str, str] | None = None,
        hostname: str | None = None,
        fork_target: Callable[[int], int] | None = None,
        metrics=None,
        supervisor=None,
    ) -> None:
        self._spec = spec
        self._rdzv = rdzv
        self._logs = logs
        self._env_opts = env_opts
        self._config = config
        self._exit_barrier_timeout = exit_barrier_timeout
        self._metrics = metrics
        self._base_env = dict(os.environ if base_env is None else base_env)
        self._hostname = hostname or socket.gethostname()
        self._launcher = WorkerLauncher(logs, env_opts.run_id, config.warm_start_modules, fork_target=fork_target,
                                        spare_hook=SPARE_HOOK, supervisor=supervisor)
        self._procs: WorkerProcesses | None = None
        self._exits_told: WorkerProcesses | None = None  # the procs whose exits are in the event log
        self._group: WorkerGroup | None = None
        self._attempt_logs: AttemptLogs | None = None
        self._job = JobView(rdzv, config.max_restarts, config.monitor_interval)  # owns the restart budget
        self._announce: tuple[int, FailureRecord] | None = None  # a restart to log once the next round formed
        self._watchdogs: list[Watchdog] = []  # made in run() (some create files): agent.watchdogs
        self._monitor: GroupMonitor | None = None  # made in run(), with the watchdogs and the event log
        self._starter: GroupStarter | None = None  # made in run(), with the watchdogs: makes and starts each group
        self._progress: ProgressWatchdog | None = None  # made in run(): the progress files, read for events
        self._echo = event_echo(config.event_log_handler)
        self._events = AgentEvents(None, "", self._hostname, self._job.max_restarts)  # run() opens the real one
        # in-memory checkpoints: the node directory, each round's restore, the persister and replica service
        self._keeper = CheckpointKeeper.for_launch(config, env_opts.run_id, rdzv.job_channel)
        self._node_check: NodeCheck | None = None  # --node-check; made in run() (its child needs the reaper)
        self._notices = Notices(self._forward)  # --forward-signals: the handler records, the monitor acts
        self._inproc = InProcess(None, self._events, config.inprocess_timeout)  # run() offers the channel
        self._fork_target = fork_target

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
                and stopped (SIGKILL after ``config.shutdown_timeout``) before this is raised.
            RendezvousError: the rendezvous failed (timeout, closed, unreachable).
        """
        self._launcher.open()
        root = self.log_root
        node = self._rdzv.job_channel().node_id or f"{self._hostname}_{os.getpid()}"
        self._events = AgentEvents(os.path.join(root, EVENTS_FILE) if root and root != os.devnull else None,
                                   node, self._hostname, self._job.max_restarts, self._echo)
        # the progress files exist whenever workers run (training/caught_up events); hang verdicts need --hang-timeout
        self._progress, self._watchdogs = open_watchdogs(self._config, self._spec.local_world_size, self._rdzv,
                                                         self._events, self._hostname, self._base_env,
                                                         self._config.monitor_interval, self._launcher.reaper,
                                                         self._launcher.supervisor)
        if self._metrics is not None:  # --metrics-port: the events from now on; the state read at each scrape
            self._metrics.watch(self._events, node, self._launcher.supervisor, snapshot=self._keeper.snapshot_facts,
                                progress_files=lambda: self._progress.files if self._progress else None,
                                exit_codes=lambda: self._procs.seen_codes() if self._procs else {})
        self._keeper.open(self._launcher, self._events)
        # in-process restart (elaunch.restartable): the channel's name in every worker's environment; a
        # worker's "raised" fails the group like an exit. Offered to exec'd script workers only.
        self._inproc = open_inprocess(self._launcher.supervisor, self._env_opts.run_id, self._events,
                                      self._config.inprocess_timeout, lambda: Alarm("raised", {}),
                                      offered=self._fork_target is None and not _function_workers(self._spec),
                                      on_late=self._late_stacks)
        self._watchdogs.insert(0, self._inproc)
        # the notices first: their persist request is seen by the keeper's poll of the same look;
        # the helpers' health just before the keeper (a dead persister is restarted or off when it asks)
        self._watchdogs.insert(0, self._notices)
        self._watchdogs.append(HelperChecks(self._launcher.supervisor))
        self._watchdogs.append(self._keeper)
        self._starter = GroupStarter(self._spec, self._launcher, self._env_opts, self._base_env,
                                     self._logs.line_prefix_template, self._watchdogs)
        self._node_check = node_check_for(self._config, self._rdzv.job_channel, self._events, self._launcher.reaper)
        if self._node_check is not None:  # its waiting child: closed in forked workers, stopped with the helpers
            self._launcher.supervisor.add(self._node_check, SERVICES, watched=False)
        self._monitor = GroupMonitor(self._rdzv, self._job, self._events, self._config.monitor_interval,
                                     self._watchdogs, keeps_peers=self._inproc.keeps_peers)
        try:
            result = self._invoke_run()
            self._job_end(result)
            return result
        except SignalException as exc:
            log.warning("received %s, stopping workers", signal.Signals(exc.sigval).name)
            self._launcher.no_more_attempts()
            self._keeper.persist_now("signal")  # written while the workers stop; awaited before the directory goes
            self._inproc.forward(exc.sigval)  # survivors kept for the next round: the same signal, the same grace
            self._stop_workers(exc.sigval)
            self._inproc.close(grace=self._config.shutdown_timeout)
            self._job_end(sig=exc.sigval)
            raise
        except BaseException as exc:
            self._job_end(error=exc)
            raise
        finally:
            self._launcher.no_more_attempts()
            self._stop_workers(signal.SIGKILL, grace=0.0)
            self._inproc.close()  # survivors kept for an attempt that will not come
            self._notices.take()  # one that came after the job's end event (the exit barrier): the log line
            self._keeper.close()  # before the helpers and the reaper go: it awaits a persist, then removes its dir
            self._launcher.close()  # every helper (the node check's child too), then the reaper
            for watchdog in self._watchdogs:
                watchdog.close()
            self._events.close()

    def record_notice(self, sig: int) -> None:
        """Record a notice (``--forward-signals``, e.g. Slurm's SIGUSR1); the agent's loop forwards it.

        The one part of a notice that runs in the signal handler (main thread): it queues
        the signal with the workers running now and wakes the monitor's wait (a self-pipe
        write). The monitor's next look, at once, sends the signal to those workers' process
        groups (if they still run), asks the checkpoint keeper for a persist, and writes the
        ``notice`` event and a log line; the job keeps running. torchrun has no notices.
        """
        self._notices.record(sig, self._procs)

    def _forward(self, sig: int, at: float, procs: WorkerProcesses | None) -> None:
        """Act on one notice (main thread): forward it to ``procs`` (the workers running when it came), ask
        for a persist, write the ``notice`` event (time ``at``, when it came) and the log line."""
        running = procs is not None and procs is not self._exits_told  # not stopped since it came
        if running:
            procs.notify(sig)
        self._keeper.ask_persist("notice")
        self._events.notice(sig, at=at)
        if running:
            log.warning("received %s: forwarded to the workers (a notice; the job keeps running)", signal_name(-sig))
        else:
            log.warning("received %s while no workers ran: not forwarded (a notice; the job keeps running)",
                        signal_name(-sig))

    def _job_end(self, result: RunResult | None = None, **why) -> None:
        """The job's end event (``AgentEvents.job_end``), after the notices no look acted on yet."""
        self._notices.take()
        self._events.job_end(result, **why)

    def _invoke_run(self) -> RunResult:
        """The agent's loop: join a round, start the workers, watch them, decide the step, act on it.

        The step comes from the job's restart budget (:meth:`JobView.decide`, the table
        ``decide.next_step``); each action returns the run's result, or None to go round again.
        """
        attempt = 0
        self._starter.prewarm(self._job.restarts)  # --warm-start: the first attempt's spares, before any round
        while True:
            try:
                info = self._join()
            except RendezvousJobFailedError as exc:
                # JOINING -> FAILED: another node declared the job failed while we joined
                self._launcher.no_more_attempts()
                return self._job.failed_elsewhere(exc.failure)
            if self._node_check is not None:  # before the workers start: name the faulty nodes
                out = self._node_check.run(info)[1]
                if out:  # exclude_after given: the faulty sit out, the others re-form without them
                    result = self._sat_out(self._node_check.sit_out_or_reform(info, out, self._job))
                    if result is not None:
                        return result
                    continue
            try:
                group = self._start_workers(info, attempt)
            except OSError as exc:
                # INIT -> FAILED: the workers cannot even start; no restart fixes that
                stopped = unstartable(info, exc, self._spec.local_world_size, self._hostname)
                stopped.step, _ = self._job.decide(Verdict.FAILED, fixable=False)
            else:
                attempt += 1
                stopped = self._watch(info, group)
            actions = {Step.RESTART: self._restart, Step.REJOIN: self._rejoin, Step.FINISH_OK: self._succeeded,
                       Step.FINISH_FAILED: self._finish_failed, Step.FAIL_AT_ONCE: self._fail_at_once}
            result = actions[stopped.step](stopped)
            if result is not None:
                return result

    def _join(self) -> RendezvousInfo:
        """Join the next round; log the last counted restart once it formed; take the job's count from it."""
        self._events.rendezvous_joining()
        if self._node_check is not None:
            self._node_check.prepare()  # its child imports torch while the rendezvous runs
        info = self._rdzv.next_rendezvous()
        self._events.rendezvous_complete(info, self._rdzv.job_channel().round_members)
        # a restart not logged yet: every node of the failed round recorded its report before this
        # round formed, so the root cause read now is the job's final one, the same on every node
        self._announce_restart()
        self._job.joined(info.restart_count)
        return info

    def _watch(self, info: RendezvousInfo, group: WorkerGroup) -> Stopped:
        """Watch the group until it stops; stop the rest of it; decide what follows (the job's budget)."""
        verdict = self._monitor.watch(self._procs, group, self._attempt_logs, self.log_root)
        stopped = Stopped(verdict, info, group)
        alarm = self._monitor.alarm
        if alarm is not None and alarm.kind == "straggler":
            # HEALTHY -> OUT: this node's ranks were named stragglers (straggler_exclude=1): no failure, no restart
            # counted; the node sits out (in _rejoin) and the others re-form without it
            self._stop_workers(signal.SIGTERM)
            stopped.verdict, stopped.step, stopped.sits_out = Verdict.MEMBERSHIP_CHANGE, Step.REJOIN, alarm.why
            return stopped
        if verdict in (Verdict.FAILED, Verdict.MEMBERSHIP_CHANGE) and self._inproc.applies(
                self._procs.poll(), alarm is None or alarm.restart):
            return self._watch_in_process(stopped)
        if verdict is not Verdict.SUCCEEDED:
            # which workers failed is fixed now; their error files are read once the rest
            # are stopped, so a restart does not wait for that
            exited = self._failure_seen() if verdict is Verdict.FAILED else None
            self._stop_workers(signal.SIGTERM)
            if verdict is Verdict.FAILED:
                self._keeper.persist_now("failure")  # the snapshots the failed workers left, in the background
                stopped.observe_failure(self._monitor.alarm, *exited, self._failed_codes(), self._attempt_logs,
                                        self._hostname)
        stopped.step, stopped.root = self._job.decide(verdict, stopped.record, stopped.fixable)
        if verdict is Verdict.JOB_FAILED:
            stopped.root = self._job.state.failure  # published by the node that failed the job
        return stopped

    def _watch_in_process(self, stopped: Stopped) -> Stopped:
        """A failure or membership change of workers that all opted in (``elaunch.restartable``): the survivors
        are interrupted, not stopped.

        A failure is observed, decided and counted exactly as :meth:`_watch` does; a membership change
        (a node lost or waiting to join, a round failed elsewhere) is not counted, as today. On RESTART or
        REJOIN the waiting survivors are kept for the next round (``InProcess.keep``), which gives them
        their new ranks and world size, and only the rest are stopped; on any other step every worker
        is stopped as today.
        """
        failed = stopped.verdict is Verdict.FAILED
        exited = self._failure_seen() if failed else None
        # HEALTHY -> INTERRUPTED: "abort" to the running workers; those not ready within the grace are killed
        waiting = self._inproc.interrupt(self._procs, prestart=self._starter.prestart)
        if failed:
            self._keeper.persist_now("failure")
            stopped.observe_failure(self._monitor.alarm, *exited, self._failed_codes(), self._attempt_logs,
                                    self._hostname)
        stopped.step, stopped.root = self._job.decide(stopped.verdict, stopped.record, stopped.fixable)
        if stopped.step in (Step.RESTART, Step.REJOIN):
            # INTERRUPTED -> KEPT: the survivors wait for the next round's "go"; the dead are reaped
            self._inproc.keep(self._procs, waiting, "failure" if stopped.step is Step.RESTART else "membership")
            self._stop_workers(signal.SIGKILL, grace=0.0)
        else:
            self._inproc.drop()  # replacements started for a round that does not come
            self._stop_workers(signal.SIGTERM)
        return stopped

    def _late_stacks(self, pids: dict[int, int]) -> str | None:
        """Write the stacks of interrupted workers that did not say "ready" in time (``InProcess``'s ``on_late``)
        under the run's ``stacks/`` directory, as a hang's are; return the file, or None."""
        from elaunch.agent.hang_watchdog import write_stacks

        files = self._progress.files.stacks_files() if self._progress is not None else None
        why = (f"in-process restart: local rank(s) {sorted(pids)} did not say ready within "
               f"{self._config.inprocess_timeout:g} s of the abort (--inprocess-timeout); killed after this dump")
        return write_stacks(pids, files, self.log_root, f"restart{self._job.restarts}_inprocess_not_ready", why)[1]

    def _failure_seen(self) -> tuple[dict[int, int | None], dict[int, float]]:
        """The failure as seen now: exit codes (:meth:`_failed_codes`) and times (``inprocess.decide.failure_times``).

        After a worker's "raised", first up to ``RAISED_SETTLE`` seconds for an exit: a killed peer's
        closed sockets may have broken that worker's collective before the kill could be seen. The
        wait ends early once no rank runs that has not raised (``decide.laggards`` of the "raised"):
        only such a rank can be the killed one, so with one worker per node, or when every local rank's
        collective broke on a peer elsewhere, no local death is coming. A worker that opted in is dated
        by its control connection's end when that came first (``InProcess.death_times``).
        """
        from elaunch.inprocess.decide import RAISED_SETTLE, failure_times, laggards

        exits = self._procs.exit_times()
        raised = self._inproc.raised_times()
        deadline = time.monotonic() + RAISED_SETTLE
        while raised and not exits and laggards(self._procs.poll(), raised):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            self._procs.wait(left)  # an exit, or a message on the channel (another "raised"), wakes it
            exits, raised = self._procs.exit_times(), self._inproc.raised_times()
        return self._failed_codes(), failure_times(self._inproc.death_times(exits), raised)

    def _failed_codes(self) -> dict[int, int | None]:
        """The workers' exit codes, a worker that reported "raised" (alive, waiting) failed with exit code 1."""
        from elaunch.inprocess.decide import with_raised

        return with_raised(self._procs.poll(), self._inproc.raised())

    def _restart(self, stopped: Stopped) -> RunResult | None:
        """HEALTHY -> STOPPED: restart after a failure (counted once for the job); sit out when blamed."""
        stopped.group.state = WorkerState.STOPPED
        self._announce = (stopped.info.round, stopped.root)
        if not self._job.state.node:  # no job state: this agent alone knows the root cause
            self._announce_restart()
        return self._sat_out(self._job.sit_out_if_blamed())

    def _rejoin(self, stopped: Stopped) -> RunResult | None:
        """HEALTHY -> STOPPED: re-form the group, not counted: membership changed, or a member node is gone.

        A node whose ranks were named stragglers (``stopped.sits_out``) sits out first, as a blamed node does;
        the run's result when the job ended meanwhile.
        """
        stopped.group.state = WorkerState.STOPPED
        if stopped.sits_out is not None:
            self._events.restart(False, self._job.restarts, "straggler")
            return self._sat_out(self._job.sit_out(stopped.sits_out))
        if stopped.verdict is Verdict.MEMBERSHIP_CHANGE:
            self._reform_event()
            return
        # the workers failed because a member node is gone
        lost = self._job.state.lost
        log.warning(
            "membership changed (0 node(s) waiting to join, %d lost); re-forming the group"
            " (not counted as a restart): the workers failed (%s) after node(s) %s stopped answering",
            len(lost), describe_exits(stopped.codes, self._inproc.raised_errors()), ", ".join(lost),
        )
        self._events.restart(False, self._job.restarts, "node_lost", stopped.record)

    def _sat_out(self, ended: RunResult | None) -> RunResult | None:
        """OUT -> SUCCEEDED/FAILED: ``ended``, the run's result when the job ended while this node sat out; or None."""
        if ended is not None:
            self._launcher.no_more_attempts()
        return ended

    def _finish_failed(self, stopped: Stopped) -> RunResult:
        """HEALTHY -> FAILED: the job failed on another node (it published the root cause), or no restart is left."""
        self._launcher.no_more_attempts()
        stopped.group.state = WorkerState.FAILED
        if stopped.verdict is Verdict.JOB_FAILED:
            return self._job.failed_elsewhere(stopped.root)
        return RunResult(WorkerState.FAILED, failures=with_root(stopped.failures, stopped.root, self._job.state.node),
                         restarts=self._job.restarts, root_rank=stopped.root.rank)

    def _succeeded(self, stopped: Stopped) -> RunResult:
        """HEALTHY -> SUCCEEDED: every worker exited 0; end the run and wait at the exit barrier."""
        self._launcher.no_more_attempts()
        group = stopped.group
        group.state = WorkerState.SUCCEEDED
        self._stop_workers(signal.SIGKILL, grace=0.0)
        result = RunResult(WorkerState.SUCCEEDED, restarts=self._job.restarts,
                           global_ranks={w.local_rank: w.global_rank for w in group.workers})
        self._job_end(result)
        self._events.close()  # a temporary log directory goes now, events.jsonl with it
        self._launcher.remove_log_dir_if_temporary()
        self._rdzv.exit_barrier(self._exit_barrier_timeout)
        self._job.succeed()  # after the exit barrier: the nodes of the round are done
        return result

    def _reform_event(self) -> None:
        """The ``restart`` event of a re-form: the job's restart when the round failed on another node."""
        job = self._job.state
        if failed_elsewhere(job, self._group.round):  # the reporting node counts it: the job's count is known once re-formed
            self._events.restart_after_rendezvous(job.failure)
        else:
            self._events.restart(False, self._job.restarts, "membership")

    def _announce_restart(self) -> None:
        """Log the restart not yet logged (if any) with its round's root cause as the rendezvous has it now."""
        if self._announce is None:
            return
        (round, root), self._announce = self._announce, None
        final = self._job.root_of(round)
        root = final if final is not None else root
        restarts = self._job.restarts
        self._events.restart(True, restarts, "failure", root, failed_round=round)
        log.warning(
            "worker group failed (rank %d on %s, exitcode %d%s); restart %d/%d",
            root.rank, root.host, root.exitcode, f" {signal_name(root.exitcode)}" if root.exitcode < 0 else "",
            restarts, self._job.max_restarts,
        )

    def _fail_at_once(self, stopped: Stopped) -> RunResult:
        """HEALTHY/INIT -> FAILED: a failure no restart fixes; the job fails with the first failure as root cause."""
        self._launcher.no_more_attempts()
        first = min(stopped.failures.values(), key=lambda f: f.global_rank)
        root = self._job.fail(local_record(first, stopped.info.round))
        return RunResult(WorkerState.FAILED, failures=with_root(stopped.failures, root, self._job.state.node),
                         restarts=self._job.restarts, root_rank=root.rank)

    def _start_workers(self, info: RendezvousInfo, attempt: int) -> WorkerGroup:
        """INIT -> HEALTHY: start this node's workers of the round ``info``; say so (event, agent record)."""
        group = self._starter.group(info)
        logs = self._launcher.attempt_logs(attempt, self._spec.local_world_size)
        self._keeper.prepare(info, group.workers, self._spec.local_world_size)  # the round's restore: its env
        may_follow = self._job.left > 0 or self._rdzv.can_reform
        self._procs = self._starter.start(group, attempt, logs, self._job.restarts, info.use_agent_store, may_follow,
                                          keep=self._inproc.adopter(logs))
        self._inproc.drop()  # survivors no rank took (none: the local ranks do not change)
        self._inproc.started(self._procs, group.workers)
        self._notices.wake_with(self._procs.wakeup)  # a notice from now on wakes the monitor's wait
        self._attempt_logs = logs
        workers = group.workers
        self._events.workers_started(attempt, workers, self._procs.pids, f"{group.master_addr}:{group.master_port}")
        group.state = WorkerState.HEALTHY
        self._group = group
        record = agent_record(info.round, [w.global_rank for w in workers], self._job.max_restarts,
                              self._job.restarts, self._spec.role, self._hostname, self.log_root)
        publish(self._rdzv.job_channel(), "agent", record)
        return group

    def _stop_workers(self, sig: int, grace: float | None = None) -> None:
        self._notices.wake_with(None)  # before the wake pipe closes: a handler must not write to a reused fd
        procs = self._procs
        if procs is None or procs is self._exits_told:
            return
        before = procs.poll()
        procs.stop(sig, self._config.shutdown_timeout if grace is None else grace)
        procs.close()
        self._exits_told = procs
        step = self._progress.stopped() if self._progress is not None else None
        # the workers of this attempt that stopped (survivors kept in process are not among them)
        workers = [w for w in self._group.workers if w.local_rank in procs.pids]
        self._events.workers_exited(workers, before, procs.poll(), procs.exit_times(), step)


def _function_workers(spec: WorkerSpec) -> bool:
    """True for function workers (``--run-path``, ``elastic_launch`` of a callable): no in-process restart."""
    from elaunch.procs import return_barrier

    return return_barrier.applies(spec.worker_cmd(0), 2)
