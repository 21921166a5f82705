"""AgentEvents' goodput events and fields (training, caught_up, step, quiet_seconds), written to a real file."""

from __future__ import annotations

import json
from types import SimpleNamespace

from elaunch.agent.events import AgentEvents


def test_training_caught_up_and_the_step_of_a_stop(tmp_path):
    path = tmp_path / "events.jsonl"
    now = [100.0]
    ev = AgentEvents(str(path), "n", "h", budget=1, clock=lambda: now[0])
    workers = [SimpleNamespace(local_rank=0, global_rank=0, pid=11)]
    ev.workers_started(0, workers, {0: 11}, "m:1")
    ev.training(None, at=99.5)  # a worker that called progress() before the line was written
    now[0] = 101.0
    ev.workers_exited(workers, {0: None}, {0: -15}, {0: 100.8}, step=41)
    ev.restart(True, 1, "failure")
    now[0] = 102.0
    ev.workers_started(1, workers, {0: 12}, "m:1")
    ev.training(30, at=102.25)
    ev.caught_up(41)
    ev.hang({0: object()}, culprit=0, quiet_seconds=2.0004)
    ev.close()
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    pick = [(e["kind"], e["time"], e.get("step"), e.get("quiet_seconds")) for e in lines]
    assert pick == [("workers_started", 100.0, None, None), ("training", 100.0, None, None),
                    ("worker_exited", 100.8, 41, None), ("restart", 101.0, 41, None),
                    ("workers_started", 102.0, None, None), ("training", 102.25, 30, None),
                    ("caught_up", 102.0, 41, None), ("hang", 102.0, None, 2.0)]
    assert "step" in lines[1] and lines[1]["step"] is None  # null, not missing


def test_a_hang_without_a_quiet_time_says_null(tmp_path):
    path = tmp_path / "events.jsonl"
    ev = AgentEvents(str(path), "n", "h", budget=0, clock=lambda: 5.0)
    ev.hang({3: object()}, culprit=None, stuck=True)
    ev.close()
    assert json.loads(path.read_text())["quiet_seconds"] is None
