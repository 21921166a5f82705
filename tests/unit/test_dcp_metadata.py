"""``dcp.load_metadata``: a DCP directory's ``.metadata`` as DCP itself writes it (protocol 4) loads; a forged one runs nothing."""

from __future__ import annotations

import os
import pickle

import pytest

torch = pytest.importorskip("torch")
dcp = pytest.importorskip("torch.distributed.checkpoint")

from elaunch.checkpoint import UnsafeStateError  # noqa: E402
from elaunch.checkpoint.dcp import SnapshotReader, load_metadata  # noqa: E402


def _saved_by_dcp(path) -> dict:
    state = {"w": torch.arange(12.0).reshape(3, 4), "n": 7, "blob": {"k": "v"}}
    dcp.save(state, checkpoint_id=str(path), no_dist=True)
    return state


def test_dcp_written_metadata_loads_and_reads_back(tmp_path, monkeypatch):
    state = _saved_by_dcp(tmp_path / "step_3")
    assert (tmp_path / "step_3" / ".metadata").read_bytes()[1] >= 4  # DCP pickles at protocol 4 (FRAME opcodes)
    md = load_metadata(str(tmp_path / "step_3"))
    assert set(md.state_dict_metadata) >= {"w", "n"}
    # the reader without elaunch (what torchrun users get) goes through it
    for var in ("ELAUNCH_CHECKPOINT_SHM", "ELAUNCH_CHECKPOINT_RESTORE", "ELAUNCH_CHECKPOINT_STEP"):
        monkeypatch.delenv(var, raising=False)
    reader = SnapshotReader(str(tmp_path / "step_3"))
    assert (reader.step, reader.source) == (3, "disk")
    got = {"w": torch.zeros(3, 4), "n": 0, "blob": {}}
    dcp.load(got, storage_reader=reader, no_dist=True)
    assert torch.equal(got["w"], state["w"]) and got["n"] == 7


class _Evil:
    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize("protocol", [2, 4])
def test_forged_metadata_runs_nothing(tmp_path, protocol):
    marker = tmp_path / "pwned"
    d = tmp_path / "step_1"
    d.mkdir()
    (d / ".metadata").write_bytes(pickle.dumps(_Evil(str(marker)), protocol=protocol))
    with pytest.raises(UnsafeStateError, match="system"):
        load_metadata(str(d))
    assert not marker.exists()


def test_an_allowed_object_that_is_not_metadata_is_refused(tmp_path):
    d = tmp_path / "step_1"
    d.mkdir()
    (d / ".metadata").write_bytes(pickle.dumps(torch.Size([1, 2]), protocol=4))
    with pytest.raises(UnsafeStateError, match="not DCP's Metadata"):
        load_metadata(str(d))
