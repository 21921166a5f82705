"""A DCP save under elaunch is persisted as an ordinary DCP directory that DCP alone loads (issue 36).

A 2-rank FSDP2 job on CPU/gloo (``tests/scripts/dcp_persist.py``) saves steps 1..3 with
``dcp.save(..., storage_writer=SnapshotWriter(step=...))`` under
``elaunch --standalone --nproc-per-node=2 --checkpoint-dir=...``; the agent's persister
writes ``dcp/step_<step>/``. Then plain Python processes, no elaunch in their environment
(``tests/scripts/dcp_load_check.py``), load it with DCP's own ``FileSystemReader`` at
world size 2 and at world size 1 (DCP reshards from disk) and compare every value with
what the job held. A forged ``.metadata`` read through elaunch's reader runs nothing.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys

import pytest

from tests.helpers import SCRIPTS, free_port, launcher_env, run

torch = pytest.importorskip("torch")
from elaunch.checkpoint import UnsafeStateError, persisted  # noqa: E402 - after the torch check
from elaunch.checkpoint.dcp import load_metadata, persisted_dir  # noqa: E402

STEPS = 3


def plain_env(**extra: str) -> dict[str, str]:
    """A clean environment without anything of elaunch's (no ``ELAUNCH_*``)."""
    env = {k: v for k, v in launcher_env().items() if not k.startswith("ELAUNCH_")}
    return {**env, "OMP_NUM_THREADS": "1", **extra}


def check(path: str, expected: str, out, world: int) -> list[str]:
    """Run ``dcp_load_check.py`` as ``world`` plain processes; each rank's verdict."""
    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, str(SCRIPTS / "dcp_load_check.py"), path, expected, str(out)],
                              env=plain_env(RANK=str(r), WORLD_SIZE=str(world), LOCAL_RANK=str(r),
                                            MASTER_ADDR="127.0.0.1", MASTER_PORT=port),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(world)]
    try:
        outputs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, output in zip(procs, outputs):
        assert p.returncode == 0, output[-3000:]
    verdicts = [(out / f"check_{r}.txt").read_text() for r in range(world)]
    for r in range(world):
        (out / f"check_{r}.txt").unlink()
    return verdicts


@pytest.mark.long  # in the long part (scripts/test.sh --long): the suite took 19:54 of its 20 minutes on a fresh machine
def test_a_dcp_save_is_persisted_as_a_dcp_directory_dcp_loads_without_elaunch_at_world_sizes_2_and_1(tmp_path):
    out, ckpt, logs = tmp_path / "out", tmp_path / "ckpt", tmp_path / "logs"
    out.mkdir()
    r = run("elaunch", "--standalone", "--nproc-per-node=2", f"--log-dir={logs}", f"--checkpoint-dir={ckpt}",
            "--checkpoint-persist-interval=1", str(SCRIPTS / "dcp_persist.py"), str(out), str(ckpt), str(STEPS),
            timeout=300)
    assert r.returncode == 0, r.stderr[-4000:]
    step_dir = persisted_dir(str(ckpt), STEPS)
    # the newest complete step alone is left: steps 1 and 2 went once step 3 was complete
    assert persisted.dcp_steps(str(ckpt)) == {STEPS: True}
    assert persisted.newest_dcp(str(ckpt)) == (STEPS, step_dir)
    assert sorted(n for n in os.listdir(step_dir) if not n.startswith(".")) == ["__0_0.distcp", "__1_0.distcp"]
    assert not [n for n in os.listdir(step_dir) if ".tmp-" in n]
    assert load_metadata(step_dir).version == "1.0.0"  # what SnapshotReader reads, weights-only
    # each chunk is in the file of the rank DCP's plan gave it to, as in DCP's own directory of the same save
    # (a replicated tensor once), whatever order this node's persister wrote its ranks' parts in
    placed = {(fqn, str(offsets)): side["file"] for side in persisted.read_sidecars(step_dir).values()
              for fqn, offsets, *_ in side["items"]}
    reference = {(k.fqn, str(list(k.offset)) if k.offset is not None else "None"): v.relative_path
                 for k, v in load_metadata(str(out / "reference")).storage_data.items()}
    assert sum(len(side["items"]) for side in persisted.read_sidecars(step_dir).values()) == len(placed)
    assert placed == reference
    expected = str(out / "expected.pt")
    ok = f"ok {len(torch.load(expected))}"
    # DCP's own directory of the same state, written by the job's FileSystemWriter, reads the same: the check is sound
    assert check(str(out / "reference"), expected, out, 1) == [ok]
    for world in (2, 1):
        assert check(step_dir, expected, out, world) == [ok] * world, world


class _RunsCode:
    """Unpickles as ``os.system(...)``: what a forged ``.metadata`` would run under ``pickle.load``."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_forged_metadata_is_refused_and_runs_nothing(tmp_path):
    d = tmp_path / "step_000000000001"
    d.mkdir()
    marker = tmp_path / "ran"
    (d / ".metadata").write_bytes(pickle.dumps(_RunsCode(str(marker)), protocol=2))
    with pytest.raises(UnsafeStateError):
        load_metadata(str(d))
    assert not marker.exists()
    pickle.loads((d / ".metadata").read_bytes())  # the forgery is real: plain unpickling runs it
    assert marker.exists()
