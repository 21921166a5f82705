"""How soon a slowed node is named a straggler (issue 26): the time from a CPU cap to the verdict.

Scenario ``straggler``: 3 test hosts (network namespaces, ``tests/multinode/netns.py``) run
elaunch (c10d, one gloo worker each: ``tests/scripts/straggler_worker.py``, an all-reduce
then 20 ms of CPU per step, ``elaunch.progress(step=)``); each repeat is a fresh network and
job. Once the group trains and two windows passed, the third host's worker is put into a
cgroup capped at 10 % of a CPU (the cgroup ``cpu`` controller; v1 or v2). The row is the
seconds from the cap to the last node's ``straggler`` event naming that worker's rank (every
node judges alike, each writes it), for ``straggler_window`` 2 s and the default 10 s.
The verdict needs ``straggler_windows`` (2) windows in a row, so its bound is 3 windows
(a cap in the middle of a window leaves that window partly healthy).

torchrun names no stragglers: its cells say so.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from benchmarks.common import REPO, DidNotComplete, Recorder, launcher_cmd, launcher_env
from benchmarks.scenarios import BenchConfig

#: The c10d store's port on the first host (each repeat has a network of its own).
STORE_PORT = 29400
WORKER = str(REPO / "tests" / "scripts" / "straggler_worker.py")
#: straggler_window values measured, seconds.
WINDOWS = (2.0, 10.0)
NONE = "torchrun names no stragglers"


def _cap(pid: int, share: float) -> Path:
    """Move ``pid`` into a new cgroup capped at ``share`` of a CPU; return the cgroup's directory."""
    period = 100_000
    v1 = Path("/sys/fs/cgroup/cpu")
    if (v1 / "cpu.cfs_quota_us").exists():
        path = v1 / f"elt-{os.getpid()}-bench-straggler"
        path.mkdir(exist_ok=True)
        (path / "cpu.cfs_period_us").write_text(str(period))
        (path / "cpu.cfs_quota_us").write_text(str(int(share * period)))
    else:
        path = Path("/sys/fs/cgroup") / f"elt-{os.getpid()}-bench-straggler"
        path.mkdir(exist_ok=True)
        (path / "cpu.max").write_text(f"{int(share * period)} {period}")
    (path / "cgroup.procs").write_text(str(pid))
    return path


def _uncap(path: Path) -> None:
    root = path.parent
    for pid in (path / "cgroup.procs").read_text().split():
        try:
            (root / "cgroup.procs").write_text(pid)
        except OSError:
            pass
    deadline = time.monotonic() + 10
    while (path / "cgroup.procs").read_text().split() and time.monotonic() < deadline:
        time.sleep(0.1)
    path.rmdir()


def _named_at(log_dir: Path, rank: int) -> float | None:
    for events in log_dir.rglob("events.jsonl"):
        for line in events.read_text(errors="replace").splitlines():
            e = json.loads(line)
            if e["kind"] == "straggler" and rank in e.get("stragglers", ()):
                return e["time"]
    return None


def _wait(pred, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(0.1)
    raise DidNotComplete(f"{what}: not within {timeout:g} s")


def _one_job(netns, window: float, work: Path) -> float:
    """Run one job; the seconds from the cap to the last node's verdict."""
    with netns.Network("-st") as net:
        hosts = [net.add_host() for _ in range(3)]
        procs = []
        for h in hosts:
            args = ["--nnodes=3", "--nproc-per-node=1", "--rdzv-backend=c10d",
                    f"--rdzv-endpoint={hosts[0].addr}:{STORE_PORT}", f"--rdzv-id=bench-st-{work.name}",
                    f"--rdzv-conf=straggler_window={window:g}", f"--local-addr={h.addr}",
                    f"--log-dir={work / h.addr}", WORKER, str(work), "cpu", "0.02"]
            env = {**launcher_env(), "GLOO_SOCKET_IFNAME": h.ifname, "MN_HOST": h.addr}
            with open(work / f"{h.addr}.log", "ab") as f:
                procs.append(h.popen(launcher_cmd("elaunch", *args), stdout=f, stderr=f, env=env))
        cgroup = None
        try:
            slow = hosts[2]
            _wait(lambda: (work / "training").exists() and (work / f"pid_{slow.addr}_0").exists(), 120, "training")
            time.sleep(2 * window)  # two healthy windows first (the verdict must come from the cap)
            if any(_named_at(work / h.addr, 2) for h in hosts):
                raise DidNotComplete("a rank was named before the cap")
            pid = int((work / f"pid_{slow.addr}_0").read_text())
            rank = int(dict(kv.split("=", 1) for kv in Path(f"/proc/{pid}/environ").read_bytes().decode()
                            .split("\0") if "=" in kv)["RANK"])
            cgroup = _cap(pid, 0.1)
            capped = time.time()
            named = _wait(lambda: all(_named_at(work / h.addr, rank) for h in hosts) and
                          [_named_at(work / h.addr, rank) for h in hosts], 3 * window + 10, "the verdict on every node")
            (work / "stop").touch()
            deadline = time.monotonic() + 60
            for p in procs:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
        finally:
            for p in procs:
                p.kill()
                p.wait()
            if cgroup is not None:
                _uncap(cgroup)
        return max(named) - capped


def bench_straggler(cfg: BenchConfig) -> tuple[list[Recorder], list[str]]:
    """The rows of the module docstring, ``cfg.repeat`` jobs per window.

    Returns:
        The recorder (an empty list when the hosts cannot be built) and notes for the report.
    """
    from tests.multinode import netns  # the test hosts: the same code the multi-node tests use

    reason = netns.unavailable_reason()
    if reason:
        return [], [f"straggler: skipped ({reason})"]
    netns.cleanup_stale()
    rec = Recorder("straggler")
    for w in WINDOWS:
        rec.metric(f"cap_to_verdict_{w:g}", f"straggler named after a 10 % CPU cap, 3 hosts, straggler_window={w:g} s: "
                   "cap -> every node's verdict", "s", {"kind": "abs_le", "value": 3 * w, "text": f"<= 3 windows "
                                                        f"({3 * w:g} s)"})
    for i in range(cfg.repeat):
        for w in WINDOWS:
            work = cfg.scratch(f"straggler_{w:g}_{i}")
            try:
                rec.add(f"cap_to_verdict_{w:g}", "elaunch", _one_job(netns, w, work))
            except DidNotComplete as exc:
                rec.add(f"cap_to_verdict_{w:g}", "elaunch", None, str(exc))
    for m in rec.metrics.values():
        m.notes["torchrun"].append(NONE)
    return [rec], []
