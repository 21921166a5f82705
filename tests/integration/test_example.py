"""The main job: examples/ddp_digits.py under elaunch reaches its accuracy, also through a crash."""

from __future__ import annotations

import re

import pytest

from tests.conftest import EXAMPLES
from tests.helpers import run

pytestmark = pytest.mark.slow


def _final_accuracy(stdout: str) -> float:
    found = re.findall(r"^final test accuracy: (\d\.\d+)$", stdout, re.M)
    assert len(found) == 1, stdout
    return float(found[0])


def test_example_trains_to_accuracy(tmp_path):
    r = run("elaunch", "--standalone", "--nproc-per-node=2", str(EXAMPLES / "ddp_digits.py"),
            "--checkpoint", str(tmp_path / "ck.pt"), timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert _final_accuracy(r.stdout) >= 0.95
    assert len(re.findall(r"^epoch \d+/\d+ ", r.stdout, re.M)) >= 5


def test_example_recovers_from_a_crashed_rank(tmp_path):
    r = run("elaunch", "--standalone", "--nproc-per-node=2", "--max-restarts=1",
            str(EXAMPLES / "ddp_digits.py"), "--checkpoint", str(tmp_path / "ck.pt"),
            "--crash-rank", "1", "--crash-epoch", "4", timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "worker group failed (rank 1" in r.stderr
    resumed = re.findall(r"^resumed from .* after epoch (\d+)$", r.stdout, re.M)
    assert resumed and int(resumed[-1]) >= 3, r.stdout  # not from scratch
    assert re.search(r"^epoch \d+/\d+ .* restart 1$", r.stdout, re.M)
    assert _final_accuracy(r.stdout) >= 0.95
