"""``elaunch status`` shows GOODPUT per node and for the job, from each agent's events.jsonl (a real c10d job)."""

from __future__ import annotations

from pathlib import Path

import pytest

from elaunch.agent.ledger import ledger_of
from elaunch.status.goodput import read_events
from tests.conftest import wait_for
from tests.helpers import SCRIPTS, free_port, start_agent
from tests.status_job import finish, status, status_json, worker_pids

pytestmark = pytest.mark.slow
pytest.importorskip("torch")

WORKER = str(SCRIPTS / "progress_until_go.py")


def _events_of(log_dir: str) -> list[dict]:
    return read_events(str(Path(log_dir) / "events.jsonl")) or []


def test_status_shows_each_nodes_goodput_and_the_jobs(tmp_path):
    endpoint = f"127.0.0.1:{free_port()}"
    agents = [start_agent("c10d", endpoint, WORKER, str(tmp_path), rdzv_id="gp",
                          extra=(f"--log-dir={tmp_path / f'logs{i}'}",)) for i in range(2)]
    flags = [f"--rdzv-endpoint={endpoint}", "--rdzv-id=gp", "--rdzv-backend=c10d"]
    try:
        wait_for(lambda: len(worker_pids(tmp_path, 0)) == 2, 90, what="both workers reporting steps")
        # training is logged once every rank reported (the agent looks within 5 s)
        wait_for(lambda: all(any(e["kind"] == "training" for e in _events_of(str(d)))
                             for d in sorted(tmp_path.glob("logs*/*"))), 30, what="both nodes' training events")
        doc = status_json(*flags)
        nodes = doc["nodes"]
        assert len(nodes) == 2 and all(n["goodput"] is not None for n in nodes)
        for n in nodes:
            mine = ledger_of(_events_of(n["log_dir"]), now=doc["read_at"])
            assert n["goodput"]["seconds"] == pytest.approx(mine["seconds"], abs=1e-6)
            assert 0 < n["goodput"]["goodput"] < 1
        job = doc["goodput"]
        assert job["nodes_read"] == 2
        total = sum(sum(n["goodput"]["seconds"].values()) for n in nodes)
        productive = sum(n["goodput"]["seconds"]["productive"] for n in nodes)
        assert job["goodput"] == pytest.approx(productive / total)

        table = status(*flags)
        assert table.returncode == 0, table.stderr
        header = next(line for line in table.stdout.splitlines() if line.startswith("NODE"))
        assert header.endswith("GOODPUT")
        assert "goodput: " in table.stdout and "event logs of 2 of 2 node(s)" in table.stdout
    finally:
        results = finish(agents, tmp_path)
    for code, err in results:
        assert code == 0, err
