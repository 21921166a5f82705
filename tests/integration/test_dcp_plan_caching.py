"""SnapshotWriter under DCP's plan caching: a cached (unchanged) plan still leaves every rank's part whole.

With ``DefaultSavePlanner(enable_plan_caching=True)`` DCP hands the storage writer an empty,
unusable local plan once the plan stops changing; each rank's part must still hold every
item of its own plan (the replicated tensor DCP's dedup gave one rank included), or a
restore at an unchanged world size from a rank's own part would miss it.
"""

from __future__ import annotations

import json

import pytest

from tests.helpers import SCRIPTS, run

pytest.importorskip("torch")
pytestmark = pytest.mark.slow


def test_cached_plans_still_write_whole_parts(tmp_path):
    r = run("elaunch", "--standalone", "--nproc-per-node=2", str(SCRIPTS / "dcp_plan_cache.py"), str(tmp_path),
            timeout=180)
    assert r.returncode == 0, r.stderr[-4000:]
    for rank in (0, 1):
        held = json.loads((tmp_path / f"items_{rank}.json").read_text())
        assert held == {str(s): ["n", "shared"] for s in range(3)}, (rank, held)
