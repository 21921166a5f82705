"""``elaunch status`` against real c10d jobs: table, --json, --stacks, a wrong id, a finished job, no store."""

from __future__ import annotations

import pytest

from tests.helpers import alive, free_port
from tests.status_job import (
    assert_one_line_error,
    finish,
    start_job,
    status,
    status_json,
    wait_started,
    worker_pids,
)

pytestmark = pytest.mark.slow
pytest.importorskip("torch")

CONF = "last_call_timeout=1,join_timeout=60"


def test_status_of_a_running_c10d_job_then_of_the_finished_one(tmp_path):
    port = free_port()
    endpoint = f"127.0.0.1:{port}"
    agents = start_job("c10d", endpoint, "st", tmp_path, CONF, fail_first=True, max_restarts=2)
    flags = [f"--rdzv-endpoint={endpoint}", "--rdzv-id=st", "--rdzv-backend=c10d"]
    try:
        workers = wait_started(tmp_path, 1)  # rank 1 failed in restart 0: one restart used
        agent_pids = sorted(a.pid for a in agents)

        doc = status_json(*flags)
        assert (doc["schema"], doc["backend"], doc["run_id"], doc["state"]) == (1, "c10d", "st", "running")
        assert sorted(n["pid"] for n in doc["nodes"]) == agent_pids
        assert sorted(n["ranks"] for n in doc["nodes"]) == [[0], [1]]
        assert [n["group_rank"] for n in doc["nodes"]] == [0, 1]
        assert all(n["addr"] == "127.0.0.1" and n["joined_at"] and not n["dead"] for n in doc["nodes"])
        assert all(0 <= n["heartbeat_age"] for n in doc["nodes"])
        assert doc["waiting"] == []
        assert doc["restarts"] == {"used": 1, "max": 2, "budgets": [2]}
        assert (doc["failure"]["round"], doc["failure"]["rank"], doc["failure"]["exitcode"]) == (0, 1, 3)
        round_ = doc["round"]

        table = status(*flags)
        assert table.returncode == 0, table.stderr
        text = table.stdout
        assert f"round {round_}: running" in text
        assert all(str(pid) in text for pid in agent_pids)
        assert "restarts used: 1 of 2" in text
        assert "last failure: round 0, rank 1" in text and "exitcode 3" in text

        stacks = status(*flags, "--stacks")
        assert stacks.returncode == 0, stacks.stderr
        assert stacks.stdout.count("blocked_in_status_test") == 1, stacks.stdout
        assert "=== ranks 0,1 (2 workers) ===" in stacks.stdout

        wrong = status(f"--rdzv-endpoint={endpoint}", "--rdzv-id=not-this-job")
        assert_one_line_error(wrong, "not-this-job", endpoint)

        # the job goes on unchanged: same round, same workers, no restart
        after = status_json(*flags)
        assert (after["round"], after["state"], after["restarts"]["used"]) == (round_, "running", 1)
        assert worker_pids(tmp_path, 1) == workers and all(alive(p) for p in workers.values())
        assert not list(tmp_path.glob("started_*_2"))
    finally:
        results = finish(agents, tmp_path)
    for code, err in results:
        assert code == 0, err
    assert not list(tmp_path.glob("started_*_2"))
    # finished: the agent that hosted the store is gone with it
    gone = status(*flags, "--rdzv-conf=read_timeout=2")
    assert_one_line_error(gone, endpoint)


def test_status_against_a_stopped_store_is_one_line_and_exit_1():
    endpoint = f"127.0.0.1:{free_port()}"  # nothing listens there
    proc = status(f"--rdzv-endpoint={endpoint}", "--rdzv-id=x", "--rdzv-conf=read_timeout=2", timeout=60)
    assert_one_line_error(proc, endpoint, "read_timeout=2")


@pytest.mark.parametrize("args, needle", [
    (["--rdzv-backend=static", "--rdzv-endpoint=127.0.0.1:1"], "--rdzv-backend=static"),
    (["--rdzv-backend=c10d"], "--rdzv-endpoint"),
    (["--rdzv-endpoint=127.0.0.1:1", "--rdzv-conf=read_timeout"], "--rdzv-conf"),
    (["--rdzv-endpoint=127.0.0.1:1", "--no-such-flag"], "--no-such-flag"),
])
def test_bad_input_is_one_line_and_exit_2(args, needle):
    proc = status(*args)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], proc.stderr
