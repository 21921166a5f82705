"""``--node-check`` on network-namespace hosts with a real slow link (issue 26).

Three hosts on the bridge (``tests/multinode/netns.py``); in two tests one host's link
is shaped with tbf on both of its veth ends (50 Mbit/s: this kernel has no netem).
Every agent must name that host, and only it, before the workers start; without the
shaping nothing is named; with ``exclude_after=1`` and ``--nnodes=2:3`` the job runs
on the two good hosts while the slow one sits out and exits 0 when the job ends.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.multinode.conftest import agent_args, no_processes_in

pytestmark = [pytest.mark.multinode, pytest.mark.slow]

#: tbf as the issue's netem rate: 50 Mbit/s, a 32 kbit bucket, 400 ms of queue.
TBF = ["tbf", "rate", "50mbit", "burst", "32kbit", "latency", "400ms"]
#: Each worker notes its host, rank and world size in the shared tmp directory, then exits 0.
WORKER = ("import os, sys\n"
          "open(os.path.join(sys.argv[1], f\"ran-{os.environ['MN_HOST']}-{os.environ['RANK']}-"
          "{os.environ['WORLD_SIZE']}\"), 'w').close()\n")


def slow_link(host) -> None:
    """Shape ``host``'s link both ways: its ``eth0`` (what it sends) and the bridge's end (what it receives)."""
    for ns, dev in ((host.ns, host.ifname), (host.network.switch, host.peer)):
        subprocess.run(["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", *TBF], check=True, timeout=10)


def _node_checks(log_dir: Path) -> list[dict]:
    [path] = list(log_dir.rglob("events.jsonl"))
    return [e for e in map(json.loads, path.read_text().splitlines()) if e["kind"] == "node_check"]


def _run(net, agents, tmp_path, slow: int | None, nnodes: str = "3", conf: str = ""):
    """Three hosts (the c10d store on the first), host ``slow`` (1-based) shaped; return the agents once they exited."""
    hosts = [net.add_host() for _ in range(3)]
    if slow is not None:
        slow_link(hosts[slow - 1])
    script = tmp_path / "w.py"
    script.write_text(WORKER)
    ep = f"{hosts[0].addr}:29400"
    started = [agents(h, agent_args(h, ep, nnodes=nnodes, nproc=1, conf=conf,
                                    extra=("--node-check", f"--log-dir={tmp_path / h.addr}"))
                      + [str(script), str(tmp_path)], f"a{h.index}") for h in hosts]
    codes = [a.wait(90) for a in started]
    assert codes == [0, 0, 0], "\n".join(a.describe() for a in started)
    no_processes_in(net.hosts)
    return hosts, started


def test_the_check_names_the_host_with_the_slow_link_and_no_other(net, agents, tmp_path):
    hosts, started = _run(net, agents, tmp_path, slow=3)
    for h, a in zip(hosts, started):
        [check] = _node_checks(tmp_path / h.addr)
        named = {n["addr"] for n in check["nodes"].values() if n["verdict"] != "ok"}
        assert named == {hosts[2].addr}, check
        assert check["sitting_out"] == []
        assert f"{hosts[2].addr}) is slow: best all-reduce" in a.stderr, a.stderr
        assert hosts[0].addr + ")" not in a.stderr and hosts[1].addr + ")" not in a.stderr
    # only named: the job ran on all three hosts, one rank each (which host gets which rank is
    # the rendezvous' choice: the node whose write completes the round takes rank 0)
    ran = sorted(p.name.split("-")[1:] for p in tmp_path.glob("ran-*"))
    assert [addr for addr, _, _ in ran] == [h.addr for h in hosts], ran
    assert sorted(rank for _, rank, _ in ran) == ["0", "1", "2"] and {w for _, _, w in ran} == {"3"}, ran


def test_without_a_slow_link_nothing_is_named(net, agents, tmp_path):
    hosts, started = _run(net, agents, tmp_path, slow=None)
    for h in hosts:
        [check] = _node_checks(tmp_path / h.addr)
        assert check["faulty"] == [] and len(check["nodes"]) == 3, check
    assert len(list(tmp_path.glob("ran-*"))) == 3


def test_with_exclude_after_the_slow_host_sits_out_and_the_job_runs_on_the_good_two(net, agents, tmp_path):
    hosts, started = _run(net, agents, tmp_path, slow=3, nnodes="2:3", conf="exclude_after=1,exclude_cooldown=600")
    ran = sorted(p.name for p in tmp_path.glob("ran-*"))
    assert len(ran) == 2 and all(name.endswith("-2") for name in ran), ran  # a world of two
    assert {name.split("-")[1] for name in ran} == {hosts[0].addr, hosts[1].addr}
    first = _node_checks(tmp_path / hosts[0].addr)[0]
    assert first["sitting_out"] == first["faulty"] and len(first["faulty"]) == 1
    assert first["nodes"][first["faulty"][0]]["addr"] == hosts[2].addr
    assert "it sits out" in started[2].stderr
