"""``elaunch status`` against real etcd jobs (v2 and v3 APIs): running, --stacks, a wrong id, finished, no etcd."""

from __future__ import annotations

import pytest

from tests.helpers import alive, free_port
from tests.status_job import assert_one_line_error, finish, start_job, status, status_json, wait_started, worker_pids

pytestmark = pytest.mark.slow

CONF = "last_call_timeout=1,join_timeout=60,read_timeout=20,keep_alive_interval=1,keep_alive_max_attempt=10"


@pytest.mark.parametrize("backend", ["etcd-v2", "etcd-v3"])
def test_status_of_a_running_then_finished_etcd_job(backend, etcd_v2, etcd_v3, tmp_path):
    endpoint = (etcd_v3 if backend == "etcd-v3" else etcd_v2).endpoints
    rdzv_id = f"status-{backend}"
    agents = start_job(backend, endpoint, rdzv_id, tmp_path, CONF, max_restarts=1)
    flags = [f"--rdzv-backend={backend}", f"--rdzv-endpoint={endpoint}", f"--rdzv-id={rdzv_id}",
             "--rdzv-conf=read_timeout=10"]
    try:
        workers = wait_started(tmp_path, 0)
        doc = status_json(*flags)
        assert (doc["backend"], doc["state"], doc["restarts"]) == (backend, "running",
                                                                   {"used": 0, "max": 1, "budgets": [1]})
        assert sorted(n["pid"] for n in doc["nodes"]) == sorted(a.pid for a in agents)
        assert sorted(n["ranks"] for n in doc["nodes"]) == [[0], [1]]
        assert doc["failure"] is None and doc["waiting"] == []

        table = status(*flags)
        assert table.returncode == 0, table.stderr
        assert f"round {doc['round']}: running" in table.stdout and "restarts used: 0 of 1" in table.stdout

        stacks = status(*flags, "--stacks")
        assert stacks.returncode == 0, stacks.stderr
        assert stacks.stdout.count("blocked_in_status_test") == 1, stacks.stdout
        assert "=== ranks 0,1 (2 workers) ===" in stacks.stdout

        wrong = status(f"--rdzv-backend={backend}", f"--rdzv-endpoint={endpoint}", "--rdzv-id=not-this-job")
        assert_one_line_error(wrong, "not-this-job", endpoint)

        after = status_json(*flags)
        assert (after["round"], after["state"], after["restarts"]["used"]) == (doc["round"], "running", 0)
        assert worker_pids(tmp_path, 0) == workers and all(alive(p) for p in workers.values())
    finally:
        results = finish(agents, tmp_path)
    for code, err in results:
        assert code == 0, err
    assert not list(tmp_path.glob("started_*_1"))  # no restart
    done = status_json(*flags)  # etcd keeps the finished job's state (ttl)
    assert (done["round"], done["state"], done["failure"]) == (doc["round"], "closed", None)
    assert "closed" in status(*flags).stdout


@pytest.mark.parametrize("backend", ["etcd-v2", "etcd-v3"])
def test_status_against_a_stopped_etcd_is_one_line_and_exit_1(backend, etcd_bin):
    endpoint = f"127.0.0.1:{free_port()}"  # no etcd there
    proc = status(f"--rdzv-backend={backend}", f"--rdzv-endpoint={endpoint}", "--rdzv-id=x",
                  "--rdzv-conf=read_timeout=2", timeout=60)
    assert_one_line_error(proc, endpoint)
