"""``elaunch timeline`` on event lines whose fields have the wrong types, and on an output it cannot write.

Real files, the real command in a subprocess: a line of the wrong types is skipped
like a line that is not JSON (the good lines draw exactly as without it), never a
traceback; an output path that cannot be written is one line and exit 2.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import launcher_env

T0 = 1716212400.0


def ev(t: float, kind: str, **fields) -> dict:
    return {"time": T0 + t, "kind": kind, "node": "vm_1", "host": "vm", "round": 0, **fields}


FAILURE = {"rank": 1, "host": "vm", "exitcode": 3, "signal": None, "message": "boom"}
#: A job with a crash, a counted restart, a hang and a restore: the good lines of every file.
GOOD = [
    ev(0, "rendezvous_join", round=-1),
    ev(1, "rendezvous_complete", rank=0, world_size=1, seconds=1.0, nodes=["127.0.0.1"], restart_count=None),
    ev(2, "workers_started", attempt=0, ranks=[0, 1], local_ranks=[0, 1], pids=[10, 11], master="127.0.0.1:1"),
    ev(3, "training", step=2),
    ev(9, "worker_exited", rank=0, local_rank=0, pid=10, exitcode=-15, signal="SIGTERM", stopped=True, step=14),
    ev(8, "worker_exited", rank=1, local_rank=1, pid=11, exitcode=3, signal=None, stopped=False, step=14),
    ev(9, "restart", counted=True, count=1, budget=1, cause="failure", failed_round=0, failure=FAILURE, step=14),
    ev(9, "rendezvous_join"),
    ev(10, "rendezvous_complete", round=1, rank=0, world_size=1, seconds=1.0, nodes=["127.0.0.1"],
       restart_count=1),
    ev(10.5, "checkpoint_restore", round=1, step=14, sources={"0": "memory", "1": "disk"}),
    ev(11, "workers_started", round=1, attempt=1, ranks=[0, 1], local_ranks=[0, 1], pids=[12, 13], master="x:1"),
    ev(12, "training", round=1, step=8),
    ev(14, "hang", round=1, ranks=[1], culprit=1, stuck=False, quiet_seconds=1.5),
    ev(15, "worker_exited", round=1, rank=0, local_rank=0, pid=12, exitcode=0, signal=None, stopped=False, step=20),
    ev(15, "worker_exited", round=1, rank=1, local_rank=1, pid=13, exitcode=0, signal=None, stopped=False, step=20),
    ev(15, "job_succeeded", round=1, restarts=1),
]

#: name -> a valid JSON line whose fields have the wrong types (each crashed the command, or moved the drawing).
BAD = {
    "round not an int": ev(4, "rendezvous_complete", round="x", rank=0, world_size=1),
    "ranks null": ev(4, "workers_started", ranks=None, local_ranks=[0], pids=[99]),
    "failure a string": ev(4, "restart", counted=True, count=1, budget=1, cause="failure", failure="str"),
    "time 1e300": ev(4, "notice", signal="SIGUSR1") | {"time": 1e300},
    "time Infinity": ev(4, "notice", signal="SIGUSR1") | {"time": float("inf")},
    "time NaN": ev(4, "notice", signal="SIGUSR1") | {"time": float("nan")},
    "time negative": ev(4, "notice", signal="SIGUSR1") | {"time": -5.0},
    "time a bool": ev(4, "notice", signal="SIGUSR1") | {"time": True},
    "kind a list": ev(4, "notice", signal="SIGUSR1") | {"kind": ["hang"]},
    "local rank not an int": ev(4, "worker_exited", rank=0, local_rank="x", pid=98, exitcode=1, stopped=False),
    "hang ranks null": ev(4, "hang", ranks=None, stuck=False),
    "quiet_seconds a string": ev(4, "hang", ranks=[0], stuck=False, quiet_seconds="x"),
    "sources a list": ev(4, "checkpoint_restore", step=1, sources=["memory"]),
    "node_check nodes of strings": ev(4, "node_check", faulty=["n1"], sitting_out=[], nodes={"n1": "slow"}),
    "membership came a number": ev(4, "membership_change", came=5, left=[]),
    "job_failed failure a list": ev(4, "job_failed", restarts=0, failure=[1]),
}


def _write(path: Path, events: list[dict]) -> Path:
    path.write_text("".join(json.dumps(e) + "\n" for e in events))
    return path


def _timeline(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "elaunch", "timeline", *args], capture_output=True, text=True,
                          cwd=cwd, env=launcher_env(), timeout=120)


@pytest.fixture
def good_svg(tmp_path: Path) -> str:
    """The drawing of the good lines alone."""
    (tmp_path / "good").mkdir()
    r = _timeline(tmp_path, str(_write(tmp_path / "good" / "events.jsonl", GOOD)), "-o", "good.svg")
    assert r.returncode == 0, r.stderr
    svg = (tmp_path / "good.svg").read_text()
    assert "restart 1/1 after rank 1 on vm failed" in svg and "rank 1 failed (exitcode 3)" in svg
    assert "hang: ranks 1" in svg and "restore of step 14" in svg
    return svg


@pytest.mark.parametrize("name", sorted(BAD))
def test_a_line_of_the_wrong_types_is_skipped(tmp_path, good_svg, name):
    events = GOOD[:4] + [BAD[name]] + GOOD[4:]
    r = _timeline(tmp_path, str(_write(tmp_path / "events.jsonl", events)), "-o", "t.svg")
    assert (r.returncode, r.stderr) == (0, ""), r.stderr
    assert (tmp_path / "t.svg").read_text() == good_svg  # drawn exactly as without the bad line


def test_a_file_of_mixed_good_and_bad_lines_draws_the_good_ones(tmp_path, good_svg):
    lines = [json.dumps(e) for e in GOOD]
    for i, bad in enumerate(BAD.values()):  # spread among the good lines, with a cut line and a non-event
        lines.insert(1 + 2 * i % len(lines), json.dumps(bad))
    lines[3:3] = ['{"time": 1716212404.0, "kind": "noti', "[1, 2]", '{"kind": "notice"}']
    (tmp_path / "events.jsonl").write_text("\n".join(lines) + "\n")
    r = _timeline(tmp_path, str(tmp_path / "events.jsonl"), "-o", "t.svg")
    assert (r.returncode, r.stderr) == (0, ""), r.stderr
    assert (tmp_path / "t.svg").read_text() == good_svg


def test_a_file_of_only_bad_lines_is_one_line_and_exit_2(tmp_path):
    path = _write(tmp_path / "events.jsonl", [BAD["time 1e300"], BAD["ranks null"]])
    r = _timeline(tmp_path, str(path), "-o", "t.svg")
    assert r.returncode == 2
    assert r.stderr.splitlines() == [f"elaunch timeline: error: no events in {path}"]
    assert not (tmp_path / "t.svg").exists()


@pytest.mark.parametrize("output, why", [("nodir/x.svg", "No such file or directory"),
                                         ("nodir/x.html", "No such file or directory"),
                                         ("adir.svg", "Is a directory")])
def test_an_output_that_cannot_be_written_is_one_line_and_exit_2(tmp_path, output, why):
    (tmp_path / "adir.svg").mkdir()
    path = _write(tmp_path / "events.jsonl", GOOD)
    r = _timeline(tmp_path, str(path), "-o", output)
    assert r.returncode == 2
    assert r.stderr.splitlines() == [f"elaunch timeline: error: cannot write {output}: {why}"], r.stderr
    assert not (tmp_path / "nodir").exists()
