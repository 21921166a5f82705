"""SnapshotReader on a node that holds only some ranks' parts: what this rank's load plan asks must be there, no more.

At an unchanged world size the restore plan gives each rank its own part only (no gather): a
node of a multi-node job then holds its own ranks' parts, not every chunk of the layout. A load
whose plan asks only for chunks this node holds succeeds; one that asks for a chunk no snapshot
here holds raises ``CheckpointError`` naming it, and nothing is loaded.
"""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")
import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.checkpoint.default_planner import create_default_local_save_plan  # noqa: E402

from elaunch.checkpoint import dcp as edcp  # noqa: E402
from elaunch.checkpoint import slotfile  # noqa: E402


def _save_two_parts(shm, monkeypatch, step=3):
    """Rank 0 saved ``a``, rank 1 saved ``b`` (world 2, one layout); return rank 0's slot path."""
    full = {"a": torch.arange(6.0), "b": torch.arange(4.0) + 10}
    items = create_default_local_save_plan(full, True).items
    layout = edcp.encode_layout([items], {})
    monkeypatch.setenv("ELAUNCH_CHECKPOINT_SHM", str(shm))
    paths = {}
    for rank, fqn in ((0, "a"), (1, "b")):
        monkeypatch.setenv("LOCAL_RANK", str(rank))
        state = {"format": edcp.FORMAT, "rank": rank, "world_size": 2, "layout": layout,
                 "items": [[fqn, [0], full[fqn].clone()]]}
        paths[rank] = edcp._commit(state, step, rank=rank, world_size=2)
    assert slotfile.read_info(paths[0]).reshardable
    return paths


def test_a_load_that_needs_only_this_nodes_chunks_succeeds_without_the_others(tmp_path, monkeypatch):
    paths = _save_two_parts(tmp_path, monkeypatch)
    os.unlink(paths[1])  # rank 1's part is on another node
    monkeypatch.setenv("ELAUNCH_CHECKPOINT_STEP", "3")
    monkeypatch.setenv("ELAUNCH_CHECKPOINT_RESTORE", paths[0])
    mine = {"a": torch.zeros(6)}
    dcp.load(mine, storage_reader=edcp.SnapshotReader())
    assert torch.equal(mine["a"], torch.arange(6.0))
    both = {"a": torch.zeros(6), "b": torch.zeros(4)}
    with pytest.raises(BaseException) as raised:  # DCP's CheckpointException, holding each rank's error
        dcp.load(both, storage_reader=edcp.SnapshotReader())
    errors = [str(e) for e in getattr(raised.value, "failures", {}).values()] or [str(raised.value)]
    assert any("1 chunk(s) this rank loads are in none of this node's snapshots (b at [0])" in e for e in errors), errors
    assert torch.equal(both["b"], torch.zeros(4))
