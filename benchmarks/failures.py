"""The failure scenarios: a job-wide abort across two agents (c10d, etcd-v2, etcd-v3), and hang detection.

Both measure how long a launcher takes to end a job that cannot go on, from the
last thing a worker did (a ``time.time()`` stamp it wrote) to the moment the last
agent exited with no worker left. torchrun ends neither: its healthy node keeps
its blocked workers, and it has no hang detection. Each wait is bounded by
``cfg.failure_bound`` seconds; a launcher that has not stopped by then is killed
and recorded as "never (> bound)" (its later repeats of the scenario are skipped).
"""

from __future__ import annotations

import random
import dataclasses
import subprocess
import threading
import time
from pathlib import Path

import psutil

from benchmarks.common import (WORKERS, DidNotComplete, Recorder, free_port, kill_tree, log_line, run_to_exit, start,
                               stop, wait_until)
from benchmarks.etcd_server import EtcdServer, etcd_binary, missing_for_etcd
from benchmarks.scenarios import BenchConfig, Cannot, Never, _drive, _listens

ABORT = str(WORKERS / "abort.py")
HANG = str(WORKERS / "hang.py")
#: The global rank that fails in the abort scenario: the second node's second worker.
FAIL_RANK = 3
#: Seconds the failing rank waits after every rank started, drawn per repeat from this range, so
#: the repeats sample the phase of the agents' periodic reads (the 0.1 s monitor tick, and a state
#: read reused for up to ``poll_interval``: 0.2 s on c10d/etcd-v2, 1 s on etcd-v3) instead of
#: hitting one phase every time.
FAIL_AFTER = (0.3, 1.3)
#: ``--hang-timeout`` of the hang scenario (s), and how long rank 1 makes progress first (s).
HANG_TIMEOUT = 2.0
PROGRESS_FOR = 1.0
#: The etcd rendezvous backends the job-wide abort also runs on (scenario ``job_abort_etcd``),
#: with the same flag for both launchers; torch 2.13 has no ``etcd-v3`` (its row says so).
ETCD_BACKENDS = ("etcd-v2", "etcd-v3")


class _ExitTimes:
    """Waits for each launcher in a thread and stamps ``time.time()`` the moment it exits."""

    def __init__(self) -> None:
        self.at: dict[int, float] = {}
        self._lock = threading.Lock()

    def watch(self, proc: subprocess.Popen) -> None:
        def wait() -> None:
            try:
                proc.wait()
            except ChildProcessError:  # reaped by another waiter: the time is still close
                pass
            with self._lock:
                self.at.setdefault(proc.pid, time.time())

        threading.Thread(target=wait, daemon=True).start()


def _workers(script: str, out: Path) -> list[psutil.Process]:
    """The live worker processes of this repeat.

    A worker's command line is ``python -u SCRIPT OUT ...``; the launchers' own
    (``python -m elaunch|torch.distributed.run ... SCRIPT OUT ...``) name them too
    and are left out by their ``-m``.
    """
    found = []
    for p in psutil.process_iter(["cmdline", "status"]):
        cmd = p.info["cmdline"] or []
        if script in cmd and str(out) in cmd and "-m" not in cmd and p.info["status"] != psutil.STATUS_ZOMBIE:
            found.append(p)
    return found


def _wait_stopped(procs: list[subprocess.Popen], exits: _ExitTimes, script: str, out: Path,
                  deadline: float) -> float | None:
    """Wait until every launcher exited and no worker is left; return that moment (epoch s).

    The moment is the last launcher's exit, or, when workers outlive it, the time the
    last of them was seen gone (10 ms polls). Returns None when ``deadline`` (epoch s)
    passes first.
    """
    while time.time() < deadline:
        if len(exits.at) == len(procs):
            end = max(exits.at.values())
            while time.time() < deadline:
                if not _workers(script, out):
                    return end
                end = time.time()
                time.sleep(0.01)
            return None
        time.sleep(0.01)
    return None


def _left(procs: list[subprocess.Popen], exits: _ExitTimes, script: str, out: Path) -> str:
    agents = len([p for p in procs if p.pid not in exits.at])
    workers = len(_workers(script, out))
    return f"{agents} of {len(procs)} agent(s) and {workers} worker(s) still running"


def _kill_workers(script: str, out: Path) -> None:
    for p in _workers(script, out):
        kill_tree(p.pid)


# -- job-wide abort -----------------------------------------------------------------------

def _cannot(log: Path) -> Cannot:
    """The launcher's last log line, as the reason it could not run (see :class:`Cannot`)."""
    try:
        lines = [x.strip() for x in log.read_text(errors="replace").splitlines() if x.strip()]
    except OSError:
        lines = []
    return Cannot(f"cannot: {lines[-1] if lines else 'exited before starting a worker, no output'}")


def bench_job_abort(cfg: BenchConfig, backend: str = "c10d", endpoint: str | None = None) -> Recorder:
    """Two agents of one job (2 x 2 workers); global rank 3 exits 1, the others block.

    c10d (scenario ``job_abort``): the agent that hosts the c10d store starts first
    and is the healthy node: the failing rank runs on the other agent (checked), as
    when any node but the rendezvous endpoint's fails. etcd (``etcd-v2``/``etcd-v3``,
    scenario ``job_abort_etcd_v2``/``_v3``): both agents start together on the etcd
    server at ``endpoint`` (``HOST:PORT``); no node is special there. Measured from
    the failing worker's exit stamp to the last agent's exit with no worker left;
    also to the first agent's exit. A launcher that exits before any worker started
    (torchrun has no ``etcd-v3``) is recorded as :class:`Cannot`.
    """
    bound = cfg.failure_bound
    name = "job_abort" if backend == "c10d" else f"job_abort_{backend.replace('-', '_')}"
    rec = Recorder(name)
    rec.metric("last_agent", f"job-wide abort ({backend}, 2 agents x 2 workers, rank 3 exits 1, others block): "
               "failed worker exit -> last agent exited, no worker left", "s",
               {"kind": "all_le", "value": 1.0, "text": "every agent exited <= 1 s after the verdict"})
    rec.metric("first_agent", f"job-wide abort ({backend}): failed worker exit -> first agent exited", "s")

    def once(which, log, out):
        port = free_port()
        where = endpoint or f"127.0.0.1:{port}"
        args = ["--nnodes=2", "--nproc-per-node=2", f"--rdzv-backend={backend}", f"--rdzv-endpoint={where}",
                f"--rdzv-id=bench-abort-{backend}-{out.name}-{port}", "--local-addr=127.0.0.1", "--max-restarts=0",
                "--monitor-interval=0.1", ABORT, str(out), str(FAIL_RANK), f"{random.uniform(*FAIL_AFTER):.3f}"]
        exits = _ExitTimes()
        procs = [start(which, args, log)]
        exits.watch(procs[0])
        try:
            if backend == "c10d":
                wait_until(lambda: _listens(procs[0].pid, port) or exits.at, 60, "c10d store hosted")
                if exits.at:
                    raise DidNotComplete(f"the first agent exited (code {procs[0].returncode}) before hosting the store")
            procs.append(start(which, args, log))
            exits.watch(procs[1])
            crash = out / "crash"
            wait_until(lambda: crash.exists() or exits.at, 120, f"rank {FAIL_RANK} failed")
            if not crash.exists():
                if not any(out.glob("ready_*")):
                    raise _cannot(log)
                raise DidNotComplete(f"an agent exited before rank {FAIL_RANK} failed")
            t_fail = float(crash.read_text())
            parent = int((out / f"ready_{FAIL_RANK}").read_text())
            if backend == "c10d" and parent != procs[1].pid:
                raise DidNotComplete(f"rank {FAIL_RANK} ran under pid {parent}, not the second agent "
                                     f"{procs[1].pid} (the store host must be the healthy node)")
            end = _wait_stopped(procs, exits, ABORT, out, t_fail + bound)
            first = min(exits.at.values()) - t_fail if exits.at else None
            if end is None:
                raise Never(f"never (> {bound:g} s): {_left(procs, exits, ABORT, out)}", {"first_agent": first})
        finally:
            stop(procs)
            _kill_workers(ABORT, out)
        return {"last_agent": end - t_fail, "first_agent": first}

    return _drive(cfg, rec, name, once)


def bench_job_abort_etcd(cfg: BenchConfig) -> tuple[list[Recorder], list[str]]:
    """The job-wide abort on each of :data:`ETCD_BACKENDS`, against one real etcd server.

    The server (``--enable-v2``, so torchrun's ``etcd-v2`` can run) serves every
    repeat of both backends, each repeat under its own run id, and is stopped at the
    end, also on errors. Returns the recorders and notes for the report (why the
    rows are missing, when etcd cannot run here).
    """
    if note := missing_for_etcd(ETCD_BACKENDS):
        return [], [f"job-wide abort, {note}"]
    server = EtcdServer(etcd_binary() or "etcd")
    try:
        server.start()
    except RuntimeError as exc:
        log_line(f"job_abort_etcd: {exc}")
        return [], [f"job-wide abort, etcd: skipped (the etcd server did not start: {exc})"]
    try:
        log_line(f"job_abort_etcd: etcd {server.binary} serves {server.endpoint}")
        return [bench_job_abort(cfg, backend, server.endpoint) for backend in ETCD_BACKENDS], []
    finally:
        server.stop()


# -- hang detection -----------------------------------------------------------------------

def bench_hang(cfg: BenchConfig) -> Recorder:
    """One agent, 2 workers; rank 1 calls ``elaunch.progress()`` for a while, then blocks forever.

    elaunch runs with ``--hang-timeout``; torchrun has no such flag (the workers'
    ``progress()`` is a no-op there). Measured from rank 1's last progress call to
    the agent's exit with no worker left; the overhead is that minus the timeout.
    """
    bound = cfg.failure_bound
    t = f"{HANG_TIMEOUT:g}"
    rec = Recorder("hang")
    rec.metric("total", f"hang detection (standalone, 2 workers, --hang-timeout={t} for elaunch only): "
               "last progress() of the hung rank -> agent exited, no worker left", "s",
               {"kind": "all_le", "value": HANG_TIMEOUT + 1.0, "text": "stopped within hang timeout + 1 s"})
    rec.metric("overhead", f"hang detection: the above minus the {t} s hang timeout", "s")
    rec.metric("stacks", "hang detection: stacks file written (<log-dir>/**/stacks/*hang*.txt)", "bool")

    def once(which, log, out):
        logs = out / "logs"
        flag = [f"--hang-timeout={t}"] if which == "elaunch" else []
        args = ["--standalone", "--nproc-per-node=2", "--max-restarts=0", f"--log-dir={logs}", *flag,
                HANG, str(out), str(PROGRESS_FOR)]
        exits = _ExitTimes()
        procs = [start(which, args, log)]
        exits.watch(procs[0])
        try:
            last = out / "last_progress"
            wait_until(lambda: last.exists() or exits.at, 120, "rank 1 hung")
            if not last.exists():
                raise DidNotComplete(f"the launcher exited (code {procs[0].poll()}) before rank 1 hung")
            t_last = float(last.read_text())
            end = _wait_stopped(procs, exits, HANG, out, t_last + bound)
            stacks = 1.0 if any(logs.glob("**/stacks/*hang*.txt")) else 0.0
            if end is None:
                raise Never(f"never (> {bound:g} s): {_left(procs, exits, HANG, out)}", {"stacks": stacks})
            if procs[0].returncode == 0:
                raise DidNotComplete("the launcher exited 0 with a hung worker")
        finally:
            stop(procs)
            _kill_workers(HANG, out)
        return {"total": end - t_last, "overhead": end - t_last - HANG_TIMEOUT, "stacks": stacks}

    return _drive(cfg, rec, "hang", once)


# -- SIGABRT at exit ----------------------------------------------------------------------

NO_DESTROY = str(WORKERS / "no_destroy.py")
#: Runs per launcher of the exit scenario for each ``--repeat`` (a rate needs many runs).
EXIT_RUNS_PER_REPEAT = 10
#: At least this many runs per launcher, whatever ``--repeat``: the abort is a scheduling race
#: whose rate follows the machine's load, so fewer runs cannot tell two rates apart.
EXIT_MIN_RUNS = 30


def bench_exit_abort(cfg: BenchConfig) -> Recorder:
    """``--standalone --nproc-per-node=2`` of a gloo script that never destroys its process group.

    Each run is one sample: did the job exit 0, and did a worker die of SIGABRT
    ("terminate called without an active exception") at its exit. torchrun's agent
    hosts the workers' store (``TORCHELASTIC_USE_AGENT_STORE=True``); so does elaunch's
    (a store-host child), where worker rank 0 hosted it before.
    """
    rec = Recorder("exit_abort")
    rec.metric("clean", "exit without destroy_process_group (standalone, 2 gloo workers): job exited 0", "bool",
               {"kind": "rate_ge", "value": 1.0, "text": "clean exits >= torchrun's rate"})
    rec.metric("abort", "exit without destroy_process_group: a worker died of SIGABRT", "bool")

    def once(which, log, out):
        r = run_to_exit(["--standalone", "--nproc-per-node=2", NO_DESTROY], which, log, timeout=120)
        text = log.read_text(errors="replace")
        aborted = "terminate called" in text or "SIGABRT" in text or "Signal 6" in text
        return {"clean": 1.0 if r["exit_code"] == 0 else 0.0, "abort": 1.0 if aborted else 0.0}

    runs = dataclasses.replace(cfg, repeat=max(EXIT_MIN_RUNS, cfg.repeat * EXIT_RUNS_PER_REPEAT))
    return _drive(runs, rec, "exit_abort", once)
