"""The replica service across test hosts: members of the round get in, a host outside it does not.

Each host is a network namespace with its own address (``tests/multinode/netns.py``).
Two agents save sharded state with ``ELAUNCH_JOB_SECRET`` set; each keeps the other's
snapshot. An attacker on a fourth host that is not a member of the round, even holding
the job's key, has its connections closed unread. Then one agent is killed (kill -9) and
an agent on a new host with a new address replaces it: the survivor's service accepts it
(the round's members changed) and its rank restores from the survivor's memory.
"""

from __future__ import annotations

import json
import os
import re
import sys

import psutil
import pytest

from elaunch.checkpoint import replica_wire as wire
from tests.conftest import wait_for
from tests.helpers import SCRIPTS
from tests.multinode.conftest import agent_args, no_processes_in

pytestmark = [pytest.mark.multinode, pytest.mark.slow]

SECRET = "a secret every node of the job is given"
WORKER = str(SCRIPTS / "ckpt_worker.py")


def _replica_port(host, agent_pid: int) -> int | None:
    """The port the agent's replica service listens on, as an outsider finds it: ``ss -ltnp`` in its host."""
    pids = set()
    for child in psutil.Process(agent_pid).children(recursive=True):
        try:
            if any("_replica_child.py" in part for part in child.cmdline()):
                pids.add(child.pid)
        except psutil.Error:
            pass
    listing = host.run(["ss", "-Hltnp"]).stdout
    for line in listing.splitlines():
        found = re.search(r"pid=(\d+)", line)
        if found and int(found.group(1)) in pids:
            return int(line.split()[3].rpartition(":")[2])
    return None


def _events(log_dir, kind: str) -> list[dict]:
    found = []
    for path in log_dir.glob("*/events.jsonl"):
        found += [e for e in map(json.loads, path.read_text().splitlines()) if e["kind"] == kind]
    return found


@pytest.mark.parametrize("rdzv", ["c10d"], indirect=True)
def test_a_host_outside_the_round_is_refused_and_a_replacing_host_restores_from_a_peer(net, agents, rdzv, tmp_path):
    h1, h2, h3, outsider = net.add_host(), net.add_host(), net.add_host(), net.add_host()
    ep = rdzv.endpoint(h1)
    out, stop = tmp_path / "out", tmp_path / "stop"
    out.mkdir()
    env = {"ELAUNCH_JOB_SECRET": SECRET}

    def agent(host, name):
        argv = agent_args(host, ep, backend="c10d", nnodes="2:3", nproc=1, rdzv_id="guarded",
                          extra=(f"--log-dir={tmp_path / name}",))
        return agents(host, argv + [WORKER, str(out), "3", "--wait-for", str(stop), "--sharded"], name, env=env)

    a1, a2 = agent(h1, "a1"), agent(h2, "a2")
    wait_for(lambda: all((out / f"saved_{r}_2").exists() for r in (0, 1)), 120,
             what=f"both ranks' step 2\n{a1.describe()}\n{a2.describe()}")
    reports = {p.name[:-5]: json.loads(p.read_text()) for p in out.glob("*.json")}
    shms = [reports[f"{r}_0"]["env"]["ELAUNCH_CHECKPOINT_SHM"] for r in (0, 1)]
    replicas = [f"{shms[0]}/replicas/r1", f"{shms[1]}/replicas/r0"]  # each keeps the other's: sent across hosts
    wait_for(lambda: all(os.path.exists(p) for p in replicas), 60, what="the replicas")
    port = wait_for(lambda: _replica_port(h1, a1.proc.pid), 30, what="a1's replica port")
    key = wire.job_key(SECRET.encode(), "guarded")
    probe = [sys.executable, str(SCRIPTS / "replica_attacker.py"), h1.addr, str(port), "get", "0", "2", key.hex()]
    stolen = outsider.run(probe, timeout=60)
    assert stolen.returncode == 0, stolen.stderr
    assert json.loads(stolen.stdout.splitlines()[-1]) == {"served": 0, "closed": True}  # the key is not enough
    member = h2.run(probe, timeout=60)  # the same probe from a member host: served (the probe is sound)
    assert member.returncode == 0 and json.loads(member.stdout.splitlines()[-1])["served"] > 0, member.stderr

    victim, survivor = (a2, a1)
    victim.kill9()
    no_processes_in([victim.host], timeout=20)
    a3 = agent(h3, "a3")
    wait_for(lambda: sum(1 for p in out.glob("*.json") if json.loads(p.read_text())["step"] == 2) == 2, 120,
             what=f"both ranks restored\n{survivor.describe()}\n{a3.describe()}")
    stop.touch()
    codes = [survivor.wait(90), a3.wait(90)]
    assert codes == [0, 0], f"{survivor.describe()}\n{a3.describe()}"
    (fresh,) = _events(tmp_path / "a3", "checkpoint_restore")
    assert fresh["step"] == 2 and list(fresh["sources"].values()) == ["peer"]
    no_processes_in(net.hosts)
