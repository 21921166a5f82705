"""A lost member of a round of four is found by its ring neighbours alone, and the others follow (issue 10).

Each running member's monitor reads only its own and its next two members'
heartbeat keys (``liveness.ring_neighbours``), so in a round of four a frozen agent
is judged by two of the three others; the third (the one after it) never reads
its key and learns from the state: the nodes that found it lost re-form, leaving
the round. Four agents of ``--nnodes=3:4`` run ``mn_loop.py``; one (on c10d, not
the one hosting the store) is frozen for good (SIGSTOP: its heartbeats stop, its
workers keep all-reducing until their peers go). All three survivors must re-form
a world of three (``rounds.txt`` gets a ``3 3`` line, which only a round without
the frozen node can write) and exit 0 when told to stop.
"""

from __future__ import annotations

import os
import signal
import subprocess

import psutil
import pytest

from tests.conftest import wait_for
from tests.helpers import SCRIPTS, kill_tree, start

# In the long part (scripts/test.sh --long): ~13 s per backend, and the suite is near its 20 minutes.
pytestmark = [pytest.mark.slow, pytest.mark.long]

AGENTS = 4



def _listens_on(pid: int, port: int) -> bool:
    try:
        conns = psutil.Process(pid).net_connections(kind="tcp")
    except psutil.Error:
        return False
    return any(c.status == psutil.CONN_LISTEN and c.laddr.port == port for c in conns)


# the ring rule is backend-agnostic (liveness.ring_neighbours, reading.read_watched); etcd-v2's few-keys
# read is covered by the backend contract tests and its no-false-alarm and link-cut tests
@pytest.mark.parametrize("endpoint", ["c10d", "etcd-v3"], indirect=True)
def test_a_frozen_member_of_four_is_left_behind_by_all_three_others(endpoint, tmp_path):
    backend, ep = endpoint
    conf = "last_call_timeout=1,join_timeout=60" + ("" if backend == "c10d" else ",read_timeout=20")
    errs = [tmp_path / f"agent{i}.err" for i in range(AGENTS)]
    rounds = tmp_path / "rounds.txt"
    agents: list[subprocess.Popen] = []

    def lines() -> list[str]:
        return rounds.read_text().splitlines() if rounds.exists() else []

    def stderr() -> str:
        return "".join(f"--- {e.name} ---\n{e.read_text(errors='replace')[-2500:]}\n" for e in errs)

    try:
        for err in errs:
            with open(err, "w") as f:
                agents.append(start(
                    "elaunch", f"--nnodes=3:{AGENTS}", "--nproc-per-node=1", f"--rdzv-backend={backend}",
                    f"--rdzv-endpoint={ep}", f"--rdzv-id=ring-{backend}", f"--rdzv-conf={conf}",
                    "--local-addr=127.0.0.1", "--monitor-interval=0.1", str(SCRIPTS / "mn_loop.py"),
                    str(tmp_path), stdout=subprocess.DEVNULL, stderr=f))
        wait_for(lambda: f"{AGENTS} {AGENTS} 0" in lines() or any(a.poll() is not None for a in agents), 120,
                 what="a world of four")
        assert lines() == [f"{AGENTS} {AGENTS} 0"], stderr()
        port = int(ep.rpartition(":")[2]) if backend == "c10d" else -1
        frozen = next(a for a in reversed(agents) if not _listens_on(a.pid, port))  # the store must stay up
        os.kill(frozen.pid, signal.SIGSTOP)
        survivors = [a for a in agents if a is not frozen]
        wait_for(lambda: any(line.startswith("3 3 ") for line in lines())
                 or any(a.poll() is not None for a in survivors), 120, what="a world of the three others")
        assert any(line.startswith("3 3 ") for line in lines()), f"{lines()}\n{stderr()}"
        (tmp_path / "stop").touch()
        codes = [a.wait(timeout=90) for a in survivors]
        assert codes == [0, 0, 0], stderr()
    finally:
        for a in agents:
            kill_tree(a.pid)  # SIGKILL ends the frozen one too
