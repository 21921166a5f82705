"""``python -m benchmarks.run [--quick] [--repeat N] [--only launch,restart,job_abort,...] [--out-dir DIR]``.

Runs elaunch and torchrun side by side (interleaved, repeated), prints progress
to stderr and writes ``benchmarks.md`` (the generated part only; hand-written
text around it is kept) and ``benchmarks.png`` into ``--out-dir`` (default
docs/), plus the raw results as JSON (``--json``, default
``benchmarks/last_run.json``, or ``OUT_DIR/benchmarks.json`` with ``--out-dir``).

A full run takes about 18 minutes on 2 cores; ``--quick`` (without ``job_abort_etcd``) about 3 minutes.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import (failures, launch_features, link_cut, metrics_cost, node_check, rdzv_scale, report, scenarios,
                        stragglers)
from benchmarks.common import REPO, log_line

SCENARIOS = ("launch", "launch_features", "restart", "elastic_start", "scale_up", "scale_down", "link_cut", "rdzv_scale",
             "overhead", "overhead_metrics", "job_abort", "job_abort_etcd", "hang", "exit_abort", "node_check", "straggler")
#: Left out of a --quick run unless named in --only: the etcd variants of the job-wide abort cost
#: ~30 s (an etcd server, and torchrun's etcd-v2 healthy node runs until the bound); the exit
#: scenario needs many runs to say anything (a rate), ~30 s even at one repeat; the node check's
#: 2 + 3 host jobs cost ~40 s a repeat (tests/multinode/test_node_check_hosts.py covers it); the straggler
#: scenario's two 3-host jobs ~90 s a repeat (tests/multinode/test_stragglers.py covers it).
NOT_QUICK = ("job_abort_etcd", "exit_abort", "node_check", "straggler")


def _machine() -> str:
    model = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        mem = int(Path("/proc/meminfo").read_text().split()[1]) / 2**20
    except (OSError, ValueError, IndexError):
        mem = 0.0
    return f"{os.cpu_count()} CPUs ({model}), {mem:.0f} GiB RAM, {platform.system()} {platform.release()}"


def _versions() -> tuple[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    try:
        torch_v = version("torch")
    except PackageNotFoundError:
        torch_v = "?"
    try:
        elaunch_v = version("elaunch")
    except PackageNotFoundError:
        elaunch_v = "?"
    return torch_v, elaunch_v


def _commit() -> str:
    """The checkout's commit, ``-dirty`` when elaunch/ has uncommitted changes; ``?`` outside git."""
    import subprocess

    try:
        head = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=REPO, capture_output=True,
                              text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "elaunch"], cwd=REPO, capture_output=True,
                               text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return "?"
    if head.returncode != 0:
        return "?"
    return head.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


def _loadavg() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else "?"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="small sizes and short bounds (~2.5 min); proves the suite works")
    p.add_argument("--repeat", type=int, default=None, help="repeats per launcher and scenario (default 3, quick 1)")
    p.add_argument("--only", default=None,
                   help=f"comma-separated scenarios (default all; --quick: all but {','.join(NOT_QUICK)}): "
                        f"{','.join(SCENARIOS)}")
    p.add_argument("--out-dir", type=Path, default=None, help="where benchmarks.md/.png go (default docs/)")
    p.add_argument("--json", type=Path, default=None, help="where the raw results go")
    p.add_argument("--work-dir", type=Path, default=None,
                   help="keep worker stamps and launcher logs here (default: a temporary directory, removed)")
    p.add_argument("--rdzv-sizes", default=None, help="comma-separated N of rdzv_scale (default 8,64,256,1024; quick 4,8); "
                        f"the etcd variant runs those <= {rdzv_scale.ETCD_MAX_N}")
    a = p.parse_args(argv)
    a.left_out = [s for s in NOT_QUICK if a.quick and a.only is None]
    only = [s.strip() for s in (a.only or ",".join(SCENARIOS)).split(",") if s.strip() and s not in a.left_out]
    bad = [s for s in only if s not in SCENARIOS]
    if bad:
        p.error(f"--only={a.only}: unknown scenario(s) {', '.join(bad)} (known: {', '.join(SCENARIOS)})")
    a.only = only
    if a.repeat is None:
        a.repeat = 1 if a.quick else 3
    if a.repeat < 1:
        p.error(f"--repeat={a.repeat}: must be >= 1")
    try:
        sizes = a.rdzv_sizes or ("4,8" if a.quick else "8,64,256,1024")
        a.rdzv_sizes = tuple(int(x) for x in sizes.split(","))
    except ValueError:
        p.error(f"--rdzv-sizes={a.rdzv_sizes}: expected comma-separated integers")
    if any(n < 1 for n in a.rdzv_sizes):
        p.error(f"--rdzv-sizes={a.rdzv_sizes}: every N must be >= 1")
    return a


def run(a: argparse.Namespace) -> dict:
    """Run the selected scenarios; return the JSON-able result."""
    t_start = time.monotonic()
    load_start = _loadavg()
    torch_v, elaunch_v = _versions()
    warm = scenarios.elaunch_warm_start_flag()
    notes: list[str] = [f"{name}: not run in quick mode (--only {name} runs it)" for name in a.left_out]
    if os.environ.get("PYTHONDONTWRITEBYTECODE"):
        # the launchers inherit it: an editable elaunch compiles every module it imports at every start
        # (torch's wheel came with its bytecode), ~50 ms of a no-op launch on 2 cores (issue 35)
        notes.append("the launchers ran with PYTHONDONTWRITEBYTECODE set: elaunch's modules were compiled from "
                     "source at every start (no __pycache__), torch's were not")
    with tempfile.TemporaryDirectory(prefix="elaunch-bench-") as tmp:
        if a.work_dir:
            a.work_dir.mkdir(parents=True, exist_ok=True)
            tmp = str(a.work_dir.resolve())
        cfg = scenarios.BenchConfig(
            quick=a.quick, repeat=a.repeat, tmp=Path(tmp), warm_start=warm,
            scale_timeout=12.0 if a.quick else 30.0,
            overhead_seconds=2.0 if a.quick else 15.0,
            rdzv_sizes=a.rdzv_sizes, rdzv_timeout=30.0,
            failure_bound=5.0 if a.quick else 20.0,
        )
        recs = []
        for name in a.only:
            log_line(f"scenario {name}")
            if name == "launch":
                recs.append(scenarios.bench_launch(cfg))
            elif name == "launch_features":
                recs.append(launch_features.bench_launch_features(cfg))
            elif name == "restart":
                recs.append(scenarios.bench_restart(cfg))
                if warm:
                    recs.append(scenarios.bench_restart(cfg, warm=True))
                else:
                    notes.append("restart, warm: skipped (elaunch --help lists no --warm-start)")
            elif name == "elastic_start":
                recs.append(scenarios.bench_elastic_start(cfg))
            elif name == "scale_up":
                recs.append(scenarios.bench_scale_up(cfg))
            elif name == "scale_down":
                recs.append(scenarios.bench_scale_down(cfg))
            elif name == "link_cut":
                cut_recs, cut_notes = link_cut.bench_link_cut(cfg)
                recs += cut_recs
                notes += cut_notes
            elif name == "rdzv_scale":
                rec = rdzv_scale.bench_rdzv_scale(cfg.rdzv_sizes, cfg.rdzv_timeout)
                for note in rdzv_scale.bench_rdzv_scale_etcd(rec, cfg.rdzv_sizes, cfg.rdzv_timeout):
                    notes.append(f"rendezvous scale, {note}")
                recs.append(rec)
            elif name == "overhead":
                recs.append(scenarios.bench_overhead(cfg))
            elif name == "overhead_metrics":
                recs.append(metrics_cost.bench_overhead_metrics(cfg))
            elif name == "job_abort":
                recs.append(failures.bench_job_abort(cfg))
            elif name == "job_abort_etcd":
                etcd_recs, etcd_notes = failures.bench_job_abort_etcd(cfg)
                recs += etcd_recs
                notes += etcd_notes
            elif name == "hang":
                recs.append(failures.bench_hang(cfg))
            elif name == "exit_abort":
                recs.append(failures.bench_exit_abort(cfg))
            elif name == "node_check":
                nc_recs, nc_notes = node_check.bench_node_check(cfg)
                recs += nc_recs
                notes += nc_notes
            elif name == "straggler":
                st_recs, st_notes = stragglers.bench_straggler(cfg)
                recs += st_recs
                notes += st_notes
    cmd = "python -m benchmarks.run" + ("" if len(sys.argv) < 2 else " " + " ".join(sys.argv[1:]))
    return {
        "meta": {
            "command": cmd.strip(), "date": time.strftime("%Y-%m-%d %H:%M %Z"), "quick": a.quick,
            "repeat": a.repeat, "machine": _machine(), "python": platform.python_version(),
            "torch": torch_v, "elaunch": elaunch_v, "commit": _commit(), "warm_start": warm,
            "loadavg_start": load_start, "loadavg_end": _loadavg(),
            "duration_s": time.monotonic() - t_start, "scenarios_run": a.only, "notes": notes,
        },
        "scenarios": [{"name": r.scenario, "metrics": [m.to_json() for m in r.metrics.values()]} for r in recs],
    }


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    result = run(a)
    out_dir = a.out_dir or (REPO / "docs")
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path = a.json or (out_dir / "benchmarks.json" if a.out_dir else REPO / "benchmarks" / "last_run.json")
    json_path.write_text(json.dumps(result, indent=1) + "\n")
    png = out_dir / "benchmarks.png"
    has_png = report.write_png(result, png)
    if not has_png:
        log_line("matplotlib is not installed: no PNG (pip install -e '.[bench]')")
    report.write_markdown(result, out_dir / "benchmarks.md", png.name if has_png else None)
    print(report.markdown_table(result))
    log_line(f"wrote {out_dir / 'benchmarks.md'}, {json_path}" + (f", {png}" if has_png else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
