"""Sharded state (issue 36, item 1): DTensors saved with ``replicated=False`` and restored, with real FSDP2 and
tensor-parallel DTensors on 2 CPU ranks (gloo) under elaunch.

A DTensor leaf makes ``ckpt.save(..., replicated=True)`` raise ``TypeError`` naming its key path, before
anything is written. With ``replicated=False`` each rank saves its local shards; after a worker is killed
(SIGKILL) the restarted ranks get them back bit for bit: into the model's own DTensors in place (``into=``),
as new DTensors on meshes rebuilt (1-D, 2-D, a slice of a 2-D mesh; Shard, uneven Shard, Replicate,
Partial), from the file the agent persisted, and through the torchrun path. Without ``torch.distributed``,
or at another world size, ``ckpt.load`` raises ``CheckpointError`` saying the saved world size and that
resharding goes through ``torch.distributed.checkpoint``. Per-rank entries of replicated state: every
restoring rank gets the one snapshot the job chose, the lowest rank's.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.helpers import SCRIPTS, free_port, launcher_env, run

torch = pytest.importorskip("torch")
# whole training runs under faults: in the long part, so that the suite stays under its 20 minutes
pytestmark = [pytest.mark.slow, pytest.mark.long]

WORLD_1_LOAD = """
import sys, torch.distributed as dist, elaunch.checkpoint as ckpt
dist.init_process_group("gloo")
try:
    ckpt.load()
except ckpt.CheckpointError as exc:
    print("CheckpointError:", exc)
else:
    print("loaded")
"""


def test_fsdp2_and_tp_dtensors_are_saved_sharded_and_restored_after_a_kill(tmp_path):
    out, logs, ckpt_dir = tmp_path / "out", tmp_path / "logs", tmp_path / "ckpt"
    out.mkdir()
    r = run("elaunch", "--nproc-per-node=2", "--max-restarts=2", f"--log-dir={logs}", f"--checkpoint-dir={ckpt_dir}",
            "--checkpoint-persist-interval=0", str(SCRIPTS / "ckpt_fsdp.py"), str(out), str(ckpt_dir), timeout=300)
    assert r.returncode == 0, r.stderr[-4000:]
    for rank in (0, 1):
        got = json.loads((out / f"fsdp_{rank}.json").read_text())
        assert got["kinds"] == ["DTensor"], got
        assert got["held"] == [0], got  # every refused save left the snapshot in memory as it was
        for case, err in got["errors"].items():
            assert err is not None and err[0] == "TypeError", (case, err)
            assert "(a DTensor)" in err[1] and "cannot be saved as replicated state" in err[1], (case, err[1])
            assert "replicated=False" in err[1], err[1]
        assert "state['model']['0.weight'] (a DTensor)" in got["errors"]["state_dict"][1]
        assert len(got["dtensors"]) == 4 + 8 + 6, got["dtensors"]  # params, Adam's moments, tp

        restored = json.loads((out / f"restored_{rank}.json").read_text())
        assert restored["step"] == 1 and restored["rank"] == rank, restored
        assert restored["into_same_objects"] and restored["into_same_memory"], restored
        assert restored["model_params_hold_saved"], restored
        for case in ("into", "fresh", "persisted", "persisted_fresh", "local", "local_fresh"):
            assert restored[case] and all(restored[case].values()), (case, restored[case])
            assert set(restored[case]) == set(got["dtensors"]), case
        assert all(restored["full_tensors"].values()), restored["full_tensors"]
        assert restored["partial_sum"] == [3.0, 3.0, 3.0], restored
        assert restored["optim_state_is_dtensor"] == ["DTensor", "Tensor"], restored
        assert restored["persisted_raw_kind"] == "dict", restored  # torch.load alone, no process group
        assert restored["persisted_into_same_objects"] and restored["local_into_same_objects"], restored
        assert restored["local_step"] == 5, restored
        assert restored["local_raw_kind"] == "dict" and restored["local_save_kept_state"] == "DTensor", restored

        replicated = json.loads((out / f"replicated_{rank}.json").read_text())
        # replicated state: one snapshot serves every rank, the lowest rank's, per-rank entries included
        assert replicated == {"step": 2, "rank": 0, "rng_is_rank_0s": True}, replicated

    code, last = json.loads((out / "restored_0.json").read_text())["without_process_group"]
    assert code != 0 and last and last[0].startswith("elaunch.checkpoint.CheckpointError: "), last
    assert "saved by a world of 2 ranks and torch.distributed is not initialized here" in last[0], last
    assert "torch.distributed.checkpoint with elaunch.checkpoint.SnapshotReader" in last[0], last

    # the persisted file of rank 0, loaded in a world of 1
    env = launcher_env(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
                       ELAUNCH_CHECKPOINT_SHM=str(tmp_path), ELAUNCH_CHECKPOINT_RESTORE=str(out / "persisted_rank0.pt"))
    child = subprocess.run([sys.executable, "-c", WORLD_1_LOAD], env=env, capture_output=True, text=True,
                           timeout=120)
    assert child.returncode == 0, child.stderr[-3000:]
    assert child.stdout.startswith("CheckpointError: the snapshot holds DTensors saved by a world of 2 ranks and "
                                   "this run has 1: restore it at 2 ranks"), child.stdout
    assert "reshard it through torch.distributed.checkpoint with elaunch.checkpoint.SnapshotReader" in child.stdout
