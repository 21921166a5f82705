"""elaunch.lightning: a Lightning DDP run saves its checkpoints into elaunch's memory and resumes from them.

Real processes: ``tests/scripts/lightning_fit.py`` (a tiny LightningModule, 2 CPU ranks, gloo,
``ModelCheckpoint(every_n_train_steps=1)``, ``Trainer(plugins=[SnapshotCheckpointIO()])``) under
``elaunch --standalone --nproc-per-node=2``. Lightning finds its ranks through its
``TorchElasticEnvironment`` (the env elaunch sets, as torchrun does). After a SIGKILL of rank 1
at step 3, the restarted run resumes at step 3 from the snapshot in ``/dev/shm`` (nothing was
written to disk), with the parameters it had saved, and ends bit-identical to an uninterrupted run;
the same with FSDP2 (``ModelParallelStrategy``) through ``SnapshotModelParallelStrategy``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers import SCRIPTS, run

pytest.importorskip("torch")
pytest.importorskip("lightning")
pytestmark = pytest.mark.slow

SCRIPT = str(SCRIPTS / "lightning_fit.py")
STEPS, KILL_AT = "8", 3


def _fit(out: Path, *launcher: str, script=(), timeout: float = 240) -> str:
    out.mkdir(parents=True, exist_ok=True)
    r = run("elaunch", "--standalone", "--nproc-per-node=2", *launcher, SCRIPT, str(out), "--steps", STEPS, *script,
            timeout=timeout)
    assert r.returncode == 0, r.stderr[-4000:]
    return r.stdout + r.stderr


def _record(out: Path, attempt: int, rank: int) -> dict:
    return json.loads((out / f"attempt{attempt}_rank{rank}.json").read_text())


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("plain")
    _fit(out)
    assert _record(out, 0, 0)["resume"] is None  # a fresh start: resume_path() -> None
    return json.loads((out / "final.json").read_text())


@pytest.mark.long  # in the long part (scripts/test.sh --long): the suite took 19:54 of its 20 minutes on a fresh machine
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_sigkill_resumes_from_memory_at_the_saved_step_and_ends_bit_identical(tmp_path, uninterrupted, strategy):
    """ddp: ``SnapshotCheckpointIO`` (rank 0 saves, replicated); fsdp: FSDP2 DTensors through
    ``SnapshotModelParallelStrategy`` (DCP with SnapshotWriter/SnapshotReader). 2-rank FSDP2 with
    gloo ends with the very parameters of 2-rank DDP here, so both compare to one uninterrupted run."""
    logs = _fit(tmp_path, "--max-restarts=1", script=["--kill-at", str(KILL_AT), "--strategy", strategy])
    assert "restart 1/1" in logs, logs[-3000:]
    first = _record(tmp_path, 0, 0)
    assert first["resume"] is None and first["start_step"] == 0
    saved_digest = first["digests"][str(KILL_AT)]  # the parameters after KILL_AT steps, what step KILL_AT saved
    for rank in (0, 1):
        again = _record(tmp_path, 1, rank)
        assert again["resume"] == "elaunch://snapshot", again
        assert again["start_step"] == KILL_AT, again  # not from scratch
        assert again["restored"]["step"] == KILL_AT, again
        if strategy == "ddp":  # from memory, not from disk
            assert again["restored"]["source"].startswith("/dev/shm/"), again
        else:
            assert again["restored"]["source"] == "memory" and again["dtensors"], again
        assert again["start_digest"] == saved_digest, (rank, again)
    assert not (tmp_path / "root").exists()  # the snapshots alone: no checkpoint file or DCP directory was written
    assert json.loads((tmp_path / "final.json").read_text()) == uninterrupted
    assert uninterrupted["global_step"] == int(STEPS)
