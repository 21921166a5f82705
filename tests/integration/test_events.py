"""The agent's event log (events.jsonl) from real jobs, and ``elaunch timeline`` drawing it.

Real launcher processes: a standalone job with a crash and a restart, a failed job
in a temporary log directory, two c10d agents with a worker failure.
"""

from __future__ import annotations

import json
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from tests.helpers import SCRIPTS, free_port, kill_tree, launcher_cmd, launcher_env, run

DEMO = str(SCRIPTS / "event_demo.py")
SCHEMA = {"time": float, "kind": str, "node": str, "host": str, "round": int}


def _events(root: Path) -> list[dict]:
    files = sorted(root.rglob("events.jsonl"))
    assert len(files) == 1, files
    return [json.loads(line) for line in files[0].read_text().splitlines()]


def _check_schema(events: list[dict]) -> None:
    for e in events:
        for key, typ in SCHEMA.items():
            assert isinstance(e.get(key), typ), (key, e)


def test_crash_and_restart_events_in_order(tmp_path):
    logs = tmp_path / "logs"
    r = run("elaunch", "--standalone", "--nproc-per-node=2", "--max-restarts=1", f"--log-dir={logs}",
            DEMO, json.dumps({"0:1": 3}), "0.4")
    assert r.returncode == 0, r.stderr
    events = _events(logs)
    _check_schema(events)
    assert [e["kind"] for e in events] == [
        "rendezvous_join", "rendezvous_complete", "workers_started", "training", "worker_exited", "worker_exited",
        "restart", "rendezvous_join", "rendezvous_complete", "workers_started", "training", "worker_exited",
        "worker_exited", "job_succeeded"]
    assert [e["round"] for e in events] == [-1, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1]
    assert [e["step"] for e in events if e["kind"] in ("training", "restart", "worker_exited")] == [None] * 7
    events = [e for e in events if e["kind"] != "training"]  # the demo gives no steps: no caught_up either
    assert len({e["node"] for e in events}) == 1
    first = events[2]
    assert first["ranks"] == [0, 1] and first["local_ranks"] == [0, 1]
    exits = {e["rank"]: e for e in events[3:5]}
    assert exits[1]["exitcode"] == 3 and exits[1]["stopped"] is False and exits[1]["pid"] == first["pids"][1]
    # rank 0 was still running: the agent stopped it (SIGTERM)
    assert exits[0]["stopped"] is True and exits[0]["signal"] == "SIGTERM" and exits[0]["pid"] == first["pids"][0]
    restart = events[5]
    assert (restart["counted"], restart["count"], restart["budget"], restart["cause"]) == (True, 1, 1, "failure")
    assert restart["failure"]["rank"] == 1 and restart["failure"]["exitcode"] == 3
    assert events[7]["world_size"] == 1 and events[7]["seconds"] >= 0
    assert all(e["exitcode"] == 0 and not e["stopped"] for e in events[9:11])
    assert events[-1]["restarts"] == 1
    assert [e["time"] for e in events if e["kind"] != "worker_exited"] == sorted(
        e["time"] for e in events if e["kind"] != "worker_exited")


def test_temporary_log_dir_keeps_the_events_of_a_failed_job(tmp_path):
    env = launcher_env(TMPDIR=str(tmp_path))  # the temporary log directory goes here
    r = run("elaunch", "--standalone", "--nproc-per-node=1", "--max-restarts=0", DEMO, json.dumps({"0:0": 5}),
            "0.2", env=env)
    assert r.returncode == 1, r.stderr
    events = _events(tmp_path)
    _check_schema(events)
    assert events[-1]["kind"] == "job_failed"
    assert events[-1]["failure"]["rank"] == 0 and events[-1]["failure"]["exitcode"] == 5
    # a successful job removes its temporary directory, the event log with it (as torchrun's logs)
    ok = tmp_path / "ok"
    ok.mkdir()
    r = run("elaunch", "--standalone", "--nproc-per-node=1", DEMO, "{}", "0.1", env=launcher_env(TMPDIR=str(ok)))
    assert r.returncode == 0, r.stderr
    assert not list(ok.rglob("events.jsonl"))


def test_console_handler_prints_each_event_and_keeps_the_file(tmp_path):
    r = run("elaunch", "--standalone", "--nproc-per-node=1", "--event-log-handler=console", f"--log-dir={tmp_path}",
            DEMO, "{}", "0.1")
    assert r.returncode == 0, r.stderr
    printed = [json.loads(line) for line in r.stderr.splitlines() if line.startswith('{"time"')]
    assert printed == _events(tmp_path)
    quiet = run("elaunch", "--standalone", "--nproc-per-node=1", f"--log-dir={tmp_path / 'null'}", DEMO, "{}", "0.1")
    assert quiet.returncode == 0 and '"kind"' not in quiet.stderr
    assert _events(tmp_path / "null")[-1]["kind"] == "job_succeeded"


@pytest.fixture(scope="module")
def c10d_logs(tmp_path_factory) -> Path:
    """Two c10d agents, two workers each; rank 3 exits 7 in round 0, --max-restarts=1: the job succeeds."""
    logs = tmp_path_factory.mktemp("c10d")
    port = free_port()
    agents = [subprocess.Popen(
        launcher_cmd("elaunch", "--nnodes=2", "--nproc-per-node=2", "--rdzv-backend=c10d",
                     f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=events", "--rdzv-conf=last_call_timeout=1",
                     "--local-addr=127.0.0.1", "--max-restarts=1", f"--log-dir={logs / name}",
                     DEMO, json.dumps({"0:3": 7}), "1"),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=launcher_env()) for name in "ab"]
    try:
        for a in agents:
            _, err = a.communicate(timeout=120)
            assert a.returncode == 0, err
    finally:
        for a in agents:
            kill_tree(a.pid)
    return logs


def test_two_c10d_agents_log_the_same_restart(c10d_logs):
    both = [_events(c10d_logs / name) for name in "ab"]
    for events in both:
        _check_schema(events)
        restarts = [e for e in events if e["kind"] == "restart"]
        # every node logs the job's one restart, with the same root cause
        assert [(e["counted"], e["count"], e["budget"], e["failure"]["rank"]) for e in restarts] == [(True, 1, 1, 3)]
        assert [e["round"] for e in events if e["kind"] == "rendezvous_complete"] == [0, 1]
        assert events[-1]["kind"] == "job_succeeded"
    nodes = {events[0]["node"] for events in both}
    assert len(nodes) == 2  # the rendezvous node ids
    failed = [e for events in both for e in events if e["kind"] == "worker_exited" and not e["stopped"]
              and e["exitcode"] != 0]
    assert [(e["rank"], e["exitcode"], e["round"]) for e in failed] == [(3, 7, 0)]


def _timeline(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "elaunch", "timeline", *args], capture_output=True, text=True,
                          env=launcher_env(), timeout=120)


def test_timeline_svg_of_two_agents(c10d_logs, tmp_path):
    out = tmp_path / "t.svg"
    r = _timeline(str(c10d_logs), "-o", str(out))
    assert r.returncode == 0, r.stderr
    root = ET.parse(out).getroot()
    assert root.tag == "{http://www.w3.org/2000/svg}svg"
    texts = [t.text for t in root.iter("{http://www.w3.org/2000/svg}text")]
    nodes = {_events(c10d_logs / name)[0]["node"] for name in "ab"}
    assert nodes <= set(texts)  # one lane per node
    assert {"r0", "r1", "worker failed", "restart (counted)", "job succeeded"} <= set(texts)  # spans and legend
    tips = [t.text for t in root.iter("{http://www.w3.org/2000/svg}title")]
    assert any(t.startswith("rank 3 failed (exitcode 7)") for t in tips)
    assert sum(t.startswith("restart 1/1") for t in tips) == 2


def test_timeline_html_and_png(c10d_logs, tmp_path):
    html = tmp_path / "t.html"
    assert _timeline(str(c10d_logs / "a"), str(c10d_logs / "b"), "-o", str(html)).returncode == 0
    assert html.read_text().startswith("<!DOCTYPE html>") and "<svg" in html.read_text()
    pytest.importorskip("matplotlib")
    png = tmp_path / "t.png"
    r = _timeline(str(c10d_logs), "-o", str(png))
    assert r.returncode == 0, r.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("args, text", [
    (["/nonexistent/logs", "-o", "x.svg"], "/nonexistent/logs: no such file or directory"),
    (["{empty}", "-o", "x.svg"], "no events.jsonl under"),
    (["{logs}", "-o", "x.gif"], "-o x.gif: unknown picture type '.gif'"),
    (["{logs}"], "-o/--output"),
])
def test_timeline_bad_input_is_one_line_and_exit_2(c10d_logs, tmp_path, args, text):
    (tmp_path / "empty").mkdir()
    args = [a.format(empty=tmp_path / "empty", logs=c10d_logs) for a in args]
    r = _timeline(*args)
    assert r.returncode == 2
    assert len(r.stderr.strip().splitlines()) == 1 and text in r.stderr, r.stderr
