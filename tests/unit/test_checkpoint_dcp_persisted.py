"""The persisted DCP directory (``checkpoint.persisted``'s DCP part): sidecars, ``.metadata``, completeness, pruning.

Pure logic as tables; the files as real files in a temporary directory, read back by DCP's
own ``FileSystemReader`` in this process (no process group: DCP's single-process load).
"""

from __future__ import annotations

import json
import os

import pytest

from elaunch.checkpoint import persisted

torch = pytest.importorskip("torch")
import torch.distributed.checkpoint as dcp  # noqa: E402 - after the torch check

from elaunch.checkpoint.dcp import load_metadata, persisted_dir  # noqa: E402


def sidecar(rank, world=2, layout=None, items=(), time=1.0):
    return {"format": persisted.DCP_INDEX_FORMAT, "rank": rank, "world_size": world,
            "layout": layout if layout is not None else {"fqns": {}, "planner_data": {}},
            "file": persisted.dcp_data_name(rank), "size": 0, "time": time, "items": [list(i) for i in items]}


@pytest.mark.parametrize("ranks, expect", [
    ({0: sidecar(0), 1: sidecar(1)}, (2, [0, 1])),
    ({0: sidecar(0)}, None),                                                  # rank 1 not there yet
    ({0: sidecar(0), 1: sidecar(1, world=3)}, None),                          # two world sizes
    ({0: sidecar(0, world=1), 1: sidecar(1)}, (1, [0])),                      # world 1 is whole
    ({0: sidecar(0, world=1, time=5.0), 1: sidecar(1, world=1)}, (1, [0])),   # rank 1 of world 1: not a rank
])
def test_a_save_is_whole_when_every_rank_of_one_world_has_a_sidecar(ranks, expect):
    got = persisted.whole_save(ranks)
    assert (None if got is None else (got[0], sorted(got[1]))) == expect


def test_of_two_whole_saves_the_newer_commits_win():
    ranks = {0: sidecar(0, world=1, time=1.0)}
    assert persisted.whole_save(ranks)[0] == 1
    newer = {0: sidecar(0, world=2, time=3.0), 1: sidecar(1, world=2, time=3.0)}
    assert persisted.whole_save(newer)[0] == 2


F32 = ["float32", False, "contiguous_format", False]
#: rank 0 saved w[0:2], rank 1 w[2:4]; both the replicated step and the bytes lr
LAYOUTS = {r: {"fqns": {"w": ["tensor", F32, [4], [[[2 * r], [2]]]], "step": ["tensor", F32, [], [[[], []]]],
                        "lr": ["bytes"]}, "planner_data": {"w": ["w"], "step": ["step"], "lr": ["lr"]}}
           for r in (0, 1)}
LAYOUT = {"fqns": {"w": ["tensor", F32, [4], [[[0], [2]], [[2], [2]]]], "step": ["tensor", F32, [], [[[], []]]],
                   "lr": ["bytes"]}, "planner_data": {"w": ["w"], "step": ["step"], "lr": ["lr"]}}


def test_the_layout_of_a_save_is_the_union_of_its_ranks_and_must_cover_every_tensor():
    docs = {r: sidecar(r, layout=LAYOUTS[r]) for r in (0, 1)}
    got = persisted.dcp_layout(docs)
    assert got["fqns"]["w"][3] == [[[0], [2]], [[2], [2]]] and got["fqns"]["step"] == LAYOUT["fqns"]["step"]
    del docs[1]
    with pytest.raises(ValueError, match=r"1 region\(s\) of the layout are in no rank's part \(w at \[2\]"):
        persisted.dcp_layout(docs)
    other = {0: sidecar(0, layout=LAYOUTS[0]), 1: sidecar(1, layout={"fqns": {"w": ["tensor", F32, [6], []]}})}
    with pytest.raises(ValueError, match="different saves"):
        persisted.dcp_layout(other)


def test_each_chunk_is_taken_from_the_lowest_rank_holding_it_and_a_missing_one_is_named():
    docs = {1: sidecar(1, items=[["w", [2], 0, 10], ["step", [], 10, 5], ["lr", None, 15, 3]]),
            0: sidecar(0, items=[["w", [0], 0, 11], ["step", [], 11, 6]])}
    where = persisted.dcp_storage(LAYOUT, docs)
    assert where == {("w", (0,)): ("__0_0.distcp", 0, 11), ("w", (2,)): ("__1_0.distcp", 0, 10),
                     ("step", ()): ("__0_0.distcp", 11, 6), ("lr", None): ("__1_0.distcp", 15, 3)}
    del docs[1]["items"][0]
    with pytest.raises(ValueError, match=r"1 chunk\(s\).*w at \[2\]"):
        persisted.dcp_storage(LAYOUT, docs)


def test_held_keys_are_those_of_the_same_save_only():
    docs = {0: sidecar(0, items=[["w", [0], 0, 1], ["lr", None, 1, 1]]),
            1: sidecar(1, world=3, items=[["w", [2], 0, 1]])}
    assert persisted.held_keys(docs, 2) == {("w", (0,)), ("lr", None)}
    assert persisted.held_keys(docs, 4) == set()


# -- real files, read back by DCP --------------------------------------------------------------------------------

def parts():
    """Two ranks' parts of a save of ``{"w": [4] sharded in two, "step": replicated, "lr": bytes}``."""
    import io

    buf = io.BytesIO()
    torch.save(0.5, buf)
    lr = torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)
    w = torch.arange(4, dtype=torch.float32) + 1
    base = torch.zeros(1000)
    base[:2] = w[:2]
    step = torch.tensor(7.0)
    return {0: [["lr", None, lr], ["w", [0], base[:2]], ["step", [], step]],  # a view of a 4000-byte storage
            1: [["lr", None, lr.clone()], ["w", [2], w[2:].clone()], ["step", [], step.clone()]]}


def load(path):
    state = {"w": torch.zeros(4), "step": torch.tensor(0.0), "lr": 0.0}
    dcp.load(state, storage_reader=dcp.FileSystemReader(path))
    return state


def write(ckpt, step, rank, world=2):
    d = persisted_dir(str(ckpt), step)
    skip = persisted.held_keys(persisted.read_sidecars(d), world)
    return persisted.write_dcp_part(str(ckpt), step, rank, world, LAYOUTS[rank], parts()[rank], skip,
                                    time=float(step))


def test_the_ranks_parts_make_a_dcp_directory_once_the_last_sidecar_is_there(tmp_path):
    d = persisted_dir(str(tmp_path), 3)
    write(tmp_path, 3, 1)
    assert not persisted.finish_dcp_step(str(tmp_path), 3)  # rank 0's part is missing: incomplete
    assert not os.path.exists(os.path.join(d, ".metadata")) and persisted.newest_dcp(str(tmp_path)) is None
    write(tmp_path, 3, 0)
    assert persisted.finish_dcp_step(str(tmp_path), 3)
    assert persisted.finish_dcp_step(str(tmp_path), 3)  # idempotent
    assert persisted.newest_dcp(str(tmp_path)) == (3, d)
    state = load(d)
    assert torch.equal(state["w"], torch.arange(4, dtype=torch.float32) + 1)
    assert state["step"].item() == 7.0 and state["lr"] == 0.5
    # rank 1 wrote first: rank 0 left out what rank 1's sidecar holds; a view was written as its own elements
    index = {r: json.loads(open(os.path.join(d, persisted.dcp_sidecar_name(r))).read()) for r in (0, 1)}
    assert sorted(i[0] for i in index[0]["items"]) == ["w"]
    assert sorted(i[0] for i in index[1]["items"]) == ["lr", "step", "w"]
    length = {r: next(i[3] for i in index[r]["items"] if i[0] == "w") for r in (0, 1)}
    assert length[0] == length[1]  # the view's 2 elements, not its storage's 1000
    # what elaunch's own weights-only reader takes (SnapshotReader reads a persisted directory so)
    md = load_metadata(d)
    assert md.version == "1.0.0" and set(md.state_dict_metadata) == {"w", "step", "lr"}
    assert sorted(os.path.basename(p) for p in os.listdir(d) if not p.startswith(".")) == \
        ["__0_0.distcp", "__1_0.distcp"]


def test_a_rank_file_rewritten_after_its_sidecar_keeps_the_step_incomplete(tmp_path):
    d = persisted_dir(str(tmp_path), 4)
    write(tmp_path, 4, 0)
    write(tmp_path, 4, 1)
    with open(os.path.join(d, persisted.dcp_data_name(1)), "ab") as f:
        f.write(b"x")  # a new write of rank 1's file whose sidecar is not there yet
    assert not persisted.finish_dcp_step(str(tmp_path), 4)


def test_a_complete_step_is_pruned_only_once_a_newer_one_is_complete(tmp_path):
    ckpt = str(tmp_path)
    for rank in (0, 1):
        write(tmp_path, 1, rank)
    persisted.finish_dcp_step(ckpt, 1)
    write(tmp_path, 2, 0)  # step 2 incomplete
    keep = persisted.newest_dcp(ckpt, at_most=2)
    assert keep[0] == 1 and persisted.prune_dcp(ckpt, keep[0]) == []
    assert persisted.dcp_steps(ckpt) == {1: True, 2: False}
    write(tmp_path, 2, 1)
    persisted.finish_dcp_step(ckpt, 2)
    assert persisted.prune_dcp(ckpt, persisted.newest_dcp(ckpt, at_most=2)[0]) == [1]
    assert persisted.dcp_steps(ckpt) == {2: True}
    assert persisted.newest_dcp(ckpt, at_most=1) is None


def test_the_keepers_helper_and_the_writers_path_agree(tmp_path):
    os.makedirs(os.path.join(persisted_dir(str(tmp_path), 120), ".metadata"))
    assert persisted.newest_dcp(str(tmp_path)) == (120, persisted_dir(str(tmp_path), 120))


def test_a_sidecar_of_another_format_or_naming_another_rank_is_left_out(tmp_path):
    d = persisted_dir(str(tmp_path), 5)
    os.makedirs(d)
    docs = {persisted.dcp_sidecar_name(0): sidecar(0, world=1),
            persisted.dcp_sidecar_name(1): sidecar(0, world=1),                   # file of rank 1 says rank 0
            persisted.dcp_sidecar_name(2): {**sidecar(2, world=3), "format": "x"},
            "x.json": sidecar(3)}
    for name, doc in docs.items():
        with open(os.path.join(d, name), "w") as f:
            json.dump(doc, f)
    with open(os.path.join(d, persisted.dcp_sidecar_name(3)), "w") as f:
        f.write("{not json")
    assert list(persisted.read_sidecars(d)) == [0]
