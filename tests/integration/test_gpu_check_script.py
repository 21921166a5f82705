"""scripts/gpu_check_inprocess.sh (the GPU check of issues 36 and 37) and its one-GPU shim, on the CPU.

The script runs on a lent GPU machine only now and then; its plumbing is checked here with
``DEVICE=cpu`` (gloo), so that a session that is lent one does not spend device time on a
script that no longer runs. The probe part: two ranks through ``scripts/gpu_shared.py``, each
with a ``NCCL_HOSTID`` of its own, under elaunch.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import launcher_env

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]


def test_the_probe_runs_two_ranks_through_the_shim(tmp_path):
    """Both ranks take part in the all_reduce, each with its own NCCL_HOSTID; the summary says so and the logs
    come back as one archive."""
    out = tmp_path / "out"
    env = launcher_env(DEVICE="cpu", PARTS="probe", OUT=str(out), W=str(tmp_path / "work"), PY=sys.executable)
    r = subprocess.run(["bash", "scripts/gpu_check_inprocess.sh"], cwd=REPO, env=env, capture_output=True, text=True,
                       timeout=180)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "probe, 2 ranks on one device: exit 0 -> 2 rank(s) a job" in (out / "summary.txt").read_text()
    hostids = set(re.findall(r"\(NCCL_HOSTID ([^)]*)\): all_reduce -> 3\.0$", r.stdout, re.M))
    assert len(hostids) == 2 and all(h.endswith(("-rank0", "-rank1")) for h in hostids), r.stdout[-2000:]
    assert (out / "logs.tgz").stat().st_size > 0
