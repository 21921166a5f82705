"""Job-wide supervision with two agents on one rendezvous (c10d, etcd-v2, etcd-v3).

One node's failure ends or restarts the whole job: the other agent stops its
blocked workers when the failing agent declares the job failed, with the same
root cause; the restart count is the job's, the same on every node.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import psutil
import pytest

from tests.conftest import wait_for
from tests.helpers import SCRIPTS, finish_agents, kill_tree, launcher_env, port_open, start, start_agent

pytestmark = pytest.mark.slow

FAULT = str(SCRIPTS / "job_fault.py")
CONF = "last_call_timeout=1,join_timeout=60,keep_alive_interval=1,keep_alive_max_attempt=5"
BACKENDS = ["c10d", "etcd-v2", "etcd-v3"]



def _agents(endpoint, schedule: dict, out: Path, *extra: str, rdzv_id: str, n: int = 2):
    backend, ep = endpoint
    conf = CONF if backend == "c10d" else CONF + ",read_timeout=20"
    return [
        start_agent(backend, ep, FAULT, json.dumps(schedule), str(out), rdzv_id=rdzv_id, nnodes=n, conf=conf,
                    nproc_per_node=2, extra=extra)
        for _ in range(n)
    ]




def _starts(out: Path) -> list[tuple[int, int]]:
    rows = [line.split() for line in (out / "starts.log").read_text().splitlines()]
    return sorted((int(r[0]), int(r[1])) for r in rows)


@pytest.mark.parametrize("endpoint", BACKENDS, indirect=True)
def test_a_spent_budget_on_one_node_stops_every_node_with_the_same_root_cause(endpoint, tmp_path):
    # global rank 3 exits 1; every other rank blocks, as NCCL ranks do when a peer is gone
    agents = _agents(endpoint, {"*:3": 7, "*:*": "hang"}, tmp_path, rdzv_id=f"fail-{endpoint[0]}")
    results = finish_agents(agents)
    assert [code for code, _, _ in results] == [1, 1], [err[-3000:] for _, err, _ in results]
    for _code, err, _ in results:
        root = err.split("Root Cause (first observed failure):", 1)[1].split("Other Failures:", 1)[0]
        assert "rank      : 3 (local_rank: 1)" in root, err[-3000:]
        assert "exitcode  : 7" in root, err[-3000:]
    healthy = [err for _, err, _ in results if "exiting with 7 on purpose" not in err.split("Root Cause")[0]
               or "reported by that node's agent" in err]
    assert any("reported by that node's agent through the rendezvous" in err for err in healthy), \
        [err[-2000:] for _, err, _ in results]
    # both agents were done at about the same time (the blocked node did not wait forever)
    assert abs(results[0][2] - results[1][2]) < 15


@pytest.mark.parametrize("endpoint", BACKENDS, indirect=True)
def test_the_restart_count_is_the_jobs_the_same_on_every_node(endpoint, tmp_path):
    # restart 0: rank 3 fails, the others block; restart 1: everyone exits 0
    agents = _agents(endpoint, {"0:3": 1, "0:*": "hang"}, tmp_path, "--max-restarts=1",
                     rdzv_id=f"count-{endpoint[0]}")
    results = finish_agents(agents)
    assert [code for code, _, _ in results] == [0, 0], [err[-3000:] for _, err, _ in results]
    starts = _starts(tmp_path)
    # every worker of the second round saw TORCHELASTIC_RESTART_COUNT=1, on both nodes
    assert [s for s in starts if s[0] == 1] == [(1, 0), (1, 1), (1, 2), (1, 3)], starts
    # round 0: rank 3 started and failed (the others may have been stopped before they wrote a line)
    assert (0, 3) in starts and {s for s in starts if s[0] == 0} <= {(0, 0), (0, 1), (0, 2), (0, 3)}, starts


@pytest.mark.parametrize("endpoint", ["c10d"], indirect=True)
def test_max_restarts_is_a_budget_for_the_whole_job(endpoint, tmp_path):
    # one failure on each node, in two rounds: a per-node budget of 1 would allow both
    agents = _agents(endpoint, {"0:3": 1, "1:0": 1, "*:*": "hang"}, tmp_path, "--max-restarts=1",
                     rdzv_id="budget")
    results = finish_agents(agents)
    assert [code for code, _, _ in results] == [1, 1], [err[-3000:] for _, err, _ in results]
    assert {r for r, _ in _starts(tmp_path)} == {0, 1}  # no third round
    for _code, err, _ in results:
        root = err.split("Root Cause (first observed failure):", 1)[1].split("Other Failures:", 1)[0]
        assert "rank      : 0 (local_rank: 0)" in root, err[-3000:]


@pytest.mark.parametrize("endpoint", BACKENDS, indirect=True)
def test_a_hung_rank_is_found_its_stacks_dumped_on_every_node_and_the_job_stopped(endpoint, tmp_path):
    # global rank 3 reports progress once, then hangs; the others block without ever reporting
    logs = [tmp_path / "logs0", tmp_path / "logs1"]
    backend, ep = endpoint
    conf = CONF if backend == "c10d" else CONF + ",read_timeout=20"
    agents = [
        start("elaunch", "--nnodes=2", "--nproc-per-node=2", f"--rdzv-backend={backend}", f"--rdzv-endpoint={ep}",
              f"--rdzv-id=hang-{backend}", f"--rdzv-conf={conf}", "--local-addr=127.0.0.1", "--monitor-interval=0.1",
              "--hang-timeout=2", f"--log-dir={log}", FAULT,
              json.dumps({"*:3": "hang-progress", "*:*": "hang"}), str(tmp_path))
        for log in logs
    ]
    results = finish_agents(agents)
    assert [code for code, _, _ in results] == [1, 1], [err[-3000:] for _, err, _ in results]
    for _code, err, _ in results:
        root = err.split("Root Cause (first observed failure):", 1)[1].split("Other Failures:", 1)[0]
        assert "rank      : 3 (local_rank: 1)" in root and "HUNG: no progress for" in root, err[-3000:]
        assert "(job_fault.py:" in root, err[-3000:]  # the hung rank's stack, where it blocks
    stacks = sorted(str(p) for log in logs for p in log.rglob("stacks/*.txt"))
    assert len(stacks) == 2 and any("_hang_" in s for s in stacks) and any("_requested_" in s for s in stacks), stacks
    for path in stacks:  # every worker of the job, on both nodes, with its stack
        text = Path(path).read_text()
        assert text.count("--- local rank") == 2 and "stacks by py-spy" in text, text
        assert "job_fault.py" in text, text


def test_a_forwarded_notice_reaches_every_worker_and_the_job_keeps_running(tmp_path):
    script = tmp_path / "notice.py"
    script.write_text(
        "import os, signal, sys, time\n"
        "out = sys.argv[1]\n"
        "got = []\n"
        "signal.signal(signal.SIGUSR1, lambda s, f: got.append(s))\n"
        "open(os.path.join(out, f'ready_{os.environ[\"RANK\"]}'), 'w').close()\n"
        "deadline = time.monotonic() + 60\n"
        "while not got and time.monotonic() < deadline:\n"
        "    time.sleep(0.02)\n"
        "open(os.path.join(out, f'notice_{os.environ[\"RANK\"]}'), 'w').close()\n"
    )
    agent = start("elaunch", "--standalone", "--nproc-per-node=2", str(script), str(tmp_path))
    try:
        wait_for(lambda: all((tmp_path / f"ready_{r}").exists() for r in (0, 1)), 60, what="workers ready")
        os.kill(agent.pid, signal.SIGUSR1)
        _out, err = agent.communicate(timeout=60)
    finally:
        kill_tree(agent.pid)
    assert agent.returncode == 0, err
    assert all((tmp_path / f"notice_{r}").exists() for r in (0, 1))
    assert "forwarded to the workers" in err


@pytest.mark.parametrize("endpoint", BACKENDS, indirect=True)
def test_an_agent_stopped_by_a_signal_leaves_and_the_others_go_on(endpoint, tmp_path):
    # 2 nodes of --nnodes=1:2; SIGTERM to one agent: the other re-forms alone (not a failure)
    backend, ep = endpoint
    script = [str(SCRIPTS / "env_dump.py"), str(tmp_path), "--wait-for", str(tmp_path / "release")]
    conf = CONF if backend == "c10d" else CONF + ",read_timeout=20"
    agents = [start("elaunch", "--nnodes=1:2", "--nproc-per-node=1", f"--rdzv-backend={backend}",
                    f"--rdzv-endpoint={ep}", f"--rdzv-id=leave-{backend}", f"--rdzv-conf={conf}",
                    "--local-addr=127.0.0.1", "--monitor-interval=0.1", *script) for _ in range(2)]
    try:
        wait_for(lambda: len(list(tmp_path.glob("env_*.json"))) >= 2, 60, what="a world of two")
        sizes = {p.name: json.loads(p.read_text())["env"]["WORLD_SIZE"] for p in tmp_path.glob("env_*.json")}
        assert set(sizes.values()) == {"2"}, sizes
        for p in tmp_path.glob("env_*.json"):
            p.unlink()
        # stop the agent that does not host the store (whichever bound the endpoint first hosts it)
        survivor, victim = _store_host_first(agents, backend, ep)
        victim.send_signal(signal.SIGTERM)
        _out, err = victim.communicate(timeout=60)
        assert victim.returncode == 128 + signal.SIGTERM, err
        wait_for(lambda: any(json.loads(p.read_text())["env"]["WORLD_SIZE"] == "1"
                             for p in tmp_path.glob("env_*.json")), 60, what="the survivor re-formed alone")
        (tmp_path / "release").touch()
        _out, err = survivor.communicate(timeout=60)
        assert survivor.returncode == 0, err
    finally:
        (tmp_path / "release").touch()
        for a in agents:
            kill_tree(a.pid)


def _store_host_first(agents, backend: str, ep: str):
    """``agents`` reordered so the one hosting the c10d store (bound the endpoint) comes first."""
    if backend != "c10d":
        return agents
    port = int(ep.rsplit(":", 1)[1])
    host = next(a for a in agents if any(c.status == psutil.CONN_LISTEN and c.laddr.port == port
                                         for c in psutil.Process(a.pid).net_connections("tcp")))
    return [host] + [a for a in agents if a is not host]


@pytest.mark.parametrize("endpoint", BACKENDS, indirect=True)
def test_a_killed_agent_is_a_lost_node_not_a_failure_of_the_job(endpoint, tmp_path):
    # kill -9 of one agent: its watchdog kills its workers, the survivor's all_reduce fails on the
    # closed socket long before any heartbeat lapses; the survivor must see a lost node (re-form,
    # not counted), not spend the job's budget: with --max-restarts=0 it goes on alone
    backend, ep = endpoint
    conf = CONF if backend == "c10d" else CONF + ",read_timeout=20"
    agents = [start("elaunch", "--nnodes=1:2", "--nproc-per-node=1", "--max-restarts=0",
                    f"--rdzv-backend={backend}", f"--rdzv-endpoint={ep}", f"--rdzv-id=kill9-{backend}",
                    f"--rdzv-conf={conf}", "--local-addr=127.0.0.1", "--monitor-interval=0.1",
                    str(SCRIPTS / "mn_loop.py"), str(tmp_path)) for _ in range(2)]
    rounds = tmp_path / "rounds.txt"
    try:
        wait_for(lambda: (tmp_path / "world_2").exists(), 60, what="a world of two")
        survivor, victim = _store_host_first(agents, backend, ep)
        victim.kill()
        victim.wait(timeout=10)
        wait_for(lambda: (tmp_path / "world_1").exists(), 60, what="the survivor re-formed alone")
        assert rounds.read_text().splitlines() == ["2 2 0", "1 1 0"]  # restart count still 0
        (tmp_path / "stop").touch()
        _out, err = survivor.communicate(timeout=60)
        assert survivor.returncode == 0, err
        assert "worker group failed" not in err, err
        assert "membership changed (0 node(s) waiting to join, 1 lost)" in err, err
    finally:
        (tmp_path / "stop").touch()
        for a in agents:
            kill_tree(a.pid)


BAD_NODE = (
    "import os, sys, time\n"
    "out = sys.argv[1]\n"
    "with open(os.path.join(out, 'starts.log'), 'a') as f:\n"
    "    f.write(f\"{os.environ['TORCHELASTIC_RESTART_COUNT']} {os.environ['WORLD_SIZE']} "
    "{os.environ.get('BAD_NODE', '0')}\\n\")\n"
    "if os.environ.get('BAD_NODE') == '1':\n"
    "    sys.exit(3)  # this node's workers fail every time\n"
    "if os.environ['WORLD_SIZE'] == '2':\n"
    "    sys.exit(0)  # the world without the bad node finishes the job\n"
    "while True:\n"
    "    time.sleep(3600)\n"
)


@pytest.mark.parametrize("endpoint", ["c10d", "etcd-v3"], indirect=True)
def test_a_node_that_causes_failures_in_a_row_sits_out_and_the_others_go_on(endpoint, tmp_path):
    script = tmp_path / "bad_node.py"
    script.write_text(BAD_NODE)
    backend, ep = endpoint
    conf = CONF + ",exclude_after=2,exclude_cooldown=4" + ("" if backend == "c10d" else ",read_timeout=20")
    env_bad = launcher_env(BAD_NODE="1")

    def agent(env=None):
        return start("elaunch", "--nnodes=2:3", "--nproc-per-node=1", f"--rdzv-backend={backend}",
                     f"--rdzv-endpoint={ep}", f"--rdzv-id=exclude-{backend}", f"--rdzv-conf={conf}",
                     "--local-addr=127.0.0.1", "--monitor-interval=0.1", "--max-restarts=5", str(script),
                     str(tmp_path), env=env)

    bad = agent(env_bad)
    if backend == "c10d":
        # the bad node hosts the c10d store, so it can still read that the job finished when it rejoins
        try:
            wait_for(lambda: port_open(int(ep.rsplit(":", 1)[1])), 60, what="the store host listening")
        except BaseException:
            kill_tree(bad.pid)
            raise
    results = finish_agents([agent(), agent(), bad])
    (bad_code, bad_err, _), good = results[2], results[:2]
    assert [code for code, _, _ in good] == [0, 0], [err[-3000:] for _, err, _ in good]
    assert "sitting out the next rounds for 4 s" in bad_err, bad_err[-3000:]
    assert bad_code == 0, bad_err[-3000:]
    rows = [line.split() for line in (tmp_path / "starts.log").read_text().splitlines()]
    bad_starts = [r for r in rows if r[2] == "1"]
    assert len(bad_starts) == 2, rows  # failed twice in a row, then sat out
    # the others finished in a world of two, at the job's restart count 2
    assert ["2", "2", "0"] in rows, rows
