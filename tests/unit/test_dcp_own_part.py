"""SnapshotReader over parts that each hold only their own rank's chunks (format ``elaunch.dcp/2``).

At an unchanged world size the restore plan gives each rank its own part only (no gather): a
node of a multi-node job then holds its own ranks' parts, not every chunk. A load whose plan
asks only for chunks this rank's part holds opens nothing else; one that needs a region its part
lacks opens this node's other parts of the step and reads it from them, split over their
chunks; a region no part here covers raises ``CheckpointError`` naming it, and nothing is
loaded (the uncovered region is listed as a chunk of its own, so DCP's plan asks for it
instead of leaving it as it was). The parts are JSON: a malformed one is refused.
"""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")
import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, MetadataIndex,  # noqa: E402
                                                   TensorProperties)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType  # noqa: E402

from elaunch.checkpoint import CheckpointError, slotfile  # noqa: E402
from elaunch.checkpoint import dcp as edcp  # noqa: E402
from elaunch.checkpoint import dcp_layout  # noqa: E402

FULL = torch.arange(12.0).reshape(6, 2)


def _item(fqn, t, offsets, size):
    return WriteItem(index=MetadataIndex(fqn, offsets), type=WriteItemType.SHARD,
                     tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(torch.Size(offsets), t.size()),
                                                 properties=TensorProperties.create_from_tensor(t),
                                                 size=torch.Size(size)))


def _save_parts(shm, monkeypatch, step=3):
    """Rank r of 3 saved rows [2r, 2r+2) of ``a`` (6 x 2); return each rank's slot path."""
    monkeypatch.setenv("ELAUNCH_CHECKPOINT_SHM", str(shm))
    paths = {}
    for rank in range(3):
        monkeypatch.setenv("LOCAL_RANK", str(rank))
        t = FULL[2 * rank:2 * rank + 2].clone()
        layout = dcp_layout.encode_layout([[_item("a", t, [2 * rank, 0], [6, 2])]], {"a": ["a"]})
        paths[rank] = edcp._write_part([("a", [2 * rank, 0], t, None)], layout, step, rank=rank, world_size=3)
        assert slotfile.read_info(paths[rank]).reshardable
    monkeypatch.setenv("ELAUNCH_CHECKPOINT_STEP", str(step))
    monkeypatch.setenv("ELAUNCH_CHECKPOINT_RESTORE", paths[0])
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "3")
    return paths


def _errors(raised) -> list[str]:
    return [str(e) for e in getattr(raised.value, "failures", {}).values()] or [str(raised.value)]


def test_a_region_its_own_part_lacks_is_read_from_the_others_split_over_their_chunks(tmp_path, monkeypatch):
    _save_parts(tmp_path, monkeypatch)
    mine = {"a": torch.zeros(6, 2)}
    reader = edcp.SnapshotReader()
    dcp.load(mine, storage_reader=reader)
    assert torch.equal(mine["a"], FULL)
    assert len(reader._parts) == 3  # its own first, the others once the plan asked for the gap


def test_a_load_of_its_own_chunks_opens_no_other_part_and_an_uncovered_region_is_named(tmp_path, monkeypatch):
    paths = _save_parts(tmp_path, monkeypatch)
    os.unlink(paths[2])  # rank 2's part is on another node
    reader = edcp.SnapshotReader()
    md = reader.read_metadata()
    assert [c.offsets for c in md.state_dict_metadata["a"].chunks] == [torch.Size([0, 0]), torch.Size([2, 0])]
    assert len(reader._parts) == 1  # its own part alone: the gap [2:6] is listed, not looked for yet
    both = {"a": torch.zeros(6, 2)}
    with pytest.raises(BaseException) as raised:  # DCP's CheckpointException, holding each rank's error
        dcp.load(both, storage_reader=edcp.SnapshotReader())
    assert any("1 chunk(s) this rank loads are in none of this node's snapshots (a at [4, 0])" in e
               for e in _errors(raised)), _errors(raised)
    assert torch.equal(both["a"], torch.zeros(6, 2))  # nothing was loaded


def test_a_forged_part_is_refused_and_nothing_is_unpickled(tmp_path, monkeypatch):
    paths = _save_parts(tmp_path, monkeypatch)
    info = slotfile.read_info(paths[0])
    meta = b'{"format":"elaunch.dcp/2","layout":{"fqns":{}},"items":[["a",[0,0],0,"float32",[999,2],null]]}'
    with pytest.raises(CheckpointError, match="ends past the data"):
        edcp._parse_part(meta, info, paths[0])
    assert edcp._parse_part(b"\x80\x02}q\x00.", info, paths[0]) is None  # a pickle (format 1): not read


@pytest.mark.parametrize("size, chunks, expect", [
    ([6], [[[0], [6]]], []),
    ([6], [[[0], [2]], [[4], [2]]], [[[2], [2]]]),
    ([4, 4], [[[0, 0], [2, 4]]], [[[2, 0], [2, 4]]]),
    ([4, 4], [[[1, 1], [2, 2]]], [[[0, 0], [1, 4]], [[3, 0], [1, 4]], [[1, 0], [2, 1]], [[1, 3], [2, 1]]]),
    ([], [[[], []]], []),
    ([0, 3], [], []),
])
def test_gaps_are_the_regions_no_chunk_covers(size, chunks, expect):
    assert dcp_layout.gaps(size, chunks) == expect


def test_ckpt_load_refuses_a_dcp_part_naming_snapshot_reader(tmp_path, monkeypatch):
    from elaunch.checkpoint import _read

    paths = _save_parts(tmp_path, monkeypatch)
    with pytest.raises(CheckpointError, match=r"rank 0's part of a torch.distributed.checkpoint save .*SnapshotReader"):
        _read.read(paths[0])


@pytest.mark.parametrize("bad", [-1, True, 1.5, "3", 2**63])
def test_a_snapshot_writers_step_is_an_int_a_snapshot_can_hold(bad):
    """2**63 passed and failed inside DCP's save with struct.error (a snapshot's step is a signed 64-bit field)."""
    with pytest.raises(ValueError, match=r"step must be an int from 0 to 2\*\*63 - 1"):
        edcp.SnapshotWriter(step=bad)
    edcp.SnapshotWriter(step=2**63 - 1)
