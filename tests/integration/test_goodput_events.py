"""The goodput ledger's events from a real agent and real workers: training, caught_up, steps at a stop.

A standalone job whose workers report steps (tests/scripts/step_demo.py): local rank 1
exits 3 at step 12, the restarted workers resume from step 5 and run to step 30.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from elaunch.agent.ledger import ledger_of, ledgers
from elaunch.timeline.model import LEDGER
from tests.helpers import SCRIPTS, launcher_env, run

STEPS = str(SCRIPTS / "step_demo.py")
DEMO = str(SCRIPTS / "event_demo.py")


def _events(root: Path) -> list[dict]:
    files = sorted(root.rglob("events.jsonl"))
    assert len(files) == 1, files
    return [json.loads(line) for line in files[0].read_text().splitlines()]


def test_crash_and_restart_give_training_and_caught_up_with_the_steps(tmp_path):
    r = run("elaunch", "--standalone", "--nproc-per-node=2", "--max-restarts=1", f"--log-dir={tmp_path}",
            STEPS, "12", "5", "30")
    assert r.returncode == 0, r.stderr
    events = _events(tmp_path)
    kinds = [e["kind"] for e in events]
    assert kinds == [
        "rendezvous_join", "rendezvous_complete", "workers_started", "training", "worker_exited", "worker_exited",
        "restart", "rendezvous_join", "rendezvous_complete", "workers_started", "training", "caught_up",
        "worker_exited", "worker_exited", "job_succeeded"]
    started, training = events[2], events[3]
    assert started["time"] <= training["time"] and 0 <= training["step"] <= 12
    # the group stopped at step 12 (rank 0 waited there): worker_exited and restart say so
    assert [e["step"] for e in events[4:7]] == [12, 12, 12]
    assert events[6]["cause"] == "failure" and events[6]["counted"] is True
    again, caught = events[10], events[11]
    assert events[9]["time"] <= again["time"] <= caught["time"]
    assert 5 <= again["step"] < 12 <= caught["step"] < 30  # resumed at 5, caught up once back at 12
    assert [e["step"] for e in events[12:14]] == [30, 30]
    # the ledger: restoring is the time from training to caught_up (steps 5..12 again: about 0.35 s)
    out = ledger_of(events)
    s = out["seconds"]
    assert s["restoring"] == pytest.approx(caught["time"] - again["time"])
    assert s["restoring"] >= 6 * 0.05
    assert 0 < out["goodput"] < 1
    assert sum(s.values()) == pytest.approx(events[-1]["time"] - events[0]["time"])
    assert list(ledgers(events)) == [events[0]["node"]]
    # elaunch timeline draws it: the restoring run in its own colour, the goodput by the lane
    svg = tmp_path / "t.svg"
    t = subprocess.run([sys.executable, "-m", "elaunch", "timeline", str(tmp_path), "-o", str(svg)],
                       capture_output=True, text=True, env=launcher_env(), timeout=120)
    assert t.returncode == 0, t.stderr
    text = svg.read_text()
    assert f'fill="{LEDGER["restoring"][1]}"><title>lost: restoring' in text
    assert f"goodput {out['goodput']:.1%}" in text


def test_no_steps_no_caught_up_and_restoring_stays_zero(tmp_path):
    r = run("elaunch", "--standalone", "--nproc-per-node=1", "--max-restarts=1", f"--log-dir={tmp_path}",
            DEMO, json.dumps({"0:0": 3}), "0.6")
    assert r.returncode == 0, r.stderr
    events = _events(tmp_path)
    assert [e["kind"] for e in events].count("training") == 2
    assert "caught_up" not in [e["kind"] for e in events]
    assert ledger_of(events)["seconds"]["restoring"] == 0.0


def test_hang_gives_quiet_seconds_and_hung_time(tmp_path):
    r = run("elaunch", "--standalone", "--nproc-per-node=1", "--max-restarts=0", "--hang-timeout=1",
            f"--log-dir={tmp_path}", DEMO, json.dumps({"0:0": "hang"}), "0.6")
    assert r.returncode == 1, r.stderr
    events = _events(tmp_path)
    hang = next(e for e in events if e["kind"] == "hang")
    assert hang["quiet_seconds"] >= 1.0
    s = ledger_of(events)["seconds"]
    assert s["hung"] >= hang["quiet_seconds"]  # the quiet time, and the verdict until the stop
