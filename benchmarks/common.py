"""Shared pieces of the benchmark: launcher command lines, process trees, stamps, results.

Every scenario measures both launchers with the same flags: ``elaunch`` is
``python -m elaunch`` and ``torchrun`` is ``python -m torch.distributed.run`` from the
installed torch, both started with this interpreter.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

#: The two launchers, in the order each repeat runs them (interleaved A B A B ...).
LAUNCHERS = ("elaunch", "torchrun")
WORKERS = Path(__file__).resolve().parent / "workers"
REPO = Path(__file__).resolve().parents[1]
_MODULES = {"elaunch": "elaunch", "torchrun": "torch.distributed.run"}


class DidNotComplete(Exception):
    """A measurement did not finish within its bound; the message says what and how long (s)."""


def launcher_cmd(which: str, *args: str) -> list[str]:
    """Return the argv of launcher ``which`` (``elaunch`` or ``torchrun``) with ``args``."""
    return [sys.executable, "-m", _MODULES[which], *args]


def launcher_env() -> dict[str, str]:
    """Return this environment without PET_*/TORCHELASTIC_*/rank variables leaking in."""
    drop = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "TORCHELASTIC_")) and k not in drop}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    return env


def start(which: str, args: list[str], log: Path) -> subprocess.Popen:
    """Start launcher ``which`` with ``args``; its stdout and stderr go to ``log``."""
    with open(log, "ab") as f:
        return subprocess.Popen(launcher_cmd(which, *args), stdout=f, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env=launcher_env(), cwd=str(REPO))


def kill_tree(pid: int) -> None:
    """SIGKILL ``pid`` and every descendant, then reap what can be reaped (waits at most 10 s)."""
    try:
        root = psutil.Process(pid)
        procs = root.children(recursive=True) + [root]
    except psutil.Error:
        return
    for p in procs:
        try:
            p.send_signal(signal.SIGKILL)
        except psutil.Error:
            pass
    psutil.wait_procs(procs, timeout=10)


def stop(procs: list[subprocess.Popen]) -> None:
    """Kill the process trees of ``procs`` and reap them."""
    for p in procs:
        kill_tree(p.pid)
        try:
            p.wait(timeout=10)
        except (subprocess.TimeoutExpired, ChildProcessError):
            pass


def free_port() -> int:
    """Return a TCP port that is free on 127.0.0.1 right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_open(port: int) -> bool:
    """Return True when something accepts connections on 127.0.0.1:``port``."""
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


def wait_until(predicate, timeout: float, what: str, procs: tuple = (), interval: float = 0.01):
    """Poll ``predicate()`` until truthy and return its value.

    Raises:
        DidNotComplete: ``timeout`` seconds passed, or a process of ``procs`` exited
            first; the message names ``what``.
    """
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        for p in procs:
            if p.poll() is not None:
                raise DidNotComplete(f"{what}: launcher exited with {p.returncode} first")
        if time.monotonic() >= deadline:
            raise DidNotComplete(f"did not complete in {timeout:g} s ({what})")
        time.sleep(interval)


def stamps(out: Path, kind: str, world: int | None = None, restart: int | None = None,
           after: float = 0.0) -> list[float]:
    """Return the times of the ``kind`` stamps the stamp worker wrote in ``out``.

    Args:
        out: the workers' output directory.
        kind: ``start``, ``ready`` or ``crash``.
        world: keep only stamps of workers that ran with this WORLD_SIZE.
        restart: keep only stamps of this TORCHELASTIC_RESTART_COUNT.
        after: keep only stamps later than this time (seconds since the epoch).
    """
    times = []
    for path in out.glob(f"{kind}_w*"):
        if path.name.endswith(".tmp"):
            continue
        _, w, r, _rank, _pid = path.name.split("_")
        if world is not None and int(w[1:]) != world:
            continue
        if restart is not None and int(r[1:]) != restart:
            continue
        t = float(path.read_text())
        if t > after:
            times.append(t)
    return times


class PeakSampler:
    """Samples one process's VmHWM (peak RSS) and CPU time in a thread until it exits.

    VmHWM is the kernel's own high-water mark of the process's resident set, so
    the last sample before exit is its peak (up to the sampling ``interval``, s).
    """

    def __init__(self, pid: int, interval: float = 0.005) -> None:
        self.pid = pid
        self.peak_kib = 0
        self.cpu_s = 0.0
        self._interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        try:
            proc = psutil.Process(self.pid)
        except psutil.Error:
            return
        while not self._stop.is_set():
            try:
                with open(f"/proc/{self.pid}/status") as f:
                    for line in f:
                        if line.startswith("VmHWM:"):
                            self.peak_kib = max(self.peak_kib, int(line.split()[1]))
                            break
                t = proc.cpu_times()
                self.cpu_s = t.user + t.system
            except (OSError, psutil.Error, ValueError):
                pass
            time.sleep(self._interval)

    def finish(self) -> None:
        """Stop sampling."""
        self._stop.set()
        self._thread.join()


def run_to_exit(cmd_args: list[str], which: str, log: Path, timeout: float) -> dict[str, float]:
    """Run a launcher to its exit; measure wall time, CPU of the tree and the agent's peak RSS.

    Returns:
        ``wall_s`` (Popen to exit), ``cpu_s`` (user+system of the agent and every
        descendant it reaped, from ``wait4``), ``agent_cpu_s`` (the agent alone, last
        sample), ``agent_peak_mib`` (the agent's VmHWM), ``exit_code``.

    Raises:
        DidNotComplete: it ran longer than ``timeout`` seconds (the tree is killed).
    """
    t0 = time.perf_counter()
    proc = start(which, cmd_args, log)
    sampler = PeakSampler(proc.pid)
    done = threading.Event()
    killer = threading.Timer(timeout, lambda: None if done.is_set() else kill_tree(proc.pid))
    killer.start()
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    done.set()
    killer.cancel()
    sampler.finish()
    proc.returncode = os.waitstatus_to_exitcode(status)
    if wall >= timeout:
        raise DidNotComplete(f"did not complete in {timeout:g} s")
    return {
        "wall_s": wall,
        "cpu_s": usage.ru_utime + usage.ru_stime,
        "agent_cpu_s": sampler.cpu_s,
        "agent_peak_mib": sampler.peak_kib / 1024.0,
        "exit_code": proc.returncode,
    }


@dataclass
class Metric:
    """One measured quantity of a scenario, for both launchers.

    Attributes:
        key: stable identifier (``scenario.metric``).
        label: what a reader sees in the table.
        unit: ``s``, ``MiB``, ``s/min``, ``ops`` or ``bool`` (samples 1.0 = yes, 0.0 = no).
        values: launcher -> list of samples (None: that repeat did not complete).
        notes: launcher -> why samples are missing.
        target: None, or ``{"kind": "ratio_le"|"abs_le"|"all_le"|"flat", "value": x, "text": str}``
            (``abs_le`` judges the median, ``all_le`` every repeat).
    """

    key: str
    label: str
    unit: str
    values: dict[str, list[float | None]] = field(default_factory=lambda: {w: [] for w in LAUNCHERS})
    notes: dict[str, list[str]] = field(default_factory=lambda: {w: [] for w in LAUNCHERS})
    target: dict[str, Any] | None = None

    def median(self, which: str) -> float | None:
        """Median of the completed samples of ``which``, or None when none completed."""
        done = [v for v in self.values[which] if v is not None]
        return statistics.median(done) if done else None

    def to_json(self) -> dict[str, Any]:
        out = {"key": self.key, "label": self.label, "unit": self.unit, "values": self.values,
               "notes": self.notes, "target": self.target}
        out["median"] = {w: self.median(w) for w in LAUNCHERS}
        e, t = out["median"]["elaunch"], out["median"]["torchrun"]
        out["ratio"] = (e / t) if (e is not None and t) else None
        return out


class Recorder:
    """Collects the metrics of one scenario, keyed by name, in insertion order."""

    def __init__(self, scenario: str) -> None:
        self.scenario = scenario
        self.metrics: dict[str, Metric] = {}

    def metric(self, name: str, label: str, unit: str, target: dict | None = None) -> Metric:
        key = f"{self.scenario}.{name}"
        if key not in self.metrics:
            self.metrics[key] = Metric(key, label, unit, target=target)
        return self.metrics[key]

    def add(self, name: str, which: str, value: float | None, note: str | None = None) -> None:
        m = self.metrics[f"{self.scenario}.{name}"]
        m.values[which].append(value)
        if note and note not in m.notes[which]:
            m.notes[which].append(note)


def log_line(msg: str) -> None:
    """Print a progress line to stderr (the table goes to docs/, not the terminal)."""
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def emit(meta: dict, rows: list[dict], raw, json_path: Path | None, table: str) -> None:
    """Write a side-by-side benchmark's result (``{"meta", "rows", "raw"}``) to ``json_path`` (None: nowhere) and print
    ``table`` (its rows as markdown) and ``meta["notes"]``, one line each."""
    if json_path:
        json_path.write_text(json.dumps({"meta": meta, "rows": rows, "raw": raw}, indent=1, default=str) + "\n")
    print(table)
    for note in meta.get("notes", ()):
        print(f"- {note}")
