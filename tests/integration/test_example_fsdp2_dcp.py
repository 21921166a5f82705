"""examples/fsdp2_dcp.py: FSDP2 state through DCP into elaunch's memory (SnapshotWriter), restored by SnapshotReader.

Real FSDP2 (``fully_shard``) on 2 CPU ranks with gloo. After SIGKILLs of workers, the job
restores from the agent's memory and ends with parameters bit-identical to an uninterrupted
run; the state restored equals, tensor by tensor, DCP's own load of the same step from a
plain ``FileSystemWriter`` directory. Under torchrun the same script writes and reads DCP
directories in ``$ELAUNCH_CHECKPOINT_DIR/dcp``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.helpers import launcher_env, run

pytest.importorskip("torch")
# whole training runs under faults: in the long part, so that the suite stays under its 20 minutes
pytestmark = [pytest.mark.slow, pytest.mark.long]

EXAMPLE = str(Path(__file__).resolve().parents[2] / "examples" / "fsdp2_dcp.py")
STEPS = "12"


def _digest(tmp_path: Path, name: str, launcher=(), script=(), which: str = "elaunch", env=None) -> tuple[str, str]:
    """The final parameters' SHA-256 of a 2-rank run of the example, and its output."""
    out = tmp_path / f"{name}.sha"
    r = run(which, "--standalone", "--nproc-per-node=2", *launcher, EXAMPLE, "--steps", STEPS, "--final-params",
            str(out), *script, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-4000:]
    return out.read_text().strip(), r.stdout + r.stderr


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> str:
    return _digest(tmp_path_factory.mktemp("plain"), "plain")[0]


def test_sigkills_restore_from_memory_bit_identical_and_equal_to_dcp_from_disk(tmp_path, uninterrupted):
    # dcp.async_save: the copy into memory in DCP's thread (the plain dcp.save path runs in the persister's, the
    # Lightning strategy's and the multi-host tests)
    extra = ["--async-save"]
    digest, logs = _digest(tmp_path, "faulty", ["--max-restarts=3"], ["--crash-at", "1:4,0:7", "--disk",
                                                                     str(tmp_path / "disk"), "--verify-out",
                                                                     str(tmp_path / "v"), *extra])
    assert logs.count("restored step") == 2, logs[-3000:]
    assert "restored step 7 from memory (world size 2)" in logs, logs[-3000:]
    for rank in (0, 1):
        verdict = json.loads((tmp_path / f"v.{rank}.json").read_text())
        assert verdict["step"] == 7 and verdict["source"] == "memory", verdict
        assert verdict["tensors"] > 100 and verdict["unequal"] == [], verdict
    assert digest == uninterrupted


def test_under_torchrun_the_same_calls_write_and_resume_from_dcp_directories(tmp_path, uninterrupted):
    env = launcher_env(ELAUNCH_CHECKPOINT_DIR=str(tmp_path / "ckpt"))
    first = run("torchrun", "--standalone", "--nproc-per-node=2", EXAMPLE, "--steps", "6", timeout=300, env=env)
    assert first.returncode == 0, first.stderr[-4000:]
    kept = sorted(os.listdir(tmp_path / "ckpt" / "dcp"))
    assert kept == ["step_000000000004", "step_000000000005"], kept  # two complete steps stay
    # restored after the last step: nothing left to train, and the run still ends cleanly
    again = run("torchrun", "--standalone", "--nproc-per-node=2", EXAMPLE, "--steps", "6", timeout=300, env=env)
    assert again.returncode == 0 and "restored step 5 from disk" in again.stdout, again.stderr[-4000:]
    digest, logs = _digest(tmp_path, "resumed", which="torchrun", env=env)
    assert "restored step 5 from disk" in logs, logs[-3000:]
    assert digest == uninterrupted


def test_in_process_a_sigkilled_rank_is_replaced_the_survivor_keeps_its_process_bit_identical(tmp_path, uninterrupted):
    journal = tmp_path / "journal"
    digest, logs = _digest(tmp_path, "inprocess", ["--max-restarts=3", "--warm-start"],
                           ["--in-process", "--crash-at", "1:4", "--journal", str(journal)])
    assert "in-process restart: 1 worker(s) kept their processes" in logs, logs[-3000:]
    starts = [r for r in map(json.loads, journal.read_text().splitlines()) if r["event"] == "start"]
    pid = {(r["attempt"], r["rank"]): r["pid"] for r in starts}
    assert pid[(1, 0)] == pid[(0, 0)] and pid[(1, 1)] != pid[(0, 1)], starts  # rank 0 kept, rank 1 replaced
    assert {r["step"] for r in starts if r["attempt"] == 1} == {4}, starts
    # the survivor held step 4 (saved just before the kill) and copied it into its new model; the replacement loaded
    # its rank's part alone (DCP without collectives), the survivor not joining a load
    assert {r["rank"]: r["source"] for r in starts if r["attempt"] == 1} == {0: "kept", 1: "memory"}, starts
    assert digest == uninterrupted
