"""Sharded state gets a clear answer (issue 35, item 3), with real FSDP2 on 2 CPU ranks (gloo) under elaunch.

A DTensor leaf (FSDP2's ``model.state_dict()``, ``get_state_dict(model, optim)``) makes
``ckpt.save`` raise ``TypeError`` naming its key path, under ``replicated=True`` and
``False`` alike, before anything is written (the snapshot in memory is kept). And
per-rank entries of replicated state: every restoring rank gets the one snapshot the
job chose, the lowest rank's.
"""

from __future__ import annotations

import json

import pytest

from tests.helpers import SCRIPTS, run

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.slow


def test_fsdp2_state_is_refused_clearly_and_replicated_per_rank_entries_come_from_the_lowest_rank(tmp_path):
    out, logs = tmp_path / "out", tmp_path / "logs"
    out.mkdir()
    r = run("elaunch", "--nproc-per-node=2", "--max-restarts=1", f"--log-dir={logs}", str(SCRIPTS / "ckpt_fsdp.py"),
            str(out), timeout=240)
    assert r.returncode == 0, r.stderr[-4000:]
    for rank in (0, 1):
        got = json.loads((out / f"fsdp_{rank}.json").read_text())
        assert got["kinds"] == ["DTensor"], got
        assert got["held"] == [0], got  # every refused save left the snapshot in memory as it was
        for case, err in got["errors"].items():
            assert err is not None and err[0] == "TypeError", (case, err)
            assert "state['model']['0.weight'] (a DTensor)" in err[1], (case, err[1])
            assert "torch.distributed.checkpoint" in err[1], (case, err[1])
            if case.endswith("/replicated"):
                assert "cannot be saved as replicated state" in err[1], err[1]
            else:
                assert "replicated=False" in err[1] and "do not take DTensors yet" in err[1], err[1]
        restored = json.loads((out / f"restored_{rank}.json").read_text())
        # replicated state: one snapshot serves every rank, the lowest rank's, per-rank entries included
        assert restored == {"step": 1, "rank": 0, "rng_is_rank_0s": True}, restored
