"""The in-process restart benchmark (issue 37): its journal reading and rows as tables, and a --quick way end to end.

The quick run is structure only: no time is asserted (the machine is shared and noisy).
"""

from __future__ import annotations

import json
import subprocess
import sys

import psutil
import pytest

from benchmarks.inprocess import TAG_VAR, Journal, rows_of
from tests.conftest import REPO
from tests.helpers import kill_tree, launcher_env

T = 1000.0  # the fault


def _journal(tmp_path, records):
    (tmp_path / "journal").mkdir()
    by_pid: dict[int, list[dict]] = {}
    for r in records:
        by_pid.setdefault(r["pid"], []).append(r)
    for pid, recs in by_pid.items():
        (tmp_path / "journal" / f"{pid}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    return Journal(tmp_path)


def step(pid, rank, t, call, world=3, n=0):
    return {"ev": "step", "pid": pid, "rank": rank, "world": world, "call": call, "t": t, "step": n}


CASES = {
    # survivors 1 and 3 keep their processes (new main() calls), 4 replaces 2: the slowest rank's first step
    "in process, replaced": ([step(1, 0, T - 0.1, 0), step(2, 1, T - 0.1, 0), step(3, 2, T - 0.1, 0),
                              step(1, 0, T + 0.4, T + 0.1), step(3, 2, T + 0.4, T + 0.1),
                              step(4, 1, T + 0.45, T + 0.2)], {0: 0.4, 1: 0.45, 2: 0.4}),
    # a survivor's step of the old main() call that ends after the fault is not the new round's
    "old call's step": ([step(1, 0, T + 0.05, 0, world=2), step(1, 0, T + 0.3, T + 0.1, world=2),
                         step(3, 1, T + 0.3, T + 0.1, world=2)],
                        {0: 0.3, 1: 0.3}),
    # the world shrank to 2 (NVRx): ranks 0-1 of world 2 are the round
    "shrunk": ([step(1, 0, T + 0.5, T + 0.1, world=2), step(3, 1, T + 0.6, T + 0.1, world=2)], {0: 0.5, 1: 0.6}),
    # rank 1 has not stepped yet: not recovered
    "partial": ([step(1, 0, T + 0.5, T + 0.1), step(3, 2, T + 0.5, T + 0.1)], None),
}


@pytest.mark.parametrize("case", CASES)
def test_recovery_is_every_rank_of_the_new_round_stepping(case, tmp_path):
    records, want = CASES[case]
    got = _journal(tmp_path, records).recovered(T)
    assert (None if got is None else {r: round(rec["t"] - T, 3) for r, rec in got.items()}) == want


def test_rows_keep_world_and_pids_and_judge_the_target():
    def sample(seconds, world_after, kept, survivors=2):
        return {"seconds": seconds, "world_after": world_after, "pids_kept": kept, "survivors": survivors}

    results = [
        {"key": "kill.elaunch_inprocess", "samples": [sample(0.3, 3, 2), sample(0.4, 3, 2), sample(0.9, 3, 2)],
         "note": None, "exit_codes": [[0]]},
        {"key": "kill.nvrx_fast", "samples": [sample(0.2, 2, 2)], "note": None, "exit_codes": [[None, 0, 0]]},
        {"key": "kill.torchrun", "samples": [sample(8.0, 3, 0)], "note": None, "exit_codes": [[0]]},
        {"key": "raise.elaunch_inprocess", "samples": [], "note": "not run: no training", "exit_codes": []},
    ]
    rows = {r["key"]: r for r in rows_of(results)}
    mine = rows["kill.elaunch_inprocess"]
    assert (mine["median"], mine["vs"], mine["ratio"], mine["met"]) == (0.4, "kill.torchrun", 0.05, True)
    assert mine["pids_kept"] == ["2 of 2"] * 3 and mine["jobs_ended"] == "1 of 1"
    assert rows["kill.nvrx_fast"]["world_after"] == [2] and rows["kill.nvrx_fast"]["jobs_ended"] == "0 of 1"
    assert rows["raise.elaunch_inprocess"]["median"] is None and rows["raise.elaunch_inprocess"]["met"] is False
    assert rows["raise.elaunch_inprocess"]["note"] == "not run: no training"


@pytest.mark.slow
@pytest.mark.bench
def test_quick_way_end_to_end(tmp_path):
    """One way (elaunch's full restart with --warm-start: the cheapest), one SIGKILL: a row, nothing left behind."""
    out = tmp_path / "result.json"
    proc = subprocess.Popen([sys.executable, "-m", "benchmarks.inprocess", "--quick", "--only",
                             "kill.elaunch_full_warm", "--json", str(out), "--work-dir", str(tmp_path / "work")],
                            cwd=REPO, env=launcher_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        kill_tree(proc.pid)
    assert proc.returncode == 0, stderr[-3000:]
    (row,) = json.loads(out.read_text())["rows"]
    assert row["key"] == "kill.elaunch_full_warm" and row["note"] is None, row
    assert len(row["values"]) == 1 and row["world_after"] == [3] and row["pids_kept"] == ["0 of 2"]
    assert "| fault -> training, a rank SIGKILLed: elaunch, full restart, --warm-start |" in stdout
    left = []
    for p in psutil.process_iter():
        try:
            if TAG_VAR in p.environ() and p.cwd().startswith(str(tmp_path)):  # this run's, not another's
                left.append(p)
        except psutil.Error:
            pass
    assert not left
