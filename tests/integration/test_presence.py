"""A node whose agent is killed is lost at once by its peers, through its refused presence port.

Real agents (c10d, and etcd-v3 with the module's real etcd server; loopback) running
``mn_loop.py``. The heartbeat rules are set out of these tests' reach (``lost_after`` and
``probe_timeout`` 90 s, torch's rule and etcd-v3's presence lease at 90 s):
without the presence port (``rendezvous/dynamic/presence.py``) the survivors would wait
90 s before re-forming without a killed node. And an attacker process that floods every
agent's presence port with connections and junk makes no live node look lost: a worker
killed during the flood is a counted failure of a world that stays whole.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import psutil
import pytest

from tests.conftest import track_processes, wait_for
from tests.helpers import SCRIPTS, free_port, kill_tree, launcher_env, read_pids, start

pytestmark = pytest.mark.slow

#: Heartbeats (and the presence ports' upkeep) every 0.5 s, but nothing judged lost or dead by them before 90 s.
CONF = ("last_call_timeout=1,join_timeout=120,lost_after=90,probe_timeout=90,keep_alive_interval=0.5,"
        "keep_alive_max_attempt=180")


def _listening(pid: int) -> set[int]:
    try:
        return {c.laddr.port for c in psutil.Process(pid).net_connections(kind="tcp") if c.status == psutil.CONN_LISTEN}
    except psutil.Error:
        return set()


def _lines(path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


def _stderr(errs) -> str:
    return "".join(f"--- {e.name} ---\n{e.read_text(errors='replace')[-3000:]}\n" for e in errs)


def _start(n: int, nnodes: str, ep: str, tmp_path, rdzv_id: str, backend: str = "c10d"):
    errs = [tmp_path / f"agent{i}.err" for i in range(n)]
    agents = []
    conf = CONF + ("" if backend == "c10d" else ",read_timeout=20")
    for i, err in enumerate(errs):
        env = launcher_env(MN_HOST=f"h{i}")
        with open(err, "w") as f:
            agents.append(start("elaunch", f"--nnodes={nnodes}", "--nproc-per-node=1", f"--rdzv-backend={backend}",
                                f"--rdzv-endpoint={ep}", f"--rdzv-id={rdzv_id}", f"--rdzv-conf={conf}",
                                "--local-addr=127.0.0.1", "--monitor-interval=0.1", "--max-restarts=3",
                                str(SCRIPTS / "mn_loop.py"), str(tmp_path), env=env, stdout=subprocess.DEVNULL,
                                stderr=f))
    return agents, errs


# etcd-v3: the killed agent's presence lease lives as long as the heartbeat rules (90 s here) too
@pytest.mark.parametrize("endpoint", ["c10d", "etcd-v3"], indirect=True)
def test_the_survivors_reform_at_once_without_a_killed_agent(endpoint, tmp_path):
    backend, ep = endpoint
    store_port = int(ep.rpartition(":")[2]) if backend == "c10d" else -1
    rounds = tmp_path / "rounds.txt"
    agents, errs = _start(3, "2:3", ep, tmp_path, f"presence-kill-{backend}", backend)
    try:
        wait_for(lambda: "3 3 0" in _lines(rounds) or any(a.poll() is not None for a in agents), 120,
                 what="a world of three")
        assert _lines(rounds) == ["3 3 0"], _stderr(errs)
        victim = next(a for a in reversed(agents) if store_port not in _listening(a.pid))  # the store stays up
        kill_tree(victim.pid)  # the agent and its worker, SIGKILL: no leave is written
        survivors = [a for a in agents if a is not victim]
        wait_for(lambda: "2 2 0" in _lines(rounds) or any(a.poll() is not None for a in survivors), 45,
                 what="the two survivors re-formed (90 s by heartbeats and probes alone)")
        assert _lines(rounds) == ["3 3 0", "2 2 0"], _stderr(errs)  # a node lost: no restart counted
        assert "refused their presence port" in _stderr(errs), _stderr(errs)
        (tmp_path / "stop").touch()
        assert [a.wait(timeout=90) for a in survivors] == [0, 0], _stderr(errs)
    finally:
        for a in agents:
            kill_tree(a.pid)


ATTACKER = textwrap.dedent("""
    import os, socket, sys, time
    ports, stop = [int(p) for p in sys.argv[1].split(",")], sys.argv[2]
    held = []
    connects = 0
    while not os.path.exists(stop):
        for port in ports:
            try:
                s = socket.create_connection(("127.0.0.1", port), timeout=0.2)
                s.sendall(b"\\x80\\x04\\x95" + os.urandom(512))  # a pickle header and junk
                held.append(s)
                connects += 1
            except OSError:
                pass
        if len(held) > 400:
            for s in held[:200]:
                s.close()
            del held[:200]
        time.sleep(0.002)
    print(connects, flush=True)
""")


def test_a_flood_of_the_presence_ports_makes_no_live_node_lost(tmp_path):
    ep = f"127.0.0.1:{free_port()}"
    store_port = int(ep.rpartition(":")[2])
    rounds = tmp_path / "rounds.txt"
    agents, errs = _start(2, "2", ep, tmp_path, "presence-flood")
    attacker = None
    try:
        wait_for(lambda: "2 2 0" in _lines(rounds) or any(a.poll() is not None for a in agents), 120,
                 what="a world of two")
        worker_pid = read_pids(tmp_path / "pid_h1_0_0")[0]
        master_port = int(psutil.Process(worker_pid).environ()["MASTER_PORT"])
        # every port the agents listen on but the job's two stores: the presence ports among them
        ports = sorted(set().union(*(_listening(a.pid) for a in agents)) - {store_port, master_port})
        assert ports, "the agents listen on no presence port"
        attacker = subprocess.Popen([sys.executable, "-c", ATTACKER, ",".join(map(str, ports)),
                                     str(tmp_path / "attack-stop")], stdout=subprocess.PIPE, text=True)
        track_processes([attacker.pid])
        os.kill(worker_pid, signal.SIGKILL)  # a worker, not an agent: a counted failure, both nodes stay
        wait_for(lambda: "2 2 1" in _lines(rounds) or any(a.poll() is not None for a in agents), 90,
                 what="the world of two again, after one counted restart")
        assert _lines(rounds) == ["2 2 0", "2 2 1"], _stderr(errs)
        assert "refused their presence port" not in _stderr(errs)
        (tmp_path / "attack-stop").touch()
        connects = int(attacker.communicate(timeout=30)[0].strip() or 0)
        assert connects > 100, f"the attacker got only {connects} connections in"
        (tmp_path / "stop").touch()
        assert [a.wait(timeout=90) for a in agents] == [0, 0], _stderr(errs)
    finally:
        if attacker is not None:
            attacker.kill()
            attacker.wait(10)
        for a in agents:
            kill_tree(a.pid)
