"""The process-level scenarios: launch, restart, elastic start, scale-up/down, agent overhead.

Each ``bench_*`` function runs both launchers interleaved (elaunch, torchrun,
elaunch, torchrun, ...) ``cfg.repeat`` times and returns a :class:`Recorder`.
A repeat that does not finish within its bound is recorded as None with a note
("did not complete in T s", or "never (> T s)" when the launcher is not expected to
finish at all: :class:`Never`); once a launcher misses a bound, its later repeats
of that scenario are skipped (they would only cost the same T again). A launcher
that exits before starting any worker cannot run the configuration at all
(:class:`Cannot`, "cannot: <its error>"); its later repeats are skipped too.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

from benchmarks.common import (
    LAUNCHERS,
    WORKERS,
    DidNotComplete,
    Recorder,
    free_port,
    kill_tree,
    log_line,
    run_to_exit,
    stamps,
    start,
    stop,
    wait_until,
)

NOOP = str(WORKERS / "noop.py")
STAMP = str(WORKERS / "stamp.py")
SLEEPER = str(WORKERS / "sleeper.py")


@dataclass
class BenchConfig:
    """Knobs of one benchmark run.

    Attributes:
        quick: small sizes and short bounds (CI: proves the suite works).
        repeat: repeats per launcher and scenario.
        tmp: scratch directory (worker stamps, launcher logs).
        warm_start: elaunch's warm-start flag when ``elaunch --help`` lists it, else None.
        scale_timeout: seconds a scale-up/down may take before "did not complete".
        overhead_seconds: seconds the agent-overhead window lasts.
        rdzv_sizes: N values of the rendezvous-scale scenario.
        rdzv_timeout: seconds one rendezvous round of N agents may take.
        failure_bound: seconds the failure scenarios (job-wide abort, hang) wait for
            a launcher to stop before recording "never".
    """

    quick: bool
    repeat: int
    tmp: Path
    warm_start: str | None
    scale_timeout: float
    overhead_seconds: float
    rdzv_sizes: tuple[int, ...]
    rdzv_timeout: float
    failure_bound: float = 20.0

    def scratch(self, name: str) -> Path:
        """Return a fresh, empty directory ``tmp/name``."""
        path = self.tmp / name
        shutil.rmtree(path, ignore_errors=True)
        path.mkdir(parents=True)
        return path


class Never(DidNotComplete):
    """The launcher did not stop within the bound: a "never (> T s)" result, not a slow one.

    Args:
        message: starts with ``never (> T s)``.
        values: metric name -> value for the metrics this repeat did measure
            (the others are recorded as None with ``message``).
    """

    def __init__(self, message: str, values: dict[str, float | None] | None = None) -> None:
        super().__init__(message)
        self.values = values or {}


class Cannot(DidNotComplete):
    """The launcher cannot run the scenario's configuration: it exited before starting any worker.

    The message starts with ``cannot:`` and gives the launcher's own last error line
    (e.g. torchrun on ``--rdzv-backend=etcd-v3``, which torch does not register).
    Its later repeats of the scenario are skipped, as after a :class:`Never`.
    """


def _runs(cfg: BenchConfig, rec: Recorder, name: str):
    """Yield ``(repeat, launcher, log_path, out_dir)`` interleaved, skipping launchers that timed out."""
    given_up: set[str] = set()
    for i in range(cfg.repeat):
        for which in LAUNCHERS:
            if which in given_up:
                continue
            out = cfg.scratch(f"{name}-{which}-{i}")
            log_line(f"{name}: {which} repeat {i + 1}/{cfg.repeat}")
            failed = yield i, which, out / "launcher.log", out
            if failed:
                given_up.add(which)


def _drive(cfg: BenchConfig, rec: Recorder, name: str, once) -> Recorder:
    """Call ``once(which, log, out) -> {metric: value}`` per interleaved repeat and record it."""
    gen = _runs(cfg, rec, name)
    try:
        step = next(gen)
        while True:
            _i, which, log, out = step
            failed = False
            try:
                for metric, value in once(which, log, out).items():
                    rec.add(metric, which, value)
            except Exception as exc:  # noqa: BLE001 - one failed repeat must not end the run
                failed = isinstance(exc, (Never, Cannot)) or (isinstance(exc, DidNotComplete) and "did not complete" in str(exc))
                measured = exc.values if isinstance(exc, Never) else {}
                if not isinstance(exc, DidNotComplete):
                    exc = DidNotComplete(f"{type(exc).__name__}: {exc}")
                tail = _tail(log)
                log_line(f"{name}: {which}: {exc}{tail}")
                for metric in list(rec.metrics):
                    short = metric.split(".", 1)[1]
                    if measured.get(short) is not None:
                        rec.add(short, which, measured[short])
                    else:
                        rec.add(short, which, None, str(exc))
            step = gen.send(failed)
    except StopIteration:
        pass
    return rec


def _tail(log: Path) -> str:
    try:
        lines = log.read_text(errors="replace").strip().splitlines()[-3:]
    except OSError:
        return ""
    return ("\n    " + "\n    ".join(lines)) if lines else ""


def _finish(proc: subprocess.Popen, timeout: float, what: str) -> int:
    """Wait ``timeout`` seconds for ``proc`` to exit, else kill its tree and raise DidNotComplete."""
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        stop([proc])
        raise DidNotComplete(f"did not complete in {timeout:g} s ({what})") from None


# -- launch -------------------------------------------------------------------------------

def bench_launch(cfg: BenchConfig) -> Recorder:
    """``--standalone --nproc-per-node=2`` of a no-op script: wall, CPU, agent peak RSS."""
    rec = Recorder("launch")
    rec.metric("wall", "launch: wall time (standalone, 2 no-op workers)", "s",
               {"kind": "ratio_le", "value": 0.15, "text": "<= 0.15x torchrun"})
    rec.metric("cpu", "launch: CPU time (agent + workers)", "s")
    rec.metric("agent_cpu", "launch: CPU time (agent alone)", "s")
    rec.metric("rss", "launch: agent peak RSS (VmHWM)", "MiB",
               {"kind": "abs_le", "value": 60, "text": "<= 60 MiB"})

    def once(which, log, out):
        r = run_to_exit(["--standalone", "--nproc-per-node=2", NOOP], which, log, timeout=120)
        if r["exit_code"] != 0:
            raise DidNotComplete(f"exit code {r['exit_code']}")
        return {"wall": r["wall_s"], "cpu": r["cpu_s"], "agent_cpu": r["agent_cpu_s"], "rss": r["agent_peak_mib"]}

    return _drive(cfg, rec, "launch", once)


# -- restart ------------------------------------------------------------------------------

#: Seconds the job runs (torch imported) before rank 1 crashes: a real job fails after
#: it has run a while, by which time a warm pool's spares have finished importing torch.
CRASH_AFTER = 3.0


def bench_restart(cfg: BenchConfig, warm: bool = False) -> Recorder:
    """One gloo rank crashes once, ``CRASH_AFTER`` s in: crash -> all workers respawned, crash -> group ready.

    With ``warm``, elaunch runs with ``cfg.warm_start`` and torchrun as usual.
    """
    name = "restart_warm" if warm else "restart"
    title = "restart (elaunch warm start)" if warm else "restart"
    rec = Recorder(name)
    rec.metric("respawned", f"{title}: crash -> all workers respawned", "s",
               {"kind": "abs_le", "value": 0.05, "text": "<= 50 ms"})
    rec.metric("ready", f"{title}: crash -> group ready (init + barrier)", "s",
               {"kind": "ratio_le", "value": 0.3, "text": "<= 0.3x torchrun (warm start)"} if warm else None)

    def once(which, log, out):
        extra = [cfg.warm_start] if (warm and which == "elaunch" and cfg.warm_start) else []
        proc = start(which, ["--standalone", "--nproc-per-node=2", "--max-restarts=1", *extra,
                             STAMP, str(out), "restart", str(CRASH_AFTER)], log)
        code = _finish(proc, 120, "crash and restart")
        crash = stamps(out, "crash")
        starts, readies = stamps(out, "start", restart=1), stamps(out, "ready", restart=1)
        if len(crash) != 1 or len(starts) != 2:
            raise DidNotComplete(f"exit code {code}; no restart seen (crash={crash} start={starts})")
        result = {"respawned": max(starts) - crash[0]}
        if code != 0 or len(readies) != 2:
            rec.add("ready", which, None, f"restarted group failed (exit code {code})")
            rec.add("respawned", which, result["respawned"])
            return {}
        result["ready"] = max(readies) - crash[0]
        return result

    return _drive(cfg, rec, name, once)


# -- elastic start, scale-up, scale-down ---------------------------------------------------

def _c10d_args(port: int, run_id: str, conf: str | None) -> list[str]:
    args = ["--nnodes=1:2", "--nproc-per-node=1", "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id={run_id}", "--local-addr=127.0.0.1"]
    return args + ([f"--rdzv-conf={conf}"] if conf else [])


def bench_elastic_start(cfg: BenchConfig) -> Recorder:
    """``--nnodes=1:2`` (c10d) with one agent present: launch -> worker running.

    Full mode uses the launchers' default rendezvous settings; quick mode passes
    ``last_call_timeout=1`` to both (torchrun's default 30 s is too long for CI).
    """
    conf = "last_call_timeout=1" if cfg.quick else None
    label = "elastic start 1:2, one node: launch -> worker running" + (" (last_call_timeout=1)" if conf else "")
    rec = Recorder("elastic_start")
    rec.metric("running", label, "s", {"kind": "abs_le", "value": 3.0, "text": "<= 3 s by default"})

    def once(which, log, out):
        port = free_port()
        t0 = time.time()
        proc = start(which, [*_c10d_args(port, f"bench-elastic-{port}", conf), STAMP, str(out), "start"], log)
        try:
            t = wait_until(lambda: stamps(out, "start"), 120, "worker started", (proc,))
            _finish(proc, 60, "job exit")
        finally:
            stop([proc])
        return {"running": min(t) - t0}

    return _drive(cfg, rec, "elastic_start", once)


def bench_scale_up(cfg: BenchConfig) -> Recorder:
    """A job of one node runs; a second agent starts: its start -> world of 2 running/ready."""
    rec = Recorder("scale_up")
    rec.metric("running", "scale-up 1 -> 2 nodes: join -> world of 2 running", "s",
               {"kind": "abs_le", "value": 5.0, "text": "<= 5 s"})
    rec.metric("ready", "scale-up 1 -> 2 nodes: join -> world of 2 ready", "s")
    conf = "last_call_timeout=1"  # only the first, single-node round waits for it

    def once(which, log, out):
        port = free_port()
        args = [*_c10d_args(port, f"bench-up-{port}", conf), STAMP, str(out), "loop", "600"]
        procs = [start(which, args, log)]
        try:
            wait_until(lambda: stamps(out, "ready", world=1), 120, "world of 1 ready", procs)
            t_join = time.time()
            procs.append(start(which, args, log))
            running = wait_until(lambda: len(s := stamps(out, "start", world=2, after=t_join)) >= 2 and s,
                                 cfg.scale_timeout, "world of 2 running", procs)
            ready = wait_until(lambda: len(s := stamps(out, "ready", world=2, after=t_join)) >= 2 and s,
                               cfg.scale_timeout, "world of 2 ready", procs)
        finally:
            stop(procs)
        return {"running": max(running) - t_join, "ready": max(ready) - t_join}

    return _drive(cfg, rec, "scale_up", once)


def _listens(pid: int, port: int) -> bool:
    try:
        return any(c.laddr and c.laddr.port == port and c.status == psutil.CONN_LISTEN
                   for c in psutil.Process(pid).net_connections(kind="tcp"))
    except psutil.Error:
        return False


def bench_scale_down(cfg: BenchConfig) -> Recorder:
    """Two agents run a world of 2; the non-host agent is SIGKILLed: kill -> world of 1 running/ready.

    Both agents start together so the first round holds both nodes (torchrun
    cannot scale up). Full mode uses default rendezvous settings; quick mode
    ``last_call_timeout=3``.
    """
    conf = "last_call_timeout=3" if cfg.quick else None
    suffix = " (last_call_timeout=3)" if conf else ""
    rec = Recorder("scale_down")
    rec.metric("running", "scale-down 2 -> 1 nodes: node killed -> world of 1 running" + suffix, "s",
               {"kind": "abs_le", "value": 5.0, "text": "<= 5 s"})
    rec.metric("ready", "scale-down 2 -> 1 nodes: node killed -> world of 1 ready" + suffix, "s")

    def once(which, log, out):
        port = free_port()
        args = [*_c10d_args(port, f"bench-down-{port}", conf), "--max-restarts=3", STAMP, str(out), "loop", "600"]
        procs = [start(which, args, log), start(which, args, log)]
        try:
            wait_until(lambda: len(stamps(out, "ready", world=2)) >= 2, 120, "world of 2 ready", procs)
            host = wait_until(lambda: [p for p in procs if _listens(p.pid, port)], 10, "store host found")[0]
            victim = next(p for p in procs if p is not host)
            t_kill = time.time()
            kill_tree(victim.pid)
            victim.wait(timeout=10)
            # a dead node may hold the next round until its keep-alive expires (15 s by default),
            # then the default last call is 30 s
            timeout = cfg.scale_timeout + (20.0 if conf else 50.0)
            running = wait_until(lambda: stamps(out, "start", world=1, after=t_kill), timeout,
                                 "world of 1 running", (host,))
            ready = wait_until(lambda: stamps(out, "ready", world=1, after=t_kill), timeout,
                               "world of 1 ready", (host,))
        finally:
            stop(procs)
        return {"running": min(running) - t_kill, "ready": min(ready) - t_kill}

    return _drive(cfg, rec, "scale_down", once)


# -- agent overhead -----------------------------------------------------------------------

def bench_overhead(cfg: BenchConfig) -> Recorder:
    """Two sleeping workers: the launcher's CPU seconds per minute and RSS meanwhile.

    "Launcher" is the agent plus any helper process it starts (e.g. elaunch's
    watchdog); workers (the sleeper processes and their descendants) are excluded.
    The window starts once the start-up burst is over (the launcher used at most
    one clock tick of CPU in OVERHEAD_QUIET seconds; at most ``settle_max``):
    elaunch's store-host child imports torch for a few seconds after the workers
    start, which is launch cost, not idle cost.
    """
    rec = Recorder("overhead")
    rec.metric("cpu_per_min", "agent overhead: launcher CPU per minute, 2 sleeping workers", "s/min",
               {"kind": "ratio_le", "value": 0.5, "text": "<= 0.5x torchrun"})
    rec.metric("rss", "agent overhead: agent RSS while workers run", "MiB")
    rec.metric("helpers_rss", "agent overhead: RSS of the launcher's helper processes", "MiB")

    def once(which, log, out):
        return idle_window(cfg, which, log)

    return _drive(cfg, rec, "overhead", once)


def idle_window(cfg: BenchConfig, which: str, log: Path, extra: tuple[str, ...] = (), tick=None,
                before_exit=None, before_exit_seconds: float = 0.0, window: float | None = None) -> dict[str, float]:
    """Measure launcher ``which`` (with ``extra`` flags) idling over two sleeping workers.

    The window lasts ``window`` seconds (default ``cfg.overhead_seconds``) and starts after the start-up burst (see
    :func:`bench_overhead`). ``tick()``, when given, is called every 0.25 s inside the
    window (from this process: its own CPU is not counted). ``before_exit()``, when given,
    runs after the window while the workers still sleep (``before_exit_seconds`` more at
    most) and its dict is merged into the result.

    Returns:
        ``cpu_per_min`` (launcher CPU seconds per minute in the window), ``rss`` (the agent's
        peak RSS, MiB), ``helpers_rss`` (its helper processes', MiB), and ``before_exit``'s.

    Raises:
        DidNotComplete: the workers did not start within 90 s or exit within 60 s.
    """
    window = cfg.overhead_seconds if window is None else window
    settle = 0.5 if cfg.quick else 1.0
    settle_max = 2.0 if cfg.quick else 8.0
    proc = start(which, ["--standalone", "--nproc-per-node=2", *extra, SLEEPER,
                         str(window + settle_max + 2 + before_exit_seconds)], log)
    try:
        agent = psutil.Process(proc.pid)

        def split():
            kids = agent.children(recursive=True)
            workers = {k.pid for k in kids if _is_sleeper(k)}
            workers |= {d.pid for k in kids if k.pid in workers for d in _kids(k)}
            return [k for k in kids if k.pid not in workers], len([k for k in kids if _is_sleeper(k)])

        wait_until(lambda: split()[1] >= 2, 90, "2 workers running", (proc,))
        time.sleep(settle)  # the measurement window starts after the start-up burst
        helpers = split()[0]
        group = [agent, *helpers]
        _quiet(group, settle_max - settle)
        c0, t0 = _cpu(group), time.monotonic()
        rss, hrss = [], []
        while time.monotonic() - t0 < window:
            rss.append(_rss(agent))
            hrss.append(sum(_rss(h) for h in helpers))
            if tick is not None:
                tick()
            time.sleep(0.25)
        c1, t1 = _cpu(group), time.monotonic()
        extra_values = before_exit() if before_exit is not None else {}
        _finish(proc, 60 + before_exit_seconds, "workers exit")
    finally:
        stop([proc])
    return {"cpu_per_min": (c1 - c0) / (t1 - t0) * 60.0, "rss": max(rss), "helpers_rss": max(hrss), **extra_values}


#: Seconds of the look that ends the overhead benchmark's settling: the launcher used at
#: most one clock tick (10 ms) of CPU in them.
OVERHEAD_QUIET = 0.5


def _quiet(group, limit: float) -> None:
    """Return once ``group`` used at most 10 ms of CPU in OVERHEAD_QUIET seconds, or after ``limit`` seconds."""
    deadline = time.monotonic() + limit
    before = _cpu(group)
    while time.monotonic() < deadline:
        time.sleep(OVERHEAD_QUIET)
        now = _cpu(group)
        if now - before <= 0.0101:
            return
        before = now


def _is_sleeper(p: psutil.Process) -> bool:
    try:
        return SLEEPER in p.cmdline()
    except psutil.Error:
        return False


def _kids(p: psutil.Process) -> list[psutil.Process]:
    try:
        return p.children(recursive=True)
    except psutil.Error:
        return []


def _cpu(procs) -> float:
    total = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.Error:
            pass
    return total


def _rss(p: psutil.Process) -> float:
    try:
        return p.memory_info().rss / 2**20
    except psutil.Error:
        return 0.0


def elaunch_warm_start_flag() -> str | None:
    """Return ``--warm-start`` when ``elaunch --help`` lists it, else None."""
    from benchmarks.common import launcher_cmd, launcher_env

    try:
        out = subprocess.run(launcher_cmd("elaunch", "--help"), capture_output=True, text=True,
                             env=launcher_env(), timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    return "--warm-start" if "--warm-start" in out else None
