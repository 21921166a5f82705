"""What each feature flag adds to a launch: scenario ``launch_features`` (issue 35, item 4).

The launch row's job (``--standalone --nproc-per-node=2`` of a no-op script,
benchmarks/workers/noop.py) run by elaunch once without a flag and once with each
feature flag of :data:`FEATURES` alone, beside torchrun's plain launch, all in one
run and interleaved: each repeat runs torchrun, then elaunch without a flag, then
elaunch with each flag in turn. torchrun has none of these flags, so every row's
torchrun column is the same plain torchrun launches, and a row's ratio is
elaunch-with-that-flag over torchrun as it is: what a job that turns the feature
on pays at launch, against the launcher it replaces. A flag that adds nothing to
the start path shows the plain row's ratio.

Not here: ``--warm-start`` (its spares import torch while the job runs; the
restart rows measure it) and ``--node-check`` (a gloo check before the workers
start; the node_check rows measure it).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from benchmarks.common import DidNotComplete, Recorder, free_port, log_line, run_to_exit
from benchmarks.scenarios import NOOP, BenchConfig

#: ``(key, the flag as the table shows it, out_dir -> the flag's arguments)``, one row each, in run order.
FEATURES: tuple[tuple[str, str, Callable[[Path], list[str]]], ...] = (
    ("plain", "no feature flag", lambda out: []),
    ("checkpoint_dir", "--checkpoint-dir (the persister helper)", lambda out: [f"--checkpoint-dir={out / 'ckpt'}"]),
    ("checkpoint_replicas", "--checkpoint-replicas=1", lambda out: ["--checkpoint-replicas=1"]),
    ("metrics_port", "--metrics-port (the metrics server)", lambda out: [f"--metrics-port={free_port()}"]),
    ("hang_timeout", "--hang-timeout=60", lambda out: ["--hang-timeout=60"]),
    ("stragglers_off", "--rdzv-conf=straggler_window=0 (the straggler watch off)",
     lambda out: ["--rdzv-conf=straggler_window=0"]),
)
#: Seconds one launch may take before it is recorded as "did not complete".
TIMEOUT = 120.0


def bench_launch_features(cfg: BenchConfig) -> Recorder:
    """One wall-time row per entry of :data:`FEATURES`; see the module docstring."""
    rec = Recorder("launch_features")
    for key, flag, _args in FEATURES:
        rec.metric(key, f"launch with {flag}: wall time (standalone, 2 no-op workers; torchrun: no flag)", "s")
    given_up: set[str] = set()
    for i in range(cfg.repeat):
        out = cfg.scratch(f"launch_features-torchrun-{i}")
        log_line(f"launch_features: torchrun repeat {i + 1}/{cfg.repeat}")
        torchrun = _once("torchrun", [], out)
        for key, _flag, _args in FEATURES:
            rec.add(key, "torchrun", *torchrun)
        for key, flag, args in FEATURES:
            if key in given_up:
                rec.add(key, "elaunch", None, "skipped after an earlier repeat failed")
                continue
            out = cfg.scratch(f"launch_features-{key}-{i}")
            log_line(f"launch_features: elaunch {flag} repeat {i + 1}/{cfg.repeat}")
            value, note = _once("elaunch", args(out), out)
            rec.add(key, "elaunch", value, note)
            if value is None:
                given_up.add(key)
    return rec


def _once(which: str, flags: list[str], out: Path) -> tuple[float | None, str | None]:
    """One launch of the no-op job with ``flags``: ``(wall seconds, None)``, or ``(None, why)``."""
    try:
        r = run_to_exit(["--standalone", "--nproc-per-node=2", *flags, NOOP], which, out / "launcher.log", TIMEOUT)
    except DidNotComplete as exc:
        return None, str(exc)
    if r["exit_code"] != 0:
        tail = (out / "launcher.log").read_text(errors="replace").strip().splitlines()[-1:]
        return None, f"exit code {r['exit_code']}" + (f": {tail[0][:100]}" if tail else "")
    return r["wall_s"], None
