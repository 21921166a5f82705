"""Sharded state through DCP (issue 36, "Measure"): ``python -m benchmarks.fsdp2_dcp [--smoke] [--json FILE]``.

FSDP2 (CPU, gloo) on 2 test hosts (network namespaces, ``tests/multinode/netns.py``) of 2
workers each, elaunch with ``--checkpoint-replicas=1``; the state is ``--dim``/``--layers``
of examples/fsdp2_dcp.py's model, parameters and both AdamW moments (full: 512/7, 255 MiB in
all, ~64 MiB a rank). Every row compares ways side by side in one run: interleaved
repetitions, medians, ratios. A repetition's time is the slowest rank's (every rank is
blocked until it, or waits for it at the next collective).

1. **Save, training blocked** (job A, first round; ``benchmarks/workers/fsdp2_dcp_bench.py``):
   ``dcp.save`` with ``SnapshotWriter`` (with and without ``DefaultSavePlanner(enable_plan_caching=True)``),
   ``dcp.async_save`` with ``SnapshotWriter`` (its blocking part), against ``dcp.async_save``
   to a ``FileSystemWriter`` (its blocking part: in torch 2.13 the staging copy alone, DCP's
   planning runs in its thread) and ``dcp.save`` to disk;
   DCP's planning alone is a save whose writer stores nothing (with and without plan caching).
2. **Restore after a worker SIGKILL** (job A): the driver SIGKILLs rank 1; in the restarted
   workers, the first ``dcp.load`` from ``SnapshotReader`` (the restore a restart pays), then
   loads from memory and from the disk DCP directory of the same step, interleaved.
3. **A node replaced** (job A): host 2 is killed whole (its ``/dev/shm`` dropped, as a dead
   machine's memory) and a fresh host joins; its ranks' parts come from host 1's replicas.
   The new host's ``dcp.load`` (first, then memory vs disk interleaved) and the agent's
   preparation of the round's restore (inventory exchange, plan, fetch from the peer):
   ``checkpoint_restore``'s time minus ``rendezvous_complete``'s in its event log.
4. **A node lost, not replaced** (job B, ``--nnodes=1:2``): host 2 killed, the survivor goes on
   at world 2 and reshards 4 -> 2 from its memory (own slots, replicas of host 2's ranks);
   against resharding the same step from the disk DCP directory.
5. **Goodput** (full run only): examples/fsdp2_dcp.py on the same 2 hosts (``--nnodes=2``),
   T0 uninterrupted, then under issue 24's faults (benchmarks/goodput.py): a worker SIGKILL
   every 20 s (once the group trains again), and a node killed at 40 % of T0 with a fresh
   host joining at once. Goodput = T0 / T_faulty, launch to the last agent's exit. Each fault
   twice: elaunch's full restart (every worker of the job restarted), and in-process restart
   (the example's ``--in-process``, ``@elaunch.restartable``; elaunch already runs with
   ``--warm-start``): the survivors keep their processes, a dead rank gets a new one. T0 runs
   before and after the faulty runs, and a faulty run's T0 is the mean of the uninterrupted
   runs of its way beside it; ``--gp-interleave N`` runs the faults N times, each faulty run
   followed by an uninterrupted one (the machine's speed drifts within minutes).

The disk side writes to a directory on the working directory's disk (DCP's ``FileSystemWriter``
fsyncs its files); its loads read files just written (page cache): the floor of a disk restore.
``--smoke``: tiny state, one repetition, rows 1-4 (no goodput); under a minute.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil

from benchmarks.common import REPO, DidNotComplete, emit, launcher_cmd, launcher_env, log_line
from benchmarks.goodput_hosts import shm_paths
from benchmarks.goodput_results import bracket_t0

WORKER = str(REPO / "benchmarks" / "workers" / "fsdp2_dcp_bench.py")
EXAMPLE = str(REPO / "examples" / "fsdp2_dcp.py")
STORE_PORT = 29400
RDZV_CONF = "last_call_timeout=2,join_timeout=120,keep_alive_interval=1,keep_alive_max_attempt=3,read_timeout=20"
SECRET = "benchmarks.fsdp2_dcp: the job's secret"
#: What elaunch's warm spares import in advance (--warm-start): a restarted worker skips these imports.
WARM_MODULES = "torch,torch._dynamo,torch.distributed.checkpoint,torch.distributed.fsdp"
FINAL = 100_000  # the worker's step saved last (benchmarks/workers/fsdp2_dcp_bench.py)


@dataclass(frozen=True)
class Sizes:
    dim: int
    layers: int
    heads: int
    reps: int
    gp_steps: int = 0
    kill_every: float = 20.0
    node_at: float = 0.4
    bound: float = 2.0  # a faulty goodput run may take this many T0 (benchmarks/goodput.py: 2)


FULL = Sizes(512, 7, 8, 5, gp_steps=80)
SMOKE = Sizes(64, 2, 4, 1, gp_steps=200)


def state_mib(s: Sizes) -> float:
    """Parameters and both AdamW moments of the model, MiB (float32)."""
    d = s.dim
    per_layer = 3 * d * d + 3 * d + d * d + d + 4 * d * d + 4 * d + 4 * d * d + d + 4 * d
    params = s.layers * per_layer + d * d + d
    return 3 * params * 4 / 2**20


# -- a job of agents on namespace hosts --------------------------------------------------------------------------

class Job:
    """elaunch agents on namespace hosts of one network; each agent logs to its own directory."""

    def __init__(self, netns, net, name: str, nnodes: str, workdir: Path, script_args: list[str],
                 script: str = WORKER) -> None:
        self.netns, self.net, self.name, self.nnodes = netns, net, name, nnodes
        self.workdir, self.script_args, self.script = workdir, script_args, script
        self.run_id = f"d36{os.getpid()}{name}"
        self.agents: list[dict] = []  # {"host", "proc", "log_dir", "killed"}
        self.store = None

    def start_agent(self, host=None) -> dict:
        """Start an agent in ``host`` (None: a host added now); the first one's host holds the c10d store."""
        host = self.net.add_host() if host is None else host
        if self.store is None:
            self.store = host
        log_dir = self.workdir / f"agent-h{host.index}"
        conf = f"is_host={int(host is self.store)},{RDZV_CONF},exclude_after=0"
        argv = launcher_cmd("elaunch", f"--nnodes={self.nnodes}", "--nproc-per-node=2", "--rdzv-backend=c10d",
                            f"--rdzv-endpoint={self.store.addr}:{STORE_PORT}", f"--rdzv-id={self.run_id}",
                            f"--rdzv-conf={conf}", f"--local-addr={host.addr}", "--monitor-interval=0.2",
                            "--max-restarts=100", "--checkpoint-replicas=1", f"--log-dir={log_dir}", "--warm-start",
                            f"--warm-start-modules={WARM_MODULES}",
                            self.script, *self.script_args)
        env = {**launcher_env(), "GLOO_SOCKET_IFNAME": host.ifname, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
               "ELAUNCH_JOB_SECRET": SECRET}
        with open(self.workdir / f"agent-h{host.index}.log", "ab") as f:
            proc = host.popen(argv, stdout=f, stderr=f, stdin=__import__("subprocess").DEVNULL, env=env,
                              cwd=str(REPO))
        agent = {"host": host, "proc": proc, "log_dir": log_dir, "killed": False, "exited": None,
                 "started": time.time()}
        self.agents.append(agent)
        return agent

    def live(self) -> list[dict]:
        for a in self.agents:
            if a["exited"] is None and not a["killed"] and a["proc"].poll() is not None:
                a["exited"] = time.monotonic()
        return [a for a in self.agents if not a["killed"] and a["proc"].poll() is None]

    def node_dir(self, agent: dict) -> str:
        return f"/dev/shm/elaunch-{self.run_id}-{agent['proc'].pid}"

    def kill_node(self, agent: dict, then=None, nice: int | None = None):
        """SIGKILL every process of the agent's host and drop the shared memory they held (a dead machine).

        ``then``: called as soon as the SIGKILLs are sent, before the processes are gone, and its result returned
        (:meth:`replace_node`). ``nice``: the killed processes' exit runs at that nice value (19: on idle CPU only).
        """
        held = shm_paths(agent["host"].pids()) | {self.node_dir(agent)}
        agent["killed"] = True
        killed = self.netns.sigkill_namespace_processes(agent["host"].ns, nice=nice)
        result = then() if then is not None else None
        psutil.wait_procs(killed, timeout=10)
        agent["proc"].wait(timeout=10)
        for path in held:
            shutil.rmtree(path, ignore_errors=True)
        return result

    def replace_node(self, agent: dict) -> tuple[float, float]:
        """Kill ``agent``'s host and start a fresh one's agent at once; return the kill's time and the seconds
        from it to the fresh agent's start.

        The fresh host's network is made before the kill, and the fresh agent starts as soon as the dead host's
        processes are sent SIGKILL, before they are gone and their memory is dropped, and their exit runs at nice 19:
        the harness's work, not a replacement's (a real machine's network is up before its agent starts; a dead
        one's processes need no exit, and its memory is freed on no one's CPUs).
        """
        fresh = self.net.add_host()
        t = time.time()
        started = self.kill_node(agent, then=lambda: (self.start_agent(fresh), time.time() - t)[1], nice=19)
        return t, started

    def events(self, agent: dict, kind: str) -> list[dict]:
        found = []
        for path in agent["log_dir"].glob("**/events.jsonl"):
            found += [e for e in map(json.loads, path.read_text().splitlines()) if e.get("kind") == kind]
        return sorted(found, key=lambda e: e["time"])

    def workers(self) -> list[psutil.Process]:
        """The live workers: the pids of each live agent's last ``workers_started`` event that still run."""
        out = []
        for a in self.live():
            started = self.events(a, "workers_started")
            for pid in (started[-1]["pids"] if started else []):
                try:
                    proc = psutil.Process(pid)
                    if proc.status() != psutil.STATUS_ZOMBIE:
                        out.append(proc)
                except psutil.Error:
                    pass
        return out

    def wait(self, predicate, timeout: float, what: str, interval: float = 0.1):
        deadline = time.monotonic() + timeout
        while True:
            value = predicate()
            if value:
                return value
            if not self.live():
                raise DidNotComplete(f"{self.name}: every agent exited while waiting for {what} "
                                     f"(logs: {self.workdir})")
            if time.monotonic() > deadline:
                raise DidNotComplete(f"{self.name}: no {what} in {timeout:g} s (logs: {self.workdir})")
            time.sleep(interval)

    def stop(self) -> None:
        for a in self.agents:
            if a["proc"].poll() is None:
                a["proc"].kill()
        for h in self.net.hosts:
            self.netns.kill_namespace_processes(h.ns)
        for a in self.agents:
            try:
                a["proc"].wait(timeout=10)
            except Exception:  # noqa: BLE001
                pass
            shutil.rmtree(self.node_dir(a), ignore_errors=True)


def _files(out: Path, pattern: str, n: int):
    found = sorted(p for p in out.glob(pattern) if not p.name.endswith(".tmp"))
    return found if len(found) >= n else None


def _whole_step(shm: str, step: int, world: int) -> bool:
    """Every rank's part of ``step`` (saved at ``world``) is in ``shm`` (slots and replicas)."""
    from elaunch.checkpoint import slotfile

    ranks = {i.rank for i in slotfile.inventory(shm) if i.reshardable and i.step == step and i.world_size == world}
    return ranks == set(range(world))


def _phase(out: Path, name: str) -> None:
    (out / "phase").write_text(name)


# -- jobs A and B ------------------------------------------------------------------------------------------------

def _worker_args(s: Sizes, out: Path, disk: Path) -> list[str]:
    return [str(out), str(disk), "--dim", str(s.dim), "--layers", str(s.layers), "--heads", str(s.heads),
            "--reps", str(s.reps)]


def _job_dirs(name: str, root: Path, disk_root: Path) -> tuple[Path, Path, Path]:
    """Job ``name``'s work directory, its workers' output directory (at phase p0) and its disk checkpoints'."""
    work, out, disk = root / name, root / name / "out", disk_root / name
    for d in (out, disk):
        d.mkdir(parents=True)
    _phase(out, "p0")
    return work, out, disk


def job_a(s: Sizes, root: Path, disk_root: Path) -> dict:
    """Rows 1-3: save reps, a worker SIGKILL, a node replaced."""
    from tests.multinode import netns

    work, out, disk = _job_dirs("a", root, disk_root)
    res: dict = {}
    with netns.Network("-d36a") as net:
        job = Job(netns, net, "a", "2", work, _worker_args(s, out, disk) + ["--save-reps"])
        try:
            h1, h2 = job.start_agent(), job.start_agent()
            bound = 300 + 60 * s.reps * (s.dim / 256) ** 2
            job.wait(lambda: _files(out, "ready_p0_4_*", 4), bound, "first round's saves")
            res["save"] = [json.loads(p.read_text()) for p in _files(out, "save_*.json", 4)]
            job.wait(lambda: _whole_step(job.node_dir(h1), FINAL, 4) and _whole_step(job.node_dir(h2), FINAL, 4),
                     60, "every part of the last step on both hosts (replicas)")
            log_line("job a: rows 1 done; SIGKILL of rank 1")
            _phase(out, "kill")
            os.kill(int((out / "ready_p0_4_1").read_text()), signal.SIGKILL)
            job.wait(lambda: _files(out, "ready_kill_4_*", 4), 300, "restore after the SIGKILL")
            res["kill"] = {p.name: json.loads(p.read_text()) for p in _files(out, "restore_kill_4_*.json", 4)}
            log_line("job a: row 2 done; host 2 replaced")
            _phase(out, "replace")
            t_kill = time.time()
            job.kill_node(h2)
            h3 = job.start_agent()
            job.wait(lambda: _files(out, "ready_replace_4_*", 4), 300, "restore on the replacing host")
            res["replace"] = {p.name: json.loads(p.read_text()) for p in _files(out, "restore_replace_4_*.json", 4)}
            res["replace_events"] = _restore_events(job, h3, t_kill)
            res["survivor_events"] = _restore_events(job, h1, t_kill)
            (out / "exit").touch()
            _wait_exit(job)
            res["exit_codes"] = [None if a["killed"] else a["proc"].returncode for a in job.agents]
        finally:
            job.stop()
    return res


def _wait_exit(job: Job, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while job.live() and time.monotonic() < deadline:
        time.sleep(0.2)


def _restore_events(job: Job, agent: dict, after: float) -> dict:
    """The agent's last restore after ``after``: its sources, and the seconds from the round's rendezvous to it."""
    restores = [e for e in job.events(agent, "checkpoint_restore") if e["time"] >= after]
    if not restores:
        return {}
    last = restores[-1]
    rdzv = [e for e in job.events(agent, "rendezvous_complete") if e["time"] <= last["time"]]
    return {"sources": last["sources"], "step": last["step"], "round": last.get("round"),
            "prepare_s": (last["time"] - rdzv[-1]["time"]) if rdzv else None}


def job_b(s: Sizes, root: Path, disk_root: Path) -> dict:
    """Row 4: a node lost and not replaced, 4 ranks -> 2 from memory vs from disk."""
    from tests.multinode import netns

    work, out, disk = _job_dirs("b", root, disk_root)
    res: dict = {}
    with netns.Network("-d36b") as net:
        job = Job(netns, net, "b", "1:2", work, _worker_args(s, out, disk))
        try:
            h1, h2 = job.start_agent(), job.start_agent()
            job.wait(lambda: _files(out, "ready_p0_4_*", 4), 300, "the first round's save")
            job.wait(lambda: _whole_step(job.node_dir(h1), FINAL, 4), 60, "every part on host 1 (replicas)")
            log_line("job b: host 2 lost")
            _phase(out, "lost")
            t_kill = time.time()
            job.kill_node(h2)
            job.wait(lambda: _files(out, "ready_lost_2_*", 2), 300, "the survivor's reshard")
            res["lost"] = {p.name: json.loads(p.read_text()) for p in _files(out, "restore_lost_2_*.json", 2)}
            res["survivor_events"] = _restore_events(job, h1, t_kill)
            (out / "exit").touch()
            _wait_exit(job)
            res["exit_codes"] = [None if a["killed"] else a["proc"].returncode for a in job.agents]
        finally:
            job.stop()
    return res


# -- row 5: goodput ----------------------------------------------------------------------------------------------

def _training_since(job: Job, t: float) -> bool:
    return any(e["time"] > t for a in job.live() for e in job.events(a, "training"))


#: The goodput part's faulty runs: (fault, in process), in the order they run.
GP_RUNS = {"kill": ("kill", False), "node": ("node", False), "kill-ip": ("kill", True), "node-ip": ("node", True)}
#: Runs on request only (``--gp-runs``): a node killed and a standby, waiting since the job trains, takes its place.
GP_EXTRA = {"standby": ("standby", False), "standby-ip": ("standby", True)}
_ALL_RUNS = {**GP_RUNS, **GP_EXTRA}


def goodput_run(s: Sizes, root: Path, disk_root: Path, fault: str, t0: float | None, seed: int = 0,
                in_process: bool = False, tag: str = "") -> dict:
    from tests.multinode import netns

    work = root / f"gp-{fault}{'-ip' if in_process else ''}{tag}"
    work.mkdir(parents=True)
    args = ["--steps", str(s.gp_steps), "--dim", str(s.dim), "--layers", str(s.layers), "--heads", str(s.heads),
            "--final-params", str(work / "final.sha"), "--timings", str(work / "timings"),
            "--journal", str(work / "journal")] + (["--in-process"] if in_process else [])
    row: dict = {"fault": fault, "in_process": in_process, "events": [], "note": ""}
    rng = random.Random(seed)
    with netns.Network("-d36g") as net:
        job = Job(netns, net, f"g{fault}", "2", work, args, script=EXAMPLE)
        start = time.monotonic()
        t_start = time.time()
        deadline = start + (900 if t0 is None else s.bound * t0)
        try:
            h1, h2 = job.start_agent(), job.start_agent()
            if fault == "kill":
                last = t_start
                while job.live():
                    end = time.monotonic() + s.kill_every
                    while job.live() and time.monotonic() < min(end, deadline):
                        time.sleep(0.2)
                    if time.monotonic() >= deadline or not job.live():
                        break
                    while job.live() and not _training_since(job, last) and time.monotonic() < deadline:
                        time.sleep(0.2)
                    workers = job.workers()
                    if not workers or time.monotonic() >= deadline:
                        continue
                    victim = rng.choice(workers)
                    last = time.time()
                    try:
                        victim.send_signal(signal.SIGKILL)
                        row["events"].append({"t": round(last - t_start, 2), "fault": "worker SIGKILL"})
                    except psutil.Error:
                        pass
            elif fault in ("node", "standby"):
                standby = None
                if fault == "standby":  # a third agent: on the redundancy list (the world is at --nnodes=2)
                    job.wait(lambda: _training_since(job, t_start), 300, "the job to train")
                    standby = job.start_agent()
                at = t_start + s.node_at * (t0 or 0)
                while job.live() and time.time() < at:
                    time.sleep(0.2)
                if job.live():
                    if standby is None:
                        t, started = job.replace_node(h2)
                        event = {"fault": "node killed, a fresh one joins", "agent_started_s": round(started, 3)}
                    else:
                        t = time.time()
                        job.kill_node(h2, nice=19)  # their exit on idle CPU only, as in replace_node
                        event = {"fault": "node killed, a standby takes its place",
                                 "standby_waited_s": round(t - standby["started"], 1)}
                    row["events"].append({"t": round(t - t_start, 2), **event})
            while job.live() and time.monotonic() < deadline:
                time.sleep(0.2)
            if job.live():
                row["note"] = f"did not complete in {deadline - start:.0f} s"
            job.live()
            row["exit_codes"] = [None if a["killed"] else a["proc"].returncode for a in job.agents]
            ends = [a["exited"] for a in job.agents if a["exited"] is not None]
            row["T_s"] = (max(ends) - start) if ends and not row["note"] else None
            restores = []
            for a in job.agents:
                restores += [e["sources"] for e in job.events(a, "checkpoint_restore")]
            row["restore_sources"] = restores
            row["inprocess_restarts"] = [{k: e.get(k) for k in ("time", "round", "kept", "started", "seconds")}
                                         for a in job.agents for e in job.events(a, "inprocess_restart")]
            trained = sorted(e["time"] for a in job.agents for e in job.events(a, "training"))
            for event in row["events"]:  # the fault to the group's next training (every rank's first progress)
                after = [t for t in trained if t > t_start + event["t"]]
                event["recovered_s"] = round(after[0] - t_start - event["t"], 2) if after else None
        finally:
            job.stop()
    if row["T_s"] is not None and any(c not in (0, None) for c in row["exit_codes"]):
        row["note"] = f"the job failed (exit codes {row['exit_codes']})"
        row["T_s"] = None
    sha = work / "final.sha"
    row["final_sha256"] = sha.read_text().strip() if sha.exists() else None
    row["timings"] = [json.loads(p.read_text()) for p in sorted(work.glob("timings.*.json"))]
    row.update(journal_summary(work / "journal", t_start, row["events"]))
    return row


def journal_summary(path: Path, t_start: float, events: list[dict]) -> dict:
    """What the example's ``--journal`` tells: each round's step restored, whose processes were kept,
    and what each fault in ``events`` cost.

    Returns:
        ``rounds``: per attempt, the step restored (None: a fresh start), its time after the start,
        the ranks that started and how many of them were processes of an earlier round (kept);
        and :func:`fault_costs`' keys (none when there is no journal).
    """
    if not path.exists():
        return {"rounds": []}
    recs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    rounds: dict[int, dict] = {}
    for r in recs:
        if r.get("event") != "start":
            continue
        rd = rounds.setdefault(r["attempt"], {"attempt": r["attempt"], "step": r["step"], "ranks": 0, "kept": 0,
                                              "t": round(r["time"] - t_start, 2)})
        rd["ranks"] += 1
    for attempt, rd in rounds.items():  # kept: a pid seen in an earlier attempt
        earlier = {r["pid"] for r in recs if r.get("event") == "start" and r["attempt"] < attempt}
        rd["kept"] = sum(1 for r in recs if r.get("event") == "start" and r["attempt"] == attempt
                         and r["pid"] in earlier)
    return {"rounds": [rounds[k] for k in sorted(rounds)], **fault_costs(recs, rounds, t_start, events),
            **window_costs(recs, t_start, events)}


def window_costs(recs: list[dict], t_start: float, events: list[dict]) -> dict:
    """The same faults' costs read as ``benchmarks.goodput`` reads its own (``goodput_results.in_run`` over each
    step's last end, 40 steps after each fault, fewer when the next fault comes first).

    :func:`fault_costs` keys rounds by the journal's attempt, which an in-process node replacement leaves
    unchanged (the survivors' agents see a membership change: no restart is counted), so it reads no cost
    there; and it stops at the first step after the restore, so slower steps after it (a replacement's
    first saves) are not counted. This reading needs neither, but it also sums the steps' own
    scatter over its window: with the FSDP2 example's 1.1-1.4 s steps under kills 20 s apart it
    spread wider than :func:`fault_costs` (session 33's runs, read again: single costs from -1.1 s),
    so it is reported beside it, not instead. A step's world size is that of its process's latest
    ``start`` record.

    Returns:
        ``fault_costs_window_s`` (one per fault, seconds or None) and ``goodput_in_run_window``: 1 - their
        sum / the run's length (the last step's end less ``t_start``), None when a cost is None.
    """
    from benchmarks.goodput_results import in_run

    world: dict[int, int] = {}
    records = []
    for r in recs:
        if r.get("event") == "start":
            world[r["pid"]] = r.get("world_size", 0)
        elif r.get("event") == "step":
            records.append((r["time"], r["step"], world.get(r.get("pid"), 0)))
    length = max((t for t, _s, _w in records), default=t_start) - t_start
    got = in_run(records, [t_start + e["t"] for e in events], length)
    return {"fault_costs_window_s": got["fault_costs_s"], "goodput_in_run_window": got["goodput_in_run"]}


def fault_costs(recs: list[dict], rounds: dict[int, dict], t_start: float, events: list[dict]) -> dict:
    """What each fault cost, read from the faulty run's own steps (the journal's ``step`` records).

    A step's end is its last rank's record (attempt, step). The step time is the median of the gaps
    between consecutive ends within an attempt. A fault at time ``k`` is followed by the first
    attempt that starts after it, which restored step ``R``: the fault cost the time from R's end
    (in the attempt before) to R + 1's end in that attempt, less one step time; this holds the
    restart, the interrupted step's lost work and a slower first step. ``None`` when R + 1 did not
    end in that attempt (another fault came first).

    Returns:
        ``step_s``: the step time; ``fault_costs_s``: one cost per fault event, in their order;
        ``goodput_in_run``: 1 - (the costs' sum) / (the run's length, the last step's end less
        ``t_start``), an estimate of T0 / T that needs no uninterrupted run (None when a cost is None).
    """
    ends: dict[tuple[int, int], float] = {}
    for r in recs:
        if r.get("event") == "step":
            key = (r["attempt"], r["step"])
            ends[key] = max(ends.get(key, 0.0), r["time"])
    if not ends:
        return {"step_s": None, "fault_costs_s": [], "goodput_in_run": None}
    gaps = [t - ends[(a, st - 1)] for (a, st), t in ends.items() if (a, st - 1) in ends]
    step_s = statistics.median(gaps) if gaps else None
    costs: list[float | None] = []
    for event in events:
        k = t_start + event["t"]
        after = [a for a in sorted(rounds) if rounds[a]["t"] + t_start > k and rounds[a]["step"] is not None]
        if not after or step_s is None:
            costs.append(None)
            continue
        attempt, restored = after[0], rounds[after[0]]["step"]
        before = [t for (a, st), t in ends.items() if st == restored and a < attempt]
        done = ends.get((attempt, restored + 1))
        costs.append(round(done - max(before) - step_s, 3) if before and done is not None else None)
    length = max(ends.values()) - t_start
    whole = costs and all(c is not None for c in costs)
    return {"step_s": step_s, "fault_costs_s": costs,
            "goodput_in_run": (1 - sum(costs) / length) if whole else None}


def goodput(s: Sizes, root: Path, disk_root: Path, runs: tuple[str, ...] = tuple(GP_RUNS),
            reference: list[dict] | None = None, interleave: int = 0) -> list[dict]:
    """T0 before and after the faulty runs (the machine's load drifts), then ``runs`` (``GP_RUNS``' keys: kill
    and node with elaunch's full restart, kill-ip and node-ip in process); a faulty run's T0 is the mean of
    the uninterrupted runs of its way nearest before and after it (``goodput_results.bracket_t0``).

    Each way has T0 runs of its own (the in-process ones with ``--in-process`` and no fault: the decorator's
    ``gc.freeze`` alone may change the step time). ``reference``: an earlier result's uninterrupted rows,
    taken instead of running them (same sizes). ``interleave``: ``runs`` that many times, each faulty run
    followed by an uninterrupted run of its way (0: one uninterrupted run of each way before all the faulty
    runs and one after).
    """
    ways = list(dict.fromkeys(_ALL_RUNS[name][1] for name in runs)) or [False]
    base: dict[bool, list[dict]] = {w: [] for w in ways}
    rows: list[dict] = []

    def uninterrupted(when: str, only=None) -> None:
        for w in ways if only is None else [only]:
            log_line(f"goodput: uninterrupted{' in process' if w else ''} ({when})")
            r = goodput_run(s, root / when, disk_root, "none", None, in_process=w)
            r["when"] = when
            base[w].append(r)
            rows.append(r)

    if reference:
        for r in reference:
            if r["fault"] == "none" and r.get("in_process", False) in base:
                base[r.get("in_process", False)].append({**r, "reference": True})
                rows.append({**r, "reference": True})
    else:
        uninterrupted("before")
    if not all(any(r["T_s"] is not None for r in base[w]) for w in ways):
        return rows
    for rep in range(max(1, interleave)):
        for name in runs:
            fault, in_process = _ALL_RUNS[name]
            t0_last = next(r["T_s"] for r in reversed(base[in_process]) if r["T_s"] is not None)
            log_line(f"goodput: {name} (T0 {t0_last:.1f} s)")
            tag = f"-{rep + 1}" if interleave else ""
            rows.append(goodput_run(s, root, disk_root, fault, t0_last, in_process=in_process, tag=tag))
            if interleave:
                uninterrupted(f"after-{name}{tag}", in_process)
    if not reference and not interleave:
        uninterrupted("after")
    if not reference or interleave:
        bracket_t0(rows, lambda r: r.get("in_process", False))
    sha = next((r["final_sha256"] for w in ways for r in base[w] if r["final_sha256"]), None)
    for row in rows:
        if row["fault"] == "none":
            continue
        if reference and not interleave:  # another time's runs: none is nearer than another
            row["T0_s"] = statistics.median(r["T_s"] for r in base[row["in_process"]] if r["T_s"] is not None)
            row["goodput"] = row["T0_s"] / row["T_s"] if row["T_s"] else None
        row["bit_identical"] = row["final_sha256"] == sha if row["final_sha256"] and sha else None
    return rows


# -- the rows ----------------------------------------------------------------------------------------------------

def _per_rep_max(docs: list[dict], key: str) -> list[float]:
    """Each repetition's slowest rank."""
    series = [d[key] for d in docs if d.get(key)]
    return [max(vals) for vals in zip(*series)] if series else []


def _med(xs):
    return statistics.median(xs) if xs else None


def rows_of(res: dict) -> list[dict]:
    rows = []

    def row(key, label, samples, base_key=None, target=None, unit="s"):
        rows.append({"key": key, "label": label, "unit": unit, "values": samples, "median": _med(samples),
                     "vs": base_key, "target": target})

    saves = res.get("a", {}).get("save", [])
    if saves:
        labels = {"snapshot": "dcp.save, SnapshotWriter (committed on return; DCP's planning collectives included)",
                  "snapshot_cached": "dcp.save, SnapshotWriter, plan caching",
                  "snapshot_async_blocking": "dcp.async_save, SnapshotWriter: blocking part (committed on return)",
                  "fs_async_blocking": "dcp.async_save, FileSystemWriter: blocking part (torch 2.13: the staging copy; "
                                       "DCP plans in its thread)",
                  "fs_sync": "dcp.save, FileSystemWriter (disk)",
                  "null": "DCP planning alone (a writer that stores nothing)",
                  "null_cached": "DCP planning alone, plan caching",
                  "snapshot_async_total": "dcp.async_save, SnapshotWriter: to DCP's planning done (committed before)",
                  "fs_async_total": "dcp.async_save, FileSystemWriter: to durable"}
        for k, label in labels.items():
            target = ({"kind": "ratio_le", "value": 1.0, "text": "<= async_save-to-disk's blocking part, committed"}
                      if k == "snapshot_async_blocking" else None)
            row(f"save.{k}", label, _per_rep_max(saves, k), "save.fs_async_blocking", target)
        uncommitted = sum(d.get("async_uncommitted", 0) for d in saves)
        res.setdefault("notes", []).append(f"dcp.async_save with SnapshotWriter: {uncommitted} of "
                                           f"{sum(d.get('async_checked', 0) for d in saves)} returns (all ranks) "
                                           f"found the step not yet committed in the rank's slot")
        if uncommitted:
            for r in rows:
                if r["key"] == "save.snapshot_async_blocking":
                    r["target"] = {**r["target"], "text": r["target"]["text"] + " (NOT committed on some returns)"}
        errors = {k: v for d in saves for k, v in d.get("errors", {}).items()}
        if errors:
            res.setdefault("notes", []).append(f"save ways that failed: {errors}")
    for phase, ranks_label in (("kill", "all 4 ranks"), ("replace", "the new host's ranks"), ("lost", "2 survivors")):
        job = res.get("b" if phase == "lost" else "a", {})
        docs = job.get(phase)
        if not docs:
            continue
        if phase == "replace":
            new_ranks = set(job.get("replace_events", {}).get("sources", {}))
            docs = {n: d for n, d in docs.items() if n.rsplit("_", 1)[1].split(".")[0] in new_ranks} or docs
        ds = list(docs.values())
        what = {"kill": "restore after a worker SIGKILL", "replace": "node replaced, new host",
                "lost": "node lost, 4 -> 2 resharded"}[phase]
        target = {"kind": "ratio_le", "value": 0.5, "text": "<= 0.5x dcp.load from disk"} if phase == "kill" else None
        row(f"{phase}.first", f"{what}: first dcp.load, SnapshotReader ({ranks_label}, source "
            f"{sorted({d['source'] for d in ds})})", [max(d["first"] for d in ds)], f"{phase}.disk")
        row(f"{phase}.memory", f"{what}: dcp.load, SnapshotReader", _per_rep_max(ds, "memory"), f"{phase}.disk", target)
        row(f"{phase}.disk", f"{what}: dcp.load from the disk DCP checkpoint", _per_rep_max(ds, "disk"))
        unequal = sorted({k for d in ds for k in d.get("unequal_to_disk", [])})
        if unequal or any("unequal_to_disk" not in d for d in ds):
            res.setdefault("notes", []).append(f"{what}: the memory restore differs from the disk load in "
                                               f"{unequal[:5]} ({len(unequal)} tensors)")
        ev = job.get("replace_events" if phase == "replace" else "survivor_events", {})
        if ev.get("prepare_s") is not None:
            row(f"{phase}.agent_prepare", f"{what}: agent's restore preparation (exchange, plan, fetch; "
                f"sources {ev.get('sources')})", [ev["prepare_s"]])
    by = {r["key"]: r for r in rows}
    for r in rows:
        base = by.get(r["vs"]) if r["vs"] else None
        r["ratio"] = (r["median"] / base["median"]) if base and r["median"] is not None and base["median"] else None
        t = r["target"]
        r["met"] = None if not t else (r["ratio"] is not None and r["ratio"] <= t["value"]
                                       and "NOT committed" not in t["text"])
    for ip in (False, True):
        t0s = [g["T_s"] for g in res.get("goodput", []) if g["fault"] == "none" and g.get("in_process", False) == ip]
        shas = {g["final_sha256"] for g in res.get("goodput", []) if g["fault"] == "none"}
        if t0s:
            rows.append({"key": "goodput.T0" + ("_inprocess" if ip else ""),
                         "label": f"goodput: uninterrupted run{', --in-process' if ip else ''} (T0; before, "
                         f"between and after the faulty runs; the uninterrupted runs' digests: {len(shas)})",
                         "unit": "s", "values": t0s, "median": _med([t for t in t0s if t is not None]), "vs": None,
                         "target": None, "ratio": None, "met": None})
    faulty: dict[str, list[dict]] = {}  # a fault's runs (several with --gp-interleave), in run order
    for g in res.get("goodput", []):
        if g["fault"] != "none":
            faulty.setdefault(f"{g['fault']}{'_inprocess' if g.get('in_process') else ''}", []).append(g)
    label = {"kill": "goodput: a worker SIGKILL every 20 s", "node": "goodput: a node killed, a fresh one joins",
             "standby": "goodput: a node killed, a standby node (waiting since the job trains) takes its place"}
    for suffix, gs in faulty.items():
        g0 = gs[0]
        pcts = [g["goodput"] * 100 if g.get("goodput") else None for g in gs]
        read = [p for p in pcts if p is not None]
        how = "in-process restart" if g0.get("in_process") else "full restart"
        rec = [e["recovered_s"] for g in gs for e in g["events"] if e.get("recovered_s") is not None]
        recovery = f"fault to training again: median {_med(rec):.1f} s" if rec else "recovery not read"
        rounds = [r for g in gs for r in g.get("rounds", [])[1:]]
        kept = f"; processes kept: {sum(r['kept'] for r in rounds)} of {sum(r['ranks'] for r in rounds)}" \
            if rounds else ""
        notes = "".join(f"; {g['note']}" for g in gs if g.get("note"))
        faults = "/".join(str(len(g["events"])) for g in gs)
        t0 = "each against the uninterrupted runs beside it" if any(len(g.get("T0_runs_s", [])) == 2 for g in gs) \
            else "against the uninterrupted runs"
        same = [g.get("bit_identical") for g in gs]
        rows.append({"key": f"goodput.{suffix}",
                     "label": f"{label[g0['fault']]}, {how} ({faults} faults; {t0}; {recovery}{kept}; "
                     f"bit-identical: {same[0] if len(set(same)) == 1 else same}{notes})", "unit": "%",
                     "values": pcts, "median": _med(read), "vs": None, "ratio": None,
                     "target": {"kind": "abs_ge", "value": 95, "text": ">= 95 %"},
                     "met": bool(read) and _med(read) >= 95})
        for key, costs_key, how_read in (
                ("goodput_in_run", "fault_costs_s", "1 - the faults' cost / its length (step "
                 + "/".join(f"{g.get('step_s') or 0:.2f}" for g in gs) + " s"),
                ("goodput_in_run_window", "fault_costs_window_s", "40 steps after each fault (goodput_results.in_run")):
            own = [g[key] * 100 for g in gs if g.get(key) is not None]
            if not own:  # no fault's cost read
                continue
            costs = [c for g in gs if g.get(key) is not None for c in g[costs_key]]
            rows.append({"key": f"{key}.{suffix}",
                         "label": f"{label[g0['fault']]}, {how}: from the run's own steps, {how_read}; cost of a fault: "
                         f"median {_med(costs):.2f} s, range {min(costs):.2f}-{max(costs):.2f} s; an estimate "
                         "without T0, not the target's measure)", "unit": "%", "values": own, "median": _med(own),
                         "vs": None, "ratio": None, "target": None, "met": None})
    return rows


def fmt(v, unit: str) -> str:
    if v is None:
        return "—"
    if unit == "%":
        return f"{v:.1f} %"
    return f"{v * 1000:.0f} ms" if v < 1 else f"{v:.2f} s"


def markdown(rows: list[dict]) -> str:
    lines = ["| row | median | ratio | target |", "|---|---|---|---|"]
    for r in rows:
        ratio = f"{r['ratio']:.2f}× {r['vs'].split('.', 1)[1]}" if r["ratio"] is not None else ""
        target = "" if not r["target"] else f"{r['target']['text']}: {'met' if r['met'] else 'not met'}"
        n = len([v for v in r["values"] if v is not None])
        lines.append(f"| {r['label']} | {fmt(r['median'], r['unit'])} (n={n}) | {ratio} | {target} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.fsdp2_dcp", description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny state, one repetition, no goodput (< 60 s)")
    p.add_argument("--json", type=Path, default=None, help="write the result here")
    p.add_argument("--work-dir", type=Path, default=None, help="keep logs here (default: a temporary directory)")
    p.add_argument("--only", default=None, help="which parts: a (rows 1-3), b (row 4), goodput (default all; "
                                                "--smoke: a,b; named, goodput runs with --smoke's sizes too)")
    p.add_argument("--reps", type=int, default=None)
    p.add_argument("--gp-steps", type=int, default=None, help="the goodput runs' --steps")
    p.add_argument("--gp-reference", type=Path, default=None, metavar="JSON",
                   help="take the goodput part's uninterrupted runs (T0, digest) from this earlier --json result "
                        "instead of running them (same sizes)")
    p.add_argument("--gp-interleave", type=int, default=0, metavar="N",
                   help="the goodput part's faulty runs N times, each followed by an uninterrupted run of its way; "
                        "a faulty run's T0 is the mean of the uninterrupted runs beside it (default 0: one "
                        "uninterrupted run of each way before all the faulty runs and one after)")
    p.add_argument("--gp-runs", default=",".join(GP_RUNS),
                   help="the goodput part's faulty runs, in order (default kill,node,kill-ip,node-ip: each fault "
                        "with elaunch's full restart, then in process (-ip, the example's --in-process)); also "
                        "standby and standby-ip: a node killed, a third agent waiting since the job trains takes "
                        "its place")
    a = p.parse_args(argv)
    runs = tuple(x for x in a.gp_runs.split(",") if x)
    bad = [x for x in runs if x not in _ALL_RUNS]
    if a.gp_interleave < 0:
        p.error(f"--gp-interleave: {a.gp_interleave} is negative")
    if bad:
        p.error(f"--gp-runs: unknown {bad} (known: {', '.join(_ALL_RUNS)})")
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    from benchmarks import run as suite
    from tests.multinode import netns

    reason = netns.unavailable_reason()
    if reason:
        raise SystemExit(f"fsdp2_dcp: cannot build test hosts: {reason}")
    netns.cleanup_stale()
    s = SMOKE if a.smoke else FULL
    if a.reps or a.gp_steps:
        given = {"reps": a.reps, "gp_steps": a.gp_steps}
        s = Sizes(**{**asdict(s), **{k: v for k, v in given.items() if v}})
    parts = [x for x in (a.only or ("a,b" if a.smoke else "a,b,goodput")).split(",") if x]
    t_begin, load_start = time.monotonic(), suite._loadavg()
    res: dict = {"notes": []}
    with tempfile.TemporaryDirectory(prefix="elaunch-d36-") as tmp, \
            tempfile.TemporaryDirectory(prefix="elaunch-d36-disk-", dir=str(REPO)) as disk_root:
        root = a.work_dir.resolve() if a.work_dir else Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        def one(part, fn):
            log_line(f"job {part}")
            try:
                res[part] = fn(s, root, Path(disk_root))
            except DidNotComplete as exc:
                res["notes"].append(str(exc))
                log_line(str(exc))

        jobs = [(part, fn) for part, fn in (("a", job_a), ("b", job_b)) if part in parts]
        if a.smoke:  # side by side: the smoke proves the paths, it measures nothing (< 60 s)
            threads = [threading.Thread(target=one, args=job) for job in jobs]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        else:  # one after the other: a job's measurements do not share the CPUs with another's
            for job in jobs:
                one(*job)
        if "goodput" in parts:
            reference = None
            if a.gp_reference:
                earlier = json.loads(a.gp_reference.read_text())
                if {k: v for k, v in earlier["meta"]["sizes"].items() if k != "state_mib"} != asdict(s):
                    p.error(f"--gp-reference {a.gp_reference}: other sizes ({earlier['meta']['sizes']})")
                reference = earlier["raw"].get("goodput", [])
            res["goodput"] = goodput(s, root, Path(disk_root), runs, reference, a.gp_interleave)
        else:
            res["notes"].append("goodput: not run (--smoke, or --only without it)")
    rows = rows_of(res)
    torch_v, elaunch_v = suite._versions()
    meta = {"command": "python -m benchmarks.fsdp2_dcp" + ("" if len(sys.argv) < 2 else " " + " ".join(sys.argv[1:])),
            "date": time.strftime("%Y-%m-%d %H:%M %Z"), "machine": suite._machine(), "torch": torch_v,
            "elaunch": elaunch_v, "commit": suite._commit(), "loadavg_start": load_start,
            "loadavg_end": suite._loadavg(), "duration_s": time.monotonic() - t_begin,
            "sizes": {**asdict(s), "state_mib": round(state_mib(s), 1)}, "notes": res.pop("notes")}
    emit(meta, rows, res, a.json, markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
