"""Nodes outside the job's last round see its end at once: a node sitting out, a spare.

Two real ``elaunch`` agents on one rendezvous (c10d, whose store node A's agent
hosts, and etcd-v3). Node B sits out a long cooldown (bad-node exclusion) or
stands by as a spare (the world is full) while node A finishes the job: B exits
within one monitor interval of the job's end, 0 when it succeeded, 1 with the
job's root cause when it failed -- not after its cooldown, and not on a store
that vanished with A.
"""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.conftest import wait_for
from tests.helpers import free_port, kill_tree, launcher_env, port_open, start

pytestmark = pytest.mark.slow

CONF = "last_call_timeout=1,join_timeout=60,keep_alive_interval=1,keep_alive_max_attempt=5"
#: --monitor-interval of both agents, seconds: the bound on how late B may see the end
INTERVAL = 1.0
#: seconds of slack on that bound (interpreter exits, a loaded machine)
SLACK = 2.0

# B's workers fail (BAD_NODE=1); A's block in a world of two, and alone wait for `release`,
# say so (`alone`), note when the job ends (`end`) and exit END_CODE
WORKER = (
    "import os, sys, time\n"
    "out = sys.argv[1]\n"
    "if os.environ.get('BAD_NODE') == '1':\n"
    "    sys.exit(3)\n"
    "if os.environ['WORLD_SIZE'] != '1':\n"
    "    time.sleep(3600)\n"
    "open(os.path.join(out, 'alone'), 'w').close()\n"
    "while not os.path.exists(os.path.join(out, 'release')):\n"
    "    time.sleep(0.05)\n"
    "with open(os.path.join(out, 'end'), 'w') as f:\n"
    "    f.write(repr(time.time()))\n"
    "sys.exit(int(os.environ['END_CODE']))\n"
)

OUTCOMES = {"succeeds": 0, "fails": 5}


def _agent(endpoint, tmp: Path, who: str, nnodes: str, conf: str, env: dict, *extra: str) -> subprocess.Popen:
    """Node ``who`` ("a" or "b"), its stderr in ``tmp/<who>.err``."""
    backend, ep = endpoint
    if backend != "c10d":
        conf += ",read_timeout=20"
    with open(tmp / f"{who}.err", "w") as err:  # the child keeps its own copy of the descriptor
        return start("elaunch", f"--nnodes={nnodes}", "--nproc-per-node=1", f"--rdzv-backend={backend}",
                     f"--rdzv-endpoint={ep}", f"--rdzv-id=end-{tmp.name}", f"--rdzv-conf={conf}",
                     "--local-addr=127.0.0.1", f"--monitor-interval={INTERVAL}", *extra, str(tmp / "worker.py"),
                     str(tmp), env=launcher_env(**env), stdout=subprocess.DEVNULL, stderr=err)


def _start_pair(endpoint, tmp: Path, nnodes: str, conf: str, code: int, b_env: dict, *extra: str,
                a_alone: bool = False):
    """Node A (started first: on c10d it hosts the store) and node B (once A's worker runs alone: ``a_alone``)."""
    (tmp / "worker.py").write_text(WORKER)
    a = _agent(endpoint, tmp, "a", nnodes, conf, {"END_CODE": str(code)}, *extra)
    try:
        if endpoint[0] == "c10d":
            wait_for(lambda: port_open(int(endpoint[1].rsplit(":", 1)[1])), 60, what="A hosting the store")
        if a_alone:
            wait_for(lambda: (tmp / "alone").exists(), 60, what="A's worker running alone")
        b = _agent(endpoint, tmp, "b", nnodes, conf, {"END_CODE": str(code), **b_env}, *extra)
    except BaseException:
        kill_tree(a.pid)
        raise
    return a, b


def _err(tmp: Path, who: str) -> str:
    return (tmp / f"{who}.err").read_text()


def _exit_times(procs: list[subprocess.Popen], timeout: float) -> list[float]:
    """``time.time()`` at which each of ``procs`` was seen exited (polled every 20 ms); kills them all after."""
    seen: dict[int, float] = {}

    def all_seen() -> bool:
        now = time.time()
        seen.update({i: now for i, p in enumerate(procs) if i not in seen and p.poll() is not None})
        return len(seen) == len(procs)

    try:
        wait_for(all_seen, timeout, what="both agents to exit")
    finally:
        for p in procs:
            kill_tree(p.pid)
    return [seen[i] for i in range(len(procs))]


def _finish(tmp: Path, a: subprocess.Popen, b: subprocess.Popen, outcome: str) -> None:
    """End the job on A; B must exit with its outcome within one monitor interval (+ slack) of its end."""
    (tmp / "release").touch()
    a_exit, b_exit = _exit_times([a, b], 120)
    code, b_err = OUTCOMES[outcome], _err(tmp, "b")
    assert (a.returncode, b.returncode) == ((0, 0) if code == 0 else (1, 1)), (_err(tmp, "a")[-3000:], b_err[-3000:])
    end = float((tmp / "end").read_text())
    # measured from A's exit, and from the job's end (A's last worker exited)
    assert b_exit - a_exit <= INTERVAL + SLACK, (b_exit - a_exit, b_err[-3000:])
    assert b_exit - end <= INTERVAL + SLACK + 1.0, (b_exit - end, b_err[-3000:])
    if code:
        root = b_err.split("Root Cause (first observed failure):", 1)[1].split("Other Failures:", 1)[0]
        assert f"exitcode  : {code}" in root, b_err[-3000:]
    assert "Traceback" not in b_err and "rendezvous failed" not in b_err, b_err[-3000:]


def _waiting(a: subprocess.Popen, b: subprocess.Popen, tmp: Path, line: str) -> None:
    """Wait until B's log shows ``line``; kill both agents if it never does."""
    try:
        wait_for(lambda: line in _err(tmp, "b"), 60, what=repr(line))
    except AssertionError as exc:
        kill_tree(a.pid)
        kill_tree(b.pid)
        raise AssertionError(f"{exc}\nA:\n{_err(tmp, 'a')[-2000:]}\nB:\n{_err(tmp, 'b')[-2000:]}") from None
    except BaseException:
        kill_tree(a.pid)
        kill_tree(b.pid)
        raise


@pytest.mark.parametrize("outcome", sorted(OUTCOMES))
@pytest.mark.parametrize("endpoint", ["c10d", "etcd-v3"], indirect=True)
def test_a_node_sitting_out_exits_when_the_job_ends(endpoint, tmp_path, outcome):
    # B's workers fail once: it is blamed (exclude_after=1) and sits out 60 s; A re-forms alone
    # and ends the job (its worker exits END_CODE; --max-restarts=1 is spent by B's failure)
    conf = CONF + ",exclude_after=1,exclude_cooldown=60"
    a, b = _start_pair(endpoint, tmp_path, "1:2", conf, OUTCOMES[outcome], {"BAD_NODE": "1"}, "--max-restarts=1")
    _waiting(a, b, tmp_path, "sitting out the next rounds for 60 s")
    _finish(tmp_path, a, b, outcome)


@pytest.mark.parametrize("outcome", sorted(OUTCOMES))
@pytest.mark.parametrize("endpoint", ["c10d", "etcd-v3"], indirect=True)
def test_a_spare_exits_when_the_job_ends(endpoint, tmp_path, outcome):
    # --nnodes=1:1: A runs the job, B stands by as a spare (the world is full) until it ends
    a, b = _start_pair(endpoint, tmp_path, "1:1", CONF, OUTCOMES[outcome], {"LOGLEVEL": "INFO"},
                       "--max-restarts=0", a_alone=True)
    _waiting(a, b, tmp_path, "waiting as a spare")
    _finish(tmp_path, a, b, outcome)


def test_a_signal_still_stops_a_node_sitting_out(tmp_path):
    port = free_port()
    conf = CONF + ",exclude_after=1,exclude_cooldown=60"
    a, b = _start_pair(("c10d", f"127.0.0.1:{port}"), tmp_path, "1:2", conf, 0, {"BAD_NODE": "1"},
                       "--max-restarts=1")
    _waiting(a, b, tmp_path, "sitting out the next rounds for 60 s")
    b.send_signal(signal.SIGTERM)
    try:
        b.wait(timeout=INTERVAL + SLACK + 5)  # a deadline, not the bound under test: the handler interrupts the wait
    finally:
        if b.poll() is None:
            kill_tree(a.pid)
            kill_tree(b.pid)
    assert b.returncode == 128 + signal.SIGTERM, _err(tmp_path, "b")[-3000:]
    # B left the rendezvous: A, ending the job, does not wait for it
    (tmp_path / "release").touch()
    a_exit, _ = _exit_times([a, b], 120)
    end = float((tmp_path / "end").read_text())
    assert a.returncode == 0, _err(tmp_path, "a")[-3000:]
    assert a_exit - end <= INTERVAL + SLACK, (a_exit - end, _err(tmp_path, "a")[-3000:])
