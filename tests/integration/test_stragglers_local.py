"""Stragglers among one node's ranks (issue 26): a standalone job, where the exchange holds only this node.

Three local gloo workers (``tests/scripts/straggler_worker.py``: all-reduce, 20 ms of CPU, then
``elaunch.progress(step=)``), 2 s windows; a real CPU cap (``tests/cpu_cap.py``) on local rank 1 in
the middle of the run gets it named within 3 windows: the WARNING line and the ``straggler`` event.
"""

from __future__ import annotations

import json
import subprocess
import time

import pytest

from tests.conftest import wait_for
from tests.cpu_cap import CpuCap
from tests.helpers import SCRIPTS, kill_tree, launcher_env, start

WINDOW = 2.0


def _named(log_dir) -> list[dict]:
    return [e for path in log_dir.rglob("events.jsonl") for e in map(json.loads, path.read_text().splitlines())
            if e["kind"] == "straggler" and e["stragglers"]]


@pytest.mark.long  # in the long part (scripts/test.sh --long): a CPU cap over several 2 s windows; the suite is near its 20 minutes
def test_a_capped_local_rank_is_named_within_three_windows(tmp_path):
    out, logs = tmp_path / "out", tmp_path / "logs"
    out.mkdir()
    agent = start("elaunch", "--standalone", "--nproc-per-node=3", f"--rdzv-conf=straggler_window={WINDOW:g}",
                  f"--log-dir={logs}", str(SCRIPTS / "straggler_worker.py"), str(out), "cpu", "0.02",
                  env=launcher_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    cap = None
    try:
        wait_for(lambda: (out / "training").exists() and (out / "pid_x_1").exists(), 60, interval=0.1,
                 what="the group's first step")
        healthy_until = time.time() + 2 * WINDOW
        wait_for(lambda: time.time() >= healthy_until, 3 * WINDOW, what="two healthy windows")
        assert _named(logs) == []
        cap = CpuCap(0.1)
        cap.add(int((out / "pid_x_1").read_text()))
        capped_at = time.time()
        named = wait_for(lambda: _named(logs), 3 * WINDOW + 5, interval=0.2, what="the straggler event")
        (out / "stop").touch()
        _, err = agent.communicate(timeout=60)
    finally:
        kill_tree(agent.pid)
        if cap is not None:
            cap.close()
    assert agent.returncode == 0, err
    first = named[0]
    assert first["stragglers"] == [1] and first["named"][0]["node"], first  # the local node's id
    assert first["time"] - capped_at <= 3 * WINDOW + 1.0, (first["time"] - capped_at, first)
    assert "straggler: rank 1 on" in err, err
