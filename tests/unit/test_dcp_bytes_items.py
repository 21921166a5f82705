"""A DCP checkpoint's non-tensor items load weights-only through SnapshotReader, from memory and from a directory.

DCP's ``DefaultLoadPlanner.load_bytes`` unpickles a non-tensor item with
``torch.load(weights_only=False)``. SnapshotReader hands it only bytes that load weights-only:
a forged item (here: a pickle of an ``os.system`` call, as a peer's replica or a shared
persisted directory could hold) raises ``UnsafeStateError`` and runs nothing, while ordinary
items (ints, strings, dicts of them) load as before.
"""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")
dcp = pytest.importorskip("torch.distributed.checkpoint")

from torch.distributed.checkpoint.api import CheckpointException  # noqa: E402

from elaunch.checkpoint import slotfile  # noqa: E402
from elaunch.checkpoint.dcp import SnapshotReader, SnapshotWriter  # noqa: E402


class _Evil:
    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.fixture
def node(tmp_path, monkeypatch):
    """One rank of a one-rank job whose agent directory is ``tmp_path/shm``."""
    shm = tmp_path / "shm"
    shm.mkdir()
    for var, value in {"ELAUNCH_CHECKPOINT_SHM": str(shm), "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(var, value)
    return shm


def _restore_env(monkeypatch, shm, step: int) -> None:
    newest = slotfile.newest(slotfile.read_info(p) for p in slotfile.slot_paths(str(shm), 0))
    monkeypatch.setenv("ELAUNCH_CHECKPOINT_STEP", str(step))
    monkeypatch.setenv("ELAUNCH_CHECKPOINT_RESTORE", newest.path)


def _state(extra):
    return {"w": torch.arange(6.0), "n": 3, "meta": {"name": "run", "lr": 0.1}, **extra}


def test_ordinary_items_load_from_memory(node, monkeypatch):
    dcp.save(_state({}), storage_writer=SnapshotWriter(step=4), no_dist=True)
    _restore_env(monkeypatch, node, 4)
    got = {"w": torch.zeros(6), "n": 0, "meta": {"name": None, "lr": None}}
    dcp.load(got, storage_reader=SnapshotReader(), no_dist=True)
    assert torch.equal(got["w"], torch.arange(6.0)) and got["n"] == 3 and got["meta"] == {"name": "run", "lr": 0.1}


def test_a_forged_item_in_memory_runs_nothing(node, tmp_path, monkeypatch):
    marker = tmp_path / "ran"
    dcp.save(_state({"evil": _Evil(str(marker))}), storage_writer=SnapshotWriter(step=5), no_dist=True)
    _restore_env(monkeypatch, node, 5)
    with pytest.raises(CheckpointException) as info:  # DCP's (a BaseException), wrapping ours
        dcp.load({"w": torch.zeros(6), "evil": None}, storage_reader=SnapshotReader(), no_dist=True)
    assert "UnsafeStateError" in str(info.value), info.value
    assert "'evil'" in str(info.value)
    assert not marker.exists()


def test_a_forged_item_in_a_dcp_directory_runs_nothing(tmp_path, monkeypatch):
    for var in ("ELAUNCH_CHECKPOINT_SHM", "ELAUNCH_CHECKPOINT_RESTORE", "ELAUNCH_CHECKPOINT_STEP"):
        monkeypatch.delenv(var, raising=False)
    marker = tmp_path / "ran"
    d = tmp_path / "step_2"
    dcp.save(_state({"evil": _Evil(str(marker))}), checkpoint_id=str(d), no_dist=True)
    with pytest.raises(CheckpointException) as info:  # DCP's (a BaseException), wrapping ours
        dcp.load({"w": torch.zeros(6), "evil": None}, storage_reader=SnapshotReader(str(d)), no_dist=True)
    assert "UnsafeStateError" in str(info.value), info.value
    assert not marker.exists()
    dcp.load({"w": torch.zeros(6), "evil": None}, checkpoint_id=str(d), no_dist=True)  # DCP's own reader runs it
    assert marker.exists()
