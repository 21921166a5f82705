"""Crashes and hangs that keep the world size end bit-identical to an uninterrupted run.

examples/ddp_digits.py schedules its faults as data: entry k of ``--crash-at`` /
``--hang-at`` acts on attempt k (``TORCHELASTIC_RESTART_COUNT == k``), ``none``
skips an attempt. A hang reports progress for its step, then SIGSTOPs itself (or,
``:block``, sleeps forever); ``--hang-timeout`` finds it, the agent dumps the
stacks and SIGKILLs it, and the restart resumes from the last checkpoint. After
six faults the final parameters' SHA-256 equals an uninterrupted run's.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from tests.integration.conftest import EXAMPLE, SHORT, final_digest
from tests.helpers import run

pytestmark = [pytest.mark.slow, pytest.mark.long]

#: attempt k: a crash (--crash-at) or a hang (--hang-at), never both; mid-epoch and at an
#: epoch's first step, on either rank; hangs by SIGSTOP and by a blocked (sleeping) rank
CRASHES = "1:1:7,none,1:2:3,none,none,0:3:21"
HANGS = "none,0:1:19,none,1:2:12:block,0:3:0,none"
N_CRASHES, N_HANGS = 3, 3


@pytest.fixture(scope="module")
def faulted(tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path]:
    """One run through all the faults: (its result, its directory)."""
    tmp = tmp_path_factory.mktemp("faulted")
    r = run("elaunch", "--standalone", "--nproc-per-node=2", "--hang-timeout=2", "--max-restarts=6",
            "--monitor-interval=0.2", "--log-dir", str(tmp / "logs"),
            EXAMPLE, *SHORT, "--checkpoint", str(tmp / "ck.pt"), "--final-params", str(tmp / "final.json"),
            "--save-every", "5", "--crash-at", CRASHES, "--hang-at", HANGS, timeout=240)
    return r, tmp


def test_crashes_and_hangs_end_bit_identical_to_an_uninterrupted_run(faulted, reference_digest):
    r, tmp = faulted
    err, out = r.stderr, r.stdout
    assert r.returncode == 0, err[-4000:]
    # every fault happened, on its attempt, and was handled as what it is
    crashes = re.findall(r"injected crash: rank \d at epoch \d step \d+ on attempt (\d)", err)
    hangs = re.findall(r"injected hang \((stop|block)\): rank \d at epoch \d step \d+ on attempt (\d)", err)
    assert sorted(set(crashes)) == ["0", "2", "5"], err[-4000:]
    assert sorted(set(hangs)) == [("block", "3"), ("stop", "1"), ("stop", "4")], err[-4000:]
    hung = re.findall(r"HUNG: rank \d \(local rank \d\) made no progress for ([0-9.]+) s", err)
    assert len(hung) == N_HANGS, err[-4000:]
    assert all(float(quiet) >= 2.0 for quiet in hung), hung
    failed = re.findall(r"worker group failed \(rank \d on \S+, exitcode (-?\d+)[^)]*\); restart (\d)/6", err)
    assert [n for _, n in failed] == [str(i) for i in range(1, 7)], err[-4000:]
    assert sum(code == "-9" for code, _ in failed) == N_HANGS, failed  # hung ranks are SIGKILLed
    # each hang's stacks are in the log directory, the hung rank's among them
    stacks = sorted((tmp / "logs").rglob("stacks/*.txt"))
    assert len(stacks) == N_HANGS, stacks
    for p in stacks:
        text = p.read_text()
        assert text.startswith("HUNG: local rank(s) 0, 1") and "hang_forever" in text, text[:3000]
    # resumed mid-epoch and at an epoch boundary, never from scratch after the first attempt
    resumed = re.findall(r"resumed from .* (at epoch \d step \d+|after epoch \d)$", out, re.M)
    assert len(resumed) == N_CRASHES + N_HANGS, out
    assert "after epoch 2" in resumed and any(x.startswith("at epoch") for x in resumed), resumed
    assert final_digest(tmp / "final.json") == reference_digest


def test_each_hang_names_the_rank_that_hung(faulted):
    r, _ = faulted
    injected = re.findall(r"injected hang \(\w+\): rank (\d) at epoch \d step \d+ on attempt \d", r.stderr)
    # the peer blocked in all_reduce behind the hung rank is as quiet: the culprit is told apart
    # by its stack (not inside torch.distributed) or its counter (a step behind)
    named = re.findall(r"HUNG: rank (\d) \(local rank \d\) made no progress", r.stderr)
    assert named == injected, r.stderr[-4000:]
