"""What ``--node-check`` costs a round (issue 26): its duration on 2, 3 and 8 hosts, and its share of the round.

Scenario ``node_check``: N test hosts (network namespaces, ``tests/multinode/netns.py``)
run elaunch with ``--node-check`` (c10d, one no-op worker each, ``--nnodes=N``); each
repeat is a fresh network and job. From each node's event log:

* **duration**: the ``node_check`` event's ``seconds``, from the round formed to the
  verdicts on that node (the slowest node's): what the check delays the workers by.
  It includes any wait for the check child still importing torch (the child starts as
  the agent joins, so the rendezvous hides part of that import);
* **the check itself**: the check child's own seconds once every node's child was there
  (the probe, two pairing rounds of all-reduces, the last barrier), the slowest node's;
* **share of the round**: duration / (``rendezvous_join`` -> ``workers_started``) on
  the same node, in percent.

torchrun has no such check: its cells say so. On 8 hosts of a 2-core machine, 16
interpreters import torch at once (8 agents, 8 check children): the duration there is
mostly that wait, and the check's own all-reduces share the 2 cores.
"""

from __future__ import annotations

import json
import time

from benchmarks.common import DidNotComplete, Recorder, launcher_cmd, launcher_env
from benchmarks.scenarios import NOOP, BenchConfig

#: The c10d store's port on the first host (each repeat has a network of its own).
STORE_PORT = 29400
#: Host counts measured.
SIZES = (2, 3, 8)
NO_CHECK = "torchrun has no node check"


def _netns():
    from tests.multinode import netns  # the test hosts: the same code the multi-node tests use

    return netns, netns.unavailable_reason()


def _events(log_dir) -> list[dict]:
    paths = list(log_dir.rglob("events.jsonl"))
    if len(paths) != 1:
        raise DidNotComplete(f"expected one events.jsonl under {log_dir}, found {len(paths)}")
    return [json.loads(line) for line in paths[0].read_text().splitlines()]


def _one_job(netns, n: int, work, bound: float) -> list[tuple[float, float, float]]:
    """Run one job on ``n`` hosts; per node (duration, the child's own seconds, share of the round)."""
    with netns.Network("-nc") as net:
        hosts = [net.add_host() for _ in range(n)]
        procs = []
        for h in hosts:
            args = [f"--nnodes={n}", "--nproc-per-node=1", "--rdzv-backend=c10d",
                    f"--rdzv-endpoint={hosts[0].addr}:{STORE_PORT}", f"--rdzv-id=bench-nc-{work.name}",
                    f"--local-addr={h.addr}", "--node-check", f"--log-dir={work / h.addr}", NOOP]
            env = {**launcher_env(), "GLOO_SOCKET_IFNAME": h.ifname}
            with open(work / f"{h.addr}.log", "ab") as f:
                procs.append(h.popen(launcher_cmd("elaunch", *args), stdout=f, stderr=f, env=env))
        deadline = time.monotonic() + bound
        try:
            for p in procs:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except Exception:  # noqa: BLE001 - a timeout: recorded as not completed
            raise DidNotComplete(f"did not complete in {bound:g} s") from None
        finally:
            for p in procs:
                p.kill()
                p.wait()
        if any(p.returncode for p in procs):
            raise DidNotComplete(f"an agent exited {[p.returncode for p in procs]} (logs in {work})")
    out = []
    for h in hosts:
        events = _events(work / h.addr)
        check = next(e for e in events if e["kind"] == "node_check")
        joined = next(e["time"] for e in events if e["kind"] == "rendezvous_join")
        started = next(e["time"] for e in events if e["kind"] == "workers_started")
        own = max(x["check_seconds"] or 0.0 for x in check["nodes"].values())
        out.append((check["seconds"], own, 100.0 * check["seconds"] / (started - joined)))
    return out


def bench_node_check(cfg: BenchConfig) -> tuple[list[Recorder], list[str]]:
    """The rows of the module docstring, ``cfg.repeat`` jobs per host count.

    Returns:
        The recorder (an empty list when the hosts cannot be built) and notes for the report.
    """
    netns, reason = _netns()
    if reason:
        return [], [f"node check: skipped ({reason})"]
    netns.cleanup_stale()
    rec = Recorder("node_check")
    for n in SIZES:
        rec.metric(f"duration_{n}", f"--node-check on {n} hosts (c10d, gloo): round formed -> verdicts", "s",
                   {"kind": "abs_le", "value": 10.0, "text": "<= 10 s"})
        rec.metric(f"own_{n}", f"--node-check on {n} hosts: the check child's own time (torch imported)", "s")
    rec.metric("share_3", "--node-check on 3 hosts: its share of the round (join -> workers started)", "%")
    for i in range(cfg.repeat):
        for n in SIZES:
            work = cfg.scratch(f"node_check_{n}_{i}")
            try:
                nodes = _one_job(netns, n, work, 120.0)
            except DidNotComplete as exc:
                rec.add(f"duration_{n}", "elaunch", None, str(exc))
                continue
            rec.add(f"duration_{n}", "elaunch", max(d for d, _o, _s in nodes))
            rec.add(f"own_{n}", "elaunch", max(o for _d, o, _s in nodes))
            if n == 3:
                rec.add("share_3", "elaunch", max(s for _d, _o, s in nodes))
    for m in rec.metrics.values():
        m.notes["torchrun"].append(NO_CHECK)
    return [rec], []
