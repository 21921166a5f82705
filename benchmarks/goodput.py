"""Goodput under faults: ``python -m benchmarks.goodput [--quick] [--json FILE]`` (issue 24, "Measure").

examples/ddp_digits.py with a 256 MiB state (``--state-mib``) trains on 3 test hosts
(network namespaces, one worker each, c10d rendezvous on the first host, ``--nnodes=2:3``)
for about 3 minutes, under three configurations:

* ``a``: elaunch, ``ckpt.save`` every step (``--snapshot-every 1 --no-disk-checkpoint``;
  ``--checkpoint-dir`` unset: nothing persisted, restores come from memory and peers' replicas);
* ``b``: elaunch, the example's per-epoch ``torch.save`` only (``--snapshot-every 0``);
* ``c``: torchrun, the same per-epoch ``torch.save`` and the same flags;
* ``d``: configuration a plus the example's ``--in-process`` (``@elaunch.restartable``,
  elaunch only, always with ``--warm-start``): after a fault the survivors keep their
  processes and only a dead rank gets a new one. ``--configs a,d`` compares the two.

elaunch runs with ``--warm-start`` (its spares import torch and scikit-learn; ``--no-warm-start``
turns it off). Each configuration runs once uninterrupted (T0), then under each fault:

* ``kill``: a worker SIGKILL every 20 s (a host drawn with the benchmark's seeded RNG, its
  worker killed once the group trains; the next kill 20 s later, once the new group trains);
* ``node``: at 40 % of T0 one node other than the store's is killed outright (every
  process in its namespace; its ``/dev/shm`` entries removed, as a dead machine's memory
  would be) and a fresh host with a new agent joins at once;
* ``standby`` (on request): the same kill, but the node that takes its place is a standby: a
  fourth agent, started once the group trains, waiting on the rendezvous' redundancy list
  (the world is at ``--nnodes``' maximum) with its warm spare, as a cluster's hot spare would.

Goodput = T0 / T_faulty (launch to the last agent's exit). ``--interleave N`` runs each
fault N times, each faulty run followed by an uninterrupted one, and a faulty run's T0 is
then the mean of the uninterrupted runs beside it (``goodput_results.bracket_t0``): the
machine's speed drifts by several percent within minutes. Beside it, the in-run estimate
(``goodput_results.in_run``): each fault's cost read from the faulty run's own step times
(``fault_costs_s``), and ``1 - their sum / T_faulty``; two runs on this shared machine differ
by seconds in their start-up and by percents in their step time, which T0 / T counts as the
faults'. A faulty run is bounded by
``Sizes.bound`` x T0 (2 in full mode): a run that needs longer is "did not complete", i.e.
a goodput below 1 / bound. Steps lost per restart (configurations a-c) = the
steps the group had started when it stopped (the worker's step counter) minus the step it
resumed from (the example's ``resumed from ... at epoch E step S`` line). Bit-identical: the
final parameters' SHA-256 (``--final-params``) against the same configuration's T0 run
(a run whose world size changed differs by design: reported, not failed).

In process (configuration d) a survivor's rank 0 keeps its process, so a group start is
not a new rank-0 process: its restarts, steps lost and recoveries are read from the agents'
event logs instead (``events``: per restart, the step the group had started, from the
``restart`` event, against the step restored, from ``checkpoint_restore``; recovery: from
the fault to the last agent's ``training`` event of the next round that trained). Every
elaunch row carries that reading too, so a and d compare by the same method.

"Nothing lost" (``--lost``, on by default with configuration a): ``--nnodes=3`` (the world
stays 3), 6 worker SIGKILLs at random points, every second one aimed at a save in
progress (a slot header's seq is odd, ``elaunch.checkpoint.slotfile.seq_of``), one node
replaced after the third, and after the node one rank whose training raises (the example's
``--crash-file``: the driver names a live rank, that rank raises before its next step); the
final parameters must equal the uninterrupted run's.

Prints a markdown table; ``--json FILE`` writes the rows and, for ``python -m
benchmarks.report``, a ``goodput`` scenario (elaunch a/b vs torchrun c).
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import random
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks.common import DidNotComplete, log_line
from benchmarks.goodput_hosts import Cluster
from benchmarks.goodput_results import (attempts, bracket_t0, fmt_s, in_run, markdown, read_steps, report_scenario,
                                        summarize)



@dataclass(frozen=True)
class Config:
    name: str
    launcher: str
    label: str
    args: tuple[str, ...]


CONFIGS = {
    "a": Config("a", "elaunch", "elaunch, ckpt.save every step", ("--snapshot-every", "1", "--no-disk-checkpoint")),
    "b": Config("b", "elaunch", "elaunch, per-epoch torch.save", ("--snapshot-every", "0")),
    "c": Config("c", "torchrun", "torchrun, per-epoch torch.save", ("--snapshot-every", "0")),
    "d": Config("d", "elaunch", "elaunch in process (--in-process), ckpt.save every step",
                ("--snapshot-every", "1", "--no-disk-checkpoint", "--in-process")),
}
#: Configurations that restart in process: their rows are read from the event logs (see the docstring).
IN_PROCESS = {"d"}
FAULTS = {"kill": "a worker SIGKILL every {every:g} s", "node": "a node killed, a fresh one joins",
          "standby": "a node killed, a standby takes its place"}


@dataclass(frozen=True)
class Sizes:
    """How big a run is: the example's flags and the faults' timing (seconds)."""

    state_mib: int
    epochs: int
    step_sleep: float
    kill_every: float
    node_at: float  # fraction of T0
    lost_kills: int
    lost_gap: tuple[float, float]
    bound: float  # a faulty run may take this many T0
    kills: int = 0  # at most this many worker SIGKILLs in the kill fault (0: until the job ends)

    def example_args(self, seed: int, workdir: Path) -> list[str]:
        return ["--epochs", str(self.epochs), "--step-sleep", str(self.step_sleep), "--state-mib",
                str(self.state_mib), "--seed", str(seed), "--checkpoint", str(workdir / "checkpoint.pt"),
                "--final-params", str(workdir / "final.json"), "--crash-file", str(workdir / "crash")]


FULL = Sizes(256, 27, 0.3, 20.0, 0.4, 6, (8.0, 16.0), 2.0)
QUICK = Sizes(16, 6, 0.25, 10.0, 0.4, 2, (4.0, 6.0), 4.0, kills=2)


class JobEnded(Exception):
    """Every agent exited: no more faults to inject."""


def _wait(cluster: Cluster, predicate, timeout: float, what: str, interval: float = 0.1):
    """Poll ``predicate()`` (reading the agents' output meanwhile) until truthy; return its value.

    Raises:
        JobEnded: every agent exited first. DidNotComplete: ``timeout`` seconds passed.
    """
    deadline = min(time.monotonic() + timeout, cluster.deadline)
    while True:
        cluster.poll()
        value = predicate()
        if value:
            return value
        if not cluster.live_agents():
            raise JobEnded
        if time.monotonic() > deadline:
            if deadline == cluster.deadline:
                raise DidNotComplete(f"did not complete in {cluster.deadline - cluster.t_mono:.0f} s (waiting for {what})")
            raise DidNotComplete(f"did not complete in {timeout:g} s ({what})")
        time.sleep(interval)


def _pause(cluster: Cluster, seconds: float) -> None:
    end = time.monotonic() + seconds
    _wait(cluster, lambda: time.monotonic() >= end, seconds + 1, "a pause")


def _kill_one(cluster: Cluster, rng: random.Random, aim_at_save: bool = False) -> dict:
    """SIGKILL the worker of a random live host once the group trains; return the event."""
    hosts = sorted({a.host.index for a in cluster.live_agents()})
    if not hosts:  # the job ended during the pause before this kill
        raise JobEnded
    index = rng.choice(hosts)
    worker = _wait(cluster, lambda: cluster.training() and cluster.live_worker(index), 300, "a worker to kill")
    event = {"t": time.time(), "fault": "worker SIGKILL", "host": index, "rank": worker.rank, "pid": worker.pid}
    if aim_at_save:
        agent = next(a for a in cluster.live_agents() if a.host.index == index)
        event["during_save"] = kill_during_save(cluster.node_dir(agent), worker.pid)
    else:
        cluster.kill_worker(worker)
    return event


def kill_during_save(node_dir: Path, pid: int, timeout: float = 5.0) -> bool | None:
    """SIGKILL ``pid`` while its slot's seq is odd (a save under way); True if the slot stayed torn.

    Returns None when there are no slot files to watch (the worker was killed anyway).
    """
    from elaunch.checkpoint.slotfile import seq_of

    maps = []
    for path in sorted((node_dir / "slots").glob("0.[01]")):
        try:
            with open(path, "rb") as f:
                maps.append(mmap.mmap(f.fileno(), 64, prot=mmap.PROT_READ))
        except (OSError, ValueError):
            pass
    caught = None
    deadline = time.monotonic() + timeout
    while maps and caught is None and time.monotonic() < deadline:
        caught = next((m for m in maps if seq_of(m) % 2), None)
        if caught is None:
            time.sleep(0.0005)
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    torn = None if not maps else bool(caught is not None and seq_of(caught) % 2)
    for m in maps:
        m.close()
    return torn


def fault_kill(cluster: Cluster, rng: random.Random, sizes: Sizes, t0: float, events: list) -> None:
    """A worker SIGKILL every ``sizes.kill_every`` s until the job ends."""
    _wait(cluster, cluster.training, 300, "the group to train")
    cluster.note_shm()
    while not sizes.kills or len(events) < sizes.kills:
        _pause(cluster, sizes.kill_every)
        events.append(_kill_one(cluster, rng))


def _replace_node(cluster: Cluster, rng: random.Random, standby=None) -> dict:
    """Kill a node other than the store's outright; a fresh host with a new agent joins, or ``standby`` (an
    :class:`~benchmarks.goodput_hosts.Agent` waiting on the rendezvous' redundancy list) takes its place."""
    _wait(cluster, cluster.training, 300, "the group to train")
    victim = rng.choice([a for a in cluster.live_agents() if a.host is not cluster.store_host and a is not standby])
    worker = cluster.live_worker(victim.host.index)
    # The fresh host's network is made before the kill, and the fresh agent starts as soon as the dead host's
    # processes are sent SIGKILL, before they are gone and their memory is dropped: a replacement machine's
    # network is up before its agent starts, and a dead machine's processes need no exit. All three are the
    # harness's work (1.3-1.5 s between the kill and the fresh agent's start before, mostly the killed processes'
    # exit). The kernel still frees their memory on the same CPUs, at nice 19 (Cluster.kill_node).
    fresh = cluster.net.add_host() if standby is None else None
    held = cluster.held_shm(victim)
    t = time.time()  # the fault's time is the kill's
    killed = cluster.kill_node(victim)  # SIGKILLed; their exit (freeing their memory) is waited for below
    new = cluster.start_agent(fresh) if standby is None else standby.host
    started = time.time() - t
    dropped = cluster.drop_shm(held, killed)
    event = {"t": t, "fault": "node killed", "host": victim.host.index,
             "rank": worker.rank if worker else None, "shm_dropped": sorted(dropped), "joined": new.index}
    if standby is None:
        event["agent_started_s"] = round(started, 3)
    else:
        event["standby_waited_s"] = round(t - standby.started, 1)
    return event


def fault_node(cluster: Cluster, rng: random.Random, sizes: Sizes, t0: float, events: list) -> None:
    _wait(cluster, cluster.training, 300, "the group to train")
    cluster.note_shm()
    _pause(cluster, max(0.0, cluster.t_start + sizes.node_at * t0 - time.time()))
    events.append(_replace_node(cluster, rng))
    _wait(cluster, cluster.training, 300, "the new group to train")
    cluster.note_shm()


def fault_standby(cluster: Cluster, rng: random.Random, sizes: Sizes, t0: float, events: list) -> None:
    """A standby node takes a killed node's place: a fourth agent, started once the group trains, waits on the
    rendezvous' redundancy list (the world is at ``--nnodes``' maximum, 3) with its warm spare, as a cluster's hot
    spare would; at ``sizes.node_at`` of T0 a node is killed as in ``node`` and no fresh host is started."""
    _wait(cluster, cluster.training, 300, "the group to train")
    cluster.start_agent()
    standby = cluster.agents[-1]
    cluster.note_shm()
    _pause(cluster, max(0.0, cluster.t_start + sizes.node_at * t0 - time.time()))
    events.append(_replace_node(cluster, rng, standby=standby))
    _wait(cluster, cluster.training, 300, "the new group to train")
    cluster.note_shm()


def fault_lost(cluster: Cluster, rng: random.Random, sizes: Sizes, t0: float, events: list) -> None:
    """Nothing lost: ``sizes.lost_kills`` worker SIGKILLs (every second aimed at a save), a node replaced."""
    _wait(cluster, cluster.training, 300, "the group to train")
    cluster.note_shm()
    for i in range(sizes.lost_kills):
        _pause(cluster, rng.uniform(*sizes.lost_gap))
        events.append(_kill_one(cluster, rng, aim_at_save=i % 2 == 1))
        if i == sizes.lost_kills // 2 - 1:  # a node replaced halfway, then a rank that raises
            _pause(cluster, rng.uniform(*sizes.lost_gap))
            events.append(_replace_node(cluster, rng))
            _pause(cluster, rng.uniform(*sizes.lost_gap))
            events.append(_raise_one(cluster, rng))


def _raise_one(cluster: Cluster, rng: random.Random) -> dict:
    """Have the worker of a random live host raise (the example's ``--crash-file``) once the group trains;
    return the event once that rank took the request (it renames the file away, then raises)."""
    hosts = sorted({a.host.index for a in cluster.live_agents()})
    if not hosts:
        raise JobEnded
    index = rng.choice(hosts)
    worker = _wait(cluster, lambda: cluster.training() and cluster.live_worker(index), 300, "a worker to raise")
    path = cluster.workdir / "crash"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(str(worker.rank))
    t = time.time()
    os.rename(tmp, path)
    _wait(cluster, lambda: not path.exists(), 60, "the rank to take the raise request")
    return {"t": t, "fault": "worker raise", "host": index, "rank": worker.rank, "pid": worker.pid}


FAULT_DRIVERS = {"kill": fault_kill, "node": fault_node, "standby": fault_standby, "lost": fault_lost}


def run_once(cfg: Config, fault: str, sizes: Sizes, seed: int, root: Path, warm: bool,
             t0: float | None = None, ref: dict | None = None, tag: str = "") -> dict:
    """One run of configuration ``cfg`` under ``fault`` (``none``: the T0 run), in ``root``'s
    ``{cfg}-{fault}{tag}`` (``tag`` tells an interleaved run's repeats apart); return its row."""
    from tests.multinode import netns

    workdir = root / f"{cfg.name}-{fault}{tag}"
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    warm = warm or cfg.name in IN_PROCESS  # d is measured with warm spares only
    nnodes = "3" if fault == "lost" else "2:3"
    row = {"config": cfg.name, "label": cfg.label, "launcher": cfg.launcher, "fault": fault, "seed": seed,
           "nnodes": nnodes, "warm_start": warm and cfg.launcher == "elaunch", "state_mib": sizes.state_mib,
           "epochs": sizes.epochs, "step_sleep": sizes.step_sleep, "note": "", "events": []}
    with netns.Network("-gp") as net:
        cluster = Cluster(netns, net, cfg.launcher, nnodes, f"gp{os.getpid()}{cfg.name}{fault}", workdir,
                          sizes.example_args(seed, workdir) + list(cfg.args), warm)
        try:
            elapsed = _drive(cluster, fault, sizes, random.Random(seed), t0, row)
        finally:
            cluster.stop()
            row["leftovers"] = cluster.leftovers()
            for path in row["leftovers"]:  # a killed node's reaper died with it: its memory is ours to drop
                if path.startswith("/dev/shm/"):
                    shutil.rmtree(path, ignore_errors=True)
        row["attempts"] = attempts(cluster.lines, cluster.workers(), cluster.t_start)
        fault_times = [event["t"] for event in row["events"]]
        row["t_start"] = cluster.t_start  # the epoch time the events' "t" (and the steps' offsets) count from
        for event in row["events"]:
            event["t"] = round(event["t"] - cluster.t_start, 2)
    done = not row["note"] and all(c == 0 for c in row["exit_codes"] if c is not None)
    if not done and not row["note"]:
        row["note"] = f"the job failed (agents' exit codes {row['exit_codes']}, None: killed by the fault)"
    row["T_s"] = elapsed if done else None
    row["T0_s"] = row["T_s"] if fault == "none" else None  # a faulty run's: goodput_results.bracket_t0
    row["goodput"] = None
    row.update(in_run(read_steps(workdir / "counters"), fault_times, row["T_s"]))
    final = workdir / "final.json"
    if cfg.launcher == "elaunch":
        row["from_events"] = from_events(read_events(workdir / "logs"), row["events"], cluster.t_start)
    summarize(row, json.loads(final.read_text()) if final.exists() else None, ref)
    if cfg.name in IN_PROCESS:  # the counters' rank-0 processes are not the group starts: the events are
        ev = row["from_events"]
        row.update({"restarts": ev["restarts"], "steps_lost": ev["steps_lost"], "recovery_s": ev["recovery_s"],
                    "restores": ev["restores"], "attempts_note": "restarts, steps lost, restores and recoveries "
                    "from the event logs (in process: a kept rank 0 is no new counter)"})
    return row


def _drive(cluster: Cluster, fault: str, sizes: Sizes, rng: random.Random, t0: float | None, row: dict) -> float:
    """Start 3 agents, inject ``fault`` until the job ends (or the bound); return seconds to the last exit."""
    t_start = cluster.t_mono = time.monotonic()
    cluster.t_start = time.time()
    # the nothing-lost run is judged by its digest, not its time: it gets twice the bound
    bound = 900.0 if t0 is None else sizes.bound * t0 * (2 if fault == "lost" else 1)
    cluster.deadline = t_start + bound
    for _ in range(3):
        cluster.start_agent()
    try:
        try:
            if fault != "none":
                FAULT_DRIVERS[fault](cluster, rng, sizes, t0 or 0.0, row["events"])
        except JobEnded:
            pass
        _wait(cluster, lambda: not cluster.live_agents(), bound, "the job to end")
    except JobEnded:
        pass
    except DidNotComplete as exc:
        row["note"] = str(exc)
    cluster.poll()
    row["exit_codes"] = [None if a.killed else a.proc.poll() for a in cluster.agents]
    return max((a.exited for a in cluster.agents if a.exited), default=time.monotonic()) - t_start


def read_events(log_dir: Path) -> list[dict]:
    """Every agent's events (``LOG_DIR/*/events.jsonl``), by time."""
    found = []
    for path in log_dir.glob("**/events.jsonl"):
        for line in path.read_text(errors="replace").splitlines():
            try:
                found.append(json.loads(line))
            except ValueError:
                pass  # a line cut by a killed agent
    return sorted(found, key=lambda e: e.get("time", 0.0))


def from_events(events: list[dict], faults: list[dict], t_start: float) -> dict:
    """A faulty run's restarts, steps lost, restores and recoveries, read from the agents' event logs.

    Args:
        events: :func:`read_events`. faults: the run's fault events (``t``: s after ``t_start``).
        t_start: the run's start (time.time(), s).

    Returns:
        ``restarts`` (failed rounds), ``steps_lost`` (per restart: steps started, the ``restart``
        event's highest ``step`` + 1 (ddp_digits reports the 0-based index of the step it starts),
        minus the step the next ``checkpoint_restore`` restored; summed), ``lost_per_restart``,
        ``restores`` (by source: ``snapshot`` for memory/peer, ``disk``), ``recovery_s`` (per fault:
        from the fault to the last ``training`` event of the first round after it whose every
        ``training`` event is after it), ``inprocess`` (per in-process restart: round, ranks kept,
        ranks started, seconds to "go"), ``rounds_trained`` (round: s after the start).
    """
    failed: dict[int, int | None] = {}
    for e in events:
        if e.get("kind") == "restart":
            r = e.get("failed_round", e.get("round"))
            if r is None:
                continue
            step = e.get("step")
            failed[r] = step if failed.get(r) is None else max(failed[r], step if step is not None else -1)
    restored = {}
    for e in events:
        if e.get("kind") == "checkpoint_restore" and e.get("round") is not None:
            restored.setdefault(e["round"], e)
    lost = []
    for r, step in sorted(failed.items()):
        nxt = min((k for k in restored if k > r), default=None)
        if step is None or nxt is None:
            continue
        lost.append(max(0, step + 1 - restored[nxt]["step"]))
    trained: dict[int, list[float]] = {}
    for e in events:
        if e.get("kind") == "training" and e.get("round") is not None:
            trained.setdefault(e["round"], []).append(e["time"])
    recovery = []
    for f in faults:
        t = t_start + f["t"]
        after = [r for r in sorted(trained) if min(trained[r]) > t]
        if after:
            recovery.append(round(max(trained[after[0]]) - t, 2))
    sources = [src for e in restored.values() for src in e.get("sources", {}).values()]
    kinds = [set(e.get("sources", {}).values()) for e in restored.values()]
    restores = {"snapshot": sum(1 for k in kinds if k and k <= {"memory", "peer"}), "disk": sum(1 for k in kinds
                if "disk" in k), "scratch": 0, "none": sum(1 for k in kinds if not k or "missing" in k)}
    inproc = [{"round": e.get("round"), "kept": len(e.get("kept", [])), "started": len(e.get("started", [])),
               "seconds": e.get("seconds")} for e in events if e.get("kind") == "inprocess_restart"]
    return {"restarts": len(failed), "steps_lost": sum(lost), "lost_per_restart": lost, "restores": restores,
            "restore_sources": sorted(set(sources)), "recovery_s": recovery, "inprocess": inproc,
            "rounds_trained": {r: round(max(ts) - t_start, 2) for r, ts in sorted(trained.items())}}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.goodput", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a small state and ~30 s of training per run")
    p.add_argument("--json", type=Path, default=None, help="write the rows and the report scenario here")
    p.add_argument("--configs", default="a,b,c",
                   help="which configurations (default a,b,c; d: a in process, --configs a,d compares them)")
    p.add_argument("--faults", default="kill,node", help="which faults (default kill,node; also standby)")
    p.add_argument("--lost", default="a", help="configuration of the nothing-lost run ('' = none; default a)")
    p.add_argument("--seed", type=int, default=0, help="the example's and the fault schedule's seed")
    p.add_argument("--no-warm-start", action="store_true", help="elaunch without --warm-start")
    p.add_argument("--work-dir", type=Path, default=None, help="keep logs here (default: a temporary directory)")
    p.add_argument("--reference", type=Path, default=None, metavar="JSON",
                   help="take the uninterrupted runs (T0, final digest) from this earlier --json result "
                        "instead of running them (same sizes and seed)")
    p.add_argument("--interleave", type=int, default=0, metavar="N",
                   help="run each fault N times, each faulty run followed by an uninterrupted one; a faulty "
                        "run's T0 is then the mean of the uninterrupted runs on either side (the machine's "
                        "speed drifts within minutes). Default 0: one uninterrupted run, before the faults")
    p.add_argument("--epochs", type=int, default=None)
    p.add_argument("--step-sleep", type=float, default=None)
    p.add_argument("--state-mib", type=int, default=None)
    a = p.parse_args(argv)
    a.configs = [c for c in a.configs.split(",") if c]
    a.faults = [f for f in a.faults.split(",") if f]
    bad = [c for c in a.configs + ([a.lost] if a.lost else []) if c not in CONFIGS]
    bad += [f for f in a.faults if f not in FAULTS]
    if a.interleave < 0:
        p.error(f"--interleave: {a.interleave} is negative")
    if bad:
        p.error(f"unknown configuration(s) or fault(s): {', '.join(bad)} (configs a,b,c,d; faults kill,node,standby)")
    return a


def run(a: argparse.Namespace) -> dict:
    """Every configuration's T0 run, then its faulty runs, then the nothing-lost run."""
    from benchmarks import run as suite
    from tests.multinode import netns

    reason = netns.unavailable_reason()
    if reason:
        raise SystemExit(f"goodput: cannot build test hosts: {reason}")
    netns.cleanup_stale()
    base = QUICK if a.quick else FULL
    sizes = Sizes(**{**base.__dict__, **{k: v for k, v in (("epochs", a.epochs), ("step_sleep", a.step_sleep),
                                                             ("state_mib", a.state_mib)) if v is not None}})
    warm = not a.no_warm_start
    t_begin, load_start = time.monotonic(), suite._loadavg()
    rows: list[dict] = []
    references = {}
    if a.reference:
        earlier = json.loads(a.reference.read_text())
        same = {k: v for k, v in earlier["sizes"].items() if k in ("state_mib", "epochs", "step_sleep")}
        if same != {k: getattr(sizes, k) for k in same} or len(same) != 3:
            raise SystemExit(f"--reference {a.reference}: other sizes ({earlier['sizes']})")
        references = {r["config"]: r for r in earlier["rows"] if r["fault"] == "none" and r["seed"] == a.seed}

    def result() -> dict:
        return _result(rows, sizes, a, warm, time.monotonic() - t_begin, load_start)

    with tempfile.TemporaryDirectory(prefix="elaunch-goodput-") as tmp:
        root = a.work_dir.resolve() if a.work_dir else Path(tmp)
        for name in dict.fromkeys(a.configs + ([a.lost] if a.lost else [])):
            cfg = CONFIGS[name]
            base_row = references.get(name)
            if base_row is None:
                log_line(f"goodput {name} ({cfg.label}): uninterrupted")
                base_row = run_once(cfg, "none", sizes, a.seed, root, warm)
            rows.append(base_row)
            faults = a.faults if name in a.configs else []
            plan = [faults] * a.interleave if a.interleave else [faults]
            plan += [["lost"]] if name == a.lost else []
            t0 = base_row["T_s"]  # the latest uninterrupted run that completed: it times the faults and bounds
            for i, group in enumerate(plan):
                tag = f"-{i + 1}" if i < a.interleave else ""  # "": not interleaved (the nothing-lost run)
                for fault in group:
                    if a.json:  # what is measured so far survives an interrupted run
                        a.json.write_text(json.dumps({**result(), "partial": True}, indent=1) + "\n")
                    log_line(f"goodput {name}: {fault} (T0 {fmt_s(t0)})")
                    rows.append(run_once(cfg, fault, sizes, a.seed, root, warm, t0, base_row, tag))
                    if tag:
                        log_line(f"goodput {name} ({cfg.label}): uninterrupted, after {fault}")
                        rows.append(run_once(cfg, "none", sizes, a.seed, root, warm, tag=f"-after-{fault}{tag}"))
                        t0 = rows[-1]["T_s"] or t0
    return result()


def _result(rows: list[dict], sizes: Sizes, a: argparse.Namespace, warm: bool, duration: float,
            load_start: str) -> dict:
    """The JSON-able result: run facts (benchmarks.run's meta), the rows, the report scenario."""
    from benchmarks import run as suite

    bracket_t0(rows, lambda r: r["config"])
    for r in rows:
        r["fault_label"] = {"none": "uninterrupted", "lost": "nothing lost (--nnodes=3)"}.get(
            r["fault"], FAULTS.get(r["fault"], "").format(every=sizes.kill_every))
    digests = {r["final"]["sha256"] for r in rows if r["fault"] == "none" and r["final"]}
    notes = [f"{sizes.state_mib} MiB state, {sizes.epochs} epochs, --step-sleep {sizes.step_sleep}, "
             f"seed {a.seed}; elaunch {'with' if warm else 'without'} --warm-start",
             "the uninterrupted runs' final parameters " +
             ("agree" if len(digests) == 1 else f"DIFFER ({len(digests)} digests)")]
    cmd = "python -m benchmarks.goodput" + ("" if len(sys.argv) < 2 else " " + " ".join(sys.argv[1:]))
    torch_v, elaunch_v = suite._versions()
    meta = {"command": cmd, "date": time.strftime("%Y-%m-%d %H:%M %Z"), "quick": a.quick, "repeat": 1,
            "machine": suite._machine(), "python": sys.version.split()[0], "torch": torch_v, "elaunch": elaunch_v,
            "commit": suite._commit(), "warm_start": "--warm-start" if warm else None, "loadavg_start": load_start,
            "loadavg_end": suite._loadavg(), "duration_s": duration, "notes": notes}
    return {"meta": meta, "sizes": sizes.__dict__, "rows": rows,
            "scenarios": [report_scenario(rows, sizes.state_mib)]}


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    # a stop (SIGTERM, or SIGINT even when a shell started us in the background with it
    # ignored) unwinds: every run's finally kills its agents and deletes its namespaces
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    signal.signal(signal.SIGINT, signal.default_int_handler)
    result = run(a)
    if a.json:
        a.json.write_text(json.dumps(result, indent=1) + "\n")
    print(markdown(result["rows"]))
    for note in result["meta"]["notes"]:
        print(f"- {note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
