"""The benchmark suite in --quick mode: it runs end to end and reports numbers for both launchers.

Structure only: no timing is asserted (the machine is shared and noisy).
"""

from __future__ import annotations

import importlib.util
import json
import re
import os
import shutil
import subprocess
import sys

import pytest

from tests.conftest import REPO
from tests.helpers import kill_tree, launcher_env

pytestmark = [pytest.mark.slow, pytest.mark.bench]

LAUNCHERS = ("elaunch", "torchrun")
#: (metric key, launchers that must have produced a number); torchrun never completes a scale-up,
#: never stops the healthy node of a job whose other node failed, and has no hang detection.
REQUIRED = [
    ("launch.wall", LAUNCHERS), ("launch.cpu", LAUNCHERS), ("launch.rss", LAUNCHERS),
    *((f"launch_features.{key}", LAUNCHERS) for key in ("plain", "checkpoint_dir", "checkpoint_replicas",
                                                        "metrics_port", "hang_timeout", "stragglers_off")),
    ("restart.respawned", LAUNCHERS), ("restart.ready", LAUNCHERS),
    ("elastic_start.running", LAUNCHERS),
    ("scale_up.running", ("elaunch",)), ("scale_up.ready", ("elaunch",)),
    ("scale_down.running", LAUNCHERS), ("scale_down.ready", LAUNCHERS),
    ("link_cut.running", ("elaunch",)), ("link_cut.ready", ("elaunch",)),
    ("rdzv_scale.seconds_2", LAUNCHERS), ("rdzv_scale.ops_2", LAUNCHERS),
    ("rdzv_scale.seconds_4", LAUNCHERS), ("rdzv_scale.ops_4", LAUNCHERS),
    ("rdzv_scale.restart_seconds_4", LAUNCHERS), ("rdzv_scale.restart_ops_4", LAUNCHERS),
    ("overhead.cpu_per_min", LAUNCHERS), ("overhead.rss", LAUNCHERS),
    ("overhead_metrics.cpu_per_min", LAUNCHERS), ("overhead_metrics.cpu_per_min_15s", LAUNCHERS),
    ("overhead_metrics.scrape_p50", ("elaunch",)), ("overhead_metrics.scrape_p99", ("elaunch",)),
    ("job_abort.last_agent", ("elaunch",)), ("job_abort.first_agent", LAUNCHERS),
    ("hang.total", ("elaunch",)), ("hang.overhead", ("elaunch",)), ("hang.stacks", LAUNCHERS),
]
#: Metrics torchrun is expected never to finish: bounded (5 s in quick mode) and recorded as "never".
NEVER = ("job_abort.last_agent", "hang.total", "hang.overhead")
#: The same after a cut link, bounded by the scale bound (12 s in quick mode: elaunch needs ~4 s).
NEVER_CUT = ("link_cut.running",)
#: The etcd variant of rdzv_scale (elaunch etcd-v3 vs torchrun etcd-v2) at the quick run's sizes.
ETCD_REQUIRED = [f"rdzv_scale.etcd_{k}_{n}" for n in (2, 4) for k in ("seconds", "ops", "ops_max")]
#: The benchmark can run its etcd variant here: an etcd server binary and both Python clients.
ETCD_AVAILABLE = bool((shutil.which("etcd") or os.access("/usr/bin/etcd", os.X_OK))
                      and importlib.util.find_spec("pyetcd") and importlib.util.find_spec("etcd"))


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    proc = subprocess.Popen([sys.executable, "-m", "benchmarks.run", "--quick", "--rdzv-sizes=2,4",
                             f"--out-dir={out}"], cwd=REPO, env=launcher_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = proc.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        stdout, stderr = proc.communicate()
        pytest.fail(f"benchmarks.run --quick timed out\n{stderr[-3000:]}")
    assert proc.returncode == 0, stderr[-3000:]
    return out, json.loads((out / "benchmarks.json").read_text()), stdout, stderr


def test_every_scenario_produced_numbers_for_both_launchers(quick_run):
    _out, result, _stdout, stderr = quick_run
    metrics = {m["key"]: m for s in result["scenarios"] for m in s["metrics"]}
    # the link cut needs root and network namespaces: without them the run says so in a note
    cut_skipped = any(n.startswith("node loss after a link cut: skipped") for n in result["meta"]["notes"])
    for key, needed in REQUIRED:
        if key.startswith("link_cut.") and cut_skipped:
            continue
        assert key in metrics, f"{key} missing; have {sorted(metrics)}"
        m = metrics[key]
        for which in LAUNCHERS:
            assert m["values"][which], f"{key}: no repeat recorded for {which}"
            if which in needed:
                assert isinstance(m["median"][which], float), f"{key}: no number for {which}: {m['notes'][which]}\n{stderr[-3000:]}"
            else:  # it may fail to complete, but then it must say so
                assert isinstance(m["median"][which], float) or m["notes"][which], key
        if all(isinstance(m["median"][w], float) and m["median"][w] > 0 for w in LAUNCHERS):
            assert m["ratio"] == pytest.approx(m["median"]["elaunch"] / m["median"]["torchrun"])
    if result["meta"]["warm_start"]:
        assert "restart_warm.ready" in metrics
    assert result["meta"]["torch"] and result["meta"]["elaunch"] and result["meta"]["machine"]


def test_failure_scenarios_say_never_for_a_launcher_that_does_not_stop(quick_run):
    out, result, _stdout, _stderr = quick_run
    metrics = {m["key"]: m for s in result["scenarios"] for m in s["metrics"]}
    rows = {line.split(" | ")[0].lstrip("| "): line for line in (out / "benchmarks.md").read_text().splitlines()
            if line.startswith("| ")}
    for key in NEVER:
        m = metrics[key]
        if m["median"]["torchrun"] is not None:  # a torchrun that learned to stop: nothing to check
            continue
        assert m["notes"]["torchrun"][0].startswith("never (> 5 s)"), m["notes"]["torchrun"]
        row = next(r for label, r in rows.items() if label.startswith(m["label"]))
        assert "never (> 5 s)" in row and "torchrun never" in row, row
    for key in (k for k in NEVER_CUT if k in metrics):
        m = metrics[key]
        if m["median"]["torchrun"] is None:
            assert m["notes"]["torchrun"][0].startswith("never (> 12 s)"), m["notes"]["torchrun"]
    stacks = metrics["hang.stacks"]
    assert all(v in (0.0, 1.0) for w in LAUNCHERS for v in stacks["values"][w]), stacks["values"]


def test_etcd_variant_produced_numbers_or_says_why_not(quick_run):
    _out, result, _stdout, stderr = quick_run
    metrics = {m["key"]: m for s in result["scenarios"] for m in s["metrics"]}
    etcd_notes = [n for n in result["meta"]["notes"] if "etcd" in n]
    if not ETCD_AVAILABLE:
        assert any("etcd: skipped" in n for n in etcd_notes), result["meta"]["notes"]
        return
    assert not any("skipped" in n for n in etcd_notes), etcd_notes
    for key in ETCD_REQUIRED:
        assert key in metrics, f"{key} missing; have {sorted(metrics)}\n{stderr[-3000:]}"
        m = metrics[key]
        assert "(etcd: elaunch etcd-v3 vs torchrun etcd-v2)" in m["label"], m["label"]
        for which in LAUNCHERS:
            v = m["median"][which]
            assert isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0, \
                f"{key}: no number for {which}: {m['notes'][which]}\n{stderr[-3000:]}"


def test_markdown_table_and_plot_are_written(quick_run):
    out, result, stdout, _stderr = quick_run
    text = (out / "benchmarks.md").read_text()
    assert "<!-- BEGIN GENERATED -->" in text and "<!-- END GENERATED -->" in text
    rows = [line for line in text.splitlines() if line.startswith("| ") and not line.startswith("| scenario")]
    labels = [m["label"] for s in result["scenarios"] for m in s["metrics"]]
    assert len(rows) == len(labels)
    assert all(any(label in row for row in rows) for label in labels)
    png = (out / "benchmarks.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 10_000
    assert "| scenario | elaunch | torchrun |" in stdout


def test_quick_mode_leaves_out_the_etcd_job_abort_and_says_so(quick_run):
    # the etcd variants of the job-wide abort cost ~30 s (torchrun's etcd-v2 node runs until the bound):
    # a --quick run without --only skips them, and its notes say how to run them
    _out, result, _stdout, _stderr = quick_run
    names = [s["name"] for s in result["scenarios"]]
    assert "job_abort" in names and not any(n.startswith("job_abort_etcd") for n in names), names
    assert "job_abort_etcd: not run in quick mode (--only job_abort_etcd runs it)" in result["meta"]["notes"]


def test_merging_a_later_run_drops_the_notes_of_the_rows_it_replaces():
    from benchmarks.report import merge

    def result(names, command, notes=()):
        meta = {"command": command, "date": "d", "quick": False, "repeat": 5, "loadavg_start": "0",
                "loadavg_end": "0", "duration_s": 1.0, "notes": list(notes)}
        return {"meta": meta, "scenarios": [{"name": n, "metrics": []} for n in names]}

    base = result(["launch", "job_abort", "hang"], "full")
    once = merge(base, result(["job_abort", "hang"], "first"))
    assert [n for n in once["meta"]["notes"] if n.startswith("rows of ")][0].startswith("rows of job_abort, hang: from `first`")
    twice = merge(once, result(["job_abort", "job_abort_etcd_v2", "hang"], "second"))
    rows = [n for n in twice["meta"]["notes"] if n.startswith("rows of ")]
    assert len(rows) == 1 and rows[0].startswith("rows of job_abort, job_abort_etcd_v2, hang: from `second`"), rows
    partly = merge(once, result(["hang"], "third"))  # job_abort still comes from `first`: its note stays
    assert [n.split(":")[0] for n in partly["meta"]["notes"] if n.startswith("rows of ")] == \
        ["rows of job_abort, hang", "rows of hang"]
    assert [s["name"] for s in twice["scenarios"]] == ["launch", "job_abort", "job_abort_etcd_v2", "hang"]


#: Rows of benchmarks/fsdp2_dcp.py that its --smoke run must fill with a number (issue 36).
FSDP2_DCP_ROWS = [*(f"save.{k}" for k in ("snapshot", "snapshot_cached", "snapshot_async_blocking", "fs_async_blocking",
                                           "fs_sync", "null", "null_cached")),
                  *(f"{phase}.{k}" for phase in ("kill", "replace", "lost") for k in ("first", "memory", "disk")),
                  "replace.agent_prepare"]


@pytest.mark.multinode
def test_fsdp2_dcp_smoke_fills_every_row_and_restores_what_disk_holds(tmp_path):
    """``benchmarks.fsdp2_dcp --smoke``: FSDP2 through DCP on 2 namespace hosts, a tiny state, one repetition
    (rows 1-4; no goodput); every restore from memory equals DCP's load of the same step from disk. It took
    ~57 s here (2 shared cores); no time is asserted."""
    from tests.multinode import netns

    reason = netns.unavailable_reason()
    if reason:
        pytest.skip(reason)
    out = tmp_path / "fsdp2_dcp.json"
    shm_before = set(os.listdir("/dev/shm"))
    proc = subprocess.Popen([sys.executable, "-m", "benchmarks.fsdp2_dcp", "--smoke", f"--json={out}",
                             f"--work-dir={tmp_path / 'work'}"], cwd=REPO, env=launcher_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        stdout, stderr = proc.communicate()
        pytest.fail(f"benchmarks.fsdp2_dcp --smoke timed out\n{stderr[-3000:]}")
    assert proc.returncode == 0, stderr[-3000:]
    result = json.loads(out.read_text())
    rows = {r["key"]: r for r in result["rows"]}
    for key in FSDP2_DCP_ROWS:
        assert key in rows and isinstance(rows[key]["median"], float), f"{key}: {rows.get(key)}\n{stderr[-3000:]}"
    # nothing else: no job that did not complete, no save way that failed, no restore that differs from disk
    # and every dcp.async_save with SnapshotWriter had committed its step when it returned
    notes = result["meta"]["notes"]
    committed = [n for n in notes if n.startswith("dcp.async_save with SnapshotWriter: ")]
    assert len(committed) == 1 and re.match(r"dcp\.async_save with SnapshotWriter: 0 of [1-9]\d* returns", committed[0]), notes
    assert [n for n in notes if n not in committed] == ["goodput: not run (--smoke, or --only without it)"], notes
    raw = result["raw"]
    assert raw["a"]["replace_events"]["sources"] and set(raw["a"]["replace_events"]["sources"].values()) == {"peer"}
    assert set(raw["b"]["survivor_events"]["sources"].values()) == {"memory"}  # 4 -> 2 from memory, never disk
    for phase, docs in (("kill", raw["a"]["kill"]), ("replace", raw["a"]["replace"]), ("lost", raw["b"]["lost"])):
        for name, doc in docs.items():
            assert doc["source"] == "memory" and doc["tensors"] > 0 and doc["unequal_to_disk"] == [], (phase, name, doc)
    assert all(c in (0, None) for c in raw["a"]["exit_codes"] + raw["b"]["exit_codes"]), raw
    assert "| dcp.async_save, SnapshotWriter: blocking part (committed on return) |" in stdout  # the save target's row
    res = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    assert not [line for line in res.stdout.splitlines() if line.startswith(f"elt-{proc.pid}-")]
    left = {n for n in set(os.listdir("/dev/shm")) - shm_before if n.startswith(f"elaunch-d36{proc.pid}")}
    assert not left, left
