"""``dcp.async_save`` with ``SnapshotWriter`` commits the part before it returns: a SIGKILL right after restores it.

``tests/scripts/dcp_async_kill.py`` under ``elaunch --nproc-per-node=2 --max-restarts=1``: step 2
is saved with ``dcp.async_save`` whose planning (in DCP's thread) takes 5 s; right after the
call returns each rank's newest slot holds step 2, and rank 1 is SIGKILLed before any thread
planned. The restarted ranks restore step 2 from memory (its values, not step 1's), through
``SnapshotReader`` joining the parts' own layouts; the directory the agent persisted step 2 to
when rank 1 died (parts staged before DCP planned: no item marked for another rank) is an
ordinary DCP checkpoint that DCP's own ``FileSystemReader`` loads, with the same values.
"""

from __future__ import annotations

import json

import pytest

from tests.helpers import SCRIPTS, run

pytest.importorskip("torch")
pytestmark = pytest.mark.slow


def test_a_sigkill_right_after_async_save_returns_restores_that_step(tmp_path):
    ckpt = tmp_path / "ckpt"
    r = run("elaunch", "--standalone", "--nproc-per-node=2", "--max-restarts=1", f"--checkpoint-dir={ckpt}",
            "--checkpoint-persist-interval=0", str(SCRIPTS / "dcp_async_kill.py"), str(tmp_path), str(ckpt),
            timeout=120)
    assert r.returncode == 0, r.stderr[-4000:]
    for rank in (0, 1):
        assert json.loads((tmp_path / f"staged_{rank}.json").read_text()) == {"step": 2}, rank
        got = json.loads((tmp_path / f"restored_{rank}.json").read_text())
        assert (got["step"], got["source"], got["n"]) == (2, "memory", 2), got
        assert got["w"] == [[200.0 + 2 * i, 201.0 + 2 * i] for i in range(4)] and got["b"] == [2.0] * 3, got
        assert got["persisted"] == {"w": got["w"], "b": got["b"], "n": 2}, got
