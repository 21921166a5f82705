"""The restore plan (elaunch/checkpoint/plan.py): which one step the job restores and each rank's source.

Pure logic, tables of cases: nodes' inventories in, the chosen step and sources out.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys

import pytest

from elaunch.checkpoint import plan
from elaunch.checkpoint.keeper import plan_reason_line
from elaunch.checkpoint.plan import DISK, REPLICA, SLOT, Held, Plan, Source, choose
from elaunch.checkpoint.slotfile import SlotInfo


def rep(step, rank=0, where=SLOT, loc=None, ws=2, shared=False):
    """A replicated snapshot."""
    return Held(step, rank, ws, True, where, loc or f"{where}/{rank}@{step}", shared)


def shard(step, rank, ws, where=SLOT, loc=None, shared=False):
    """A sharded snapshot of ``rank`` saved at world size ``ws``."""
    return Held(step, rank, ws, False, where, loc or f"{where}/{rank}@{step}", shared)


def part(step, rank, ws, where=SLOT, loc=None):
    """A reshardable part (``SnapshotWriter``) of ``rank`` saved at world size ``ws``."""
    return Held(step, rank, ws, False, where, loc or f"{where}/{rank}@{step}", False, True)


def dcp_dir(step, loc=None, shared=False):
    """A complete persisted DCP directory of ``step`` (serves every rank)."""
    return Held(step, 0, 0, False, DISK, loc or f"dcp/step_{step}", shared, True)


TWO = {"a": [0, 1], "b": [2, 3]}

# (name, ranks_by_node, held, world_size, expected step, {rank: (node, where)} or None, reason substring)
CASES = [
    ("nothing anywhere: fresh", TWO, {}, 4, None, None, ""),
    ("replicated: each node restores its own newest common step from its slots",
     TWO, {"a": [rep(5), rep(4)], "b": [rep(5, 2), rep(4, 2)]}, 4, 5,
     {0: ("a", SLOT), 1: ("a", SLOT), 2: ("b", SLOT), 3: ("b", SLOT)}, ""),
    ("replicated: the newest step anywhere serves every rank (a peer's slot is fetched)",
     TWO, {"a": [rep(7), rep(6)], "b": [rep(6, 2)]}, 4, 7,
     {0: ("a", SLOT), 1: ("a", SLOT), 2: ("a", SLOT), 3: ("a", SLOT)}, ""),
    ("replicated: a new node (nothing held) fetches from the peer's replica of a step some node committed",
     {"a": [0], "new": [1]}, {"a": [rep(3, 0, REPLICA), rep(3, 9, DISK)]}, 2, 3,
     {0: ("a", REPLICA), 1: ("a", REPLICA)}, ""),
    ("replicated: a replica ahead of every node's own snapshot is refused: the newest own step wins",
     {"a": [0], "b": [1]}, {"a": [rep(10**9, 0, REPLICA), rep(3, 0)], "b": [rep(3, 1)]}, 2, 3,
     {0: ("a", SLOT), 1: ("b", SLOT)}, ""),
    ("replicated: only replicas, no node's own snapshot: fresh",
     {"a": [0], "new": [1]}, {"a": [rep(3, 0, REPLICA)]}, 2, None, None, ""),
    ("sharded: replicas of every rank ahead of the survivors' own step are refused; the own step serves",
     {"a": [0], "new": [1]}, {"a": [shard(6, 0, 2), shard(6, 1, 2, REPLICA), shard(10**9, 0, 2, REPLICA),
                                    shard(10**9, 1, 2, REPLICA)]}, 2, 6, {0: ("a", SLOT), 1: ("a", REPLICA)}, ""),
    ("replicated: own slot before own replica",
     {"a": [0]}, {"a": [rep(3, 1, REPLICA), rep(3, 0, SLOT)]}, 1, 3, {0: ("a", SLOT)}, ""),
    ("replicated: own replica before a peer's slot",
     {"a": [0], "b": [1]}, {"a": [rep(3, 1, REPLICA)], "b": [rep(3, 1, SLOT)]}, 2, 3,
     {0: ("a", REPLICA), 1: ("b", SLOT)}, ""),
    ("replicated: a peer's memory before own disk",
     {"a": [0], "b": [1]}, {"a": [rep(3, 0, DISK)], "b": [rep(3, 1, SLOT)]}, 2, 3,
     {0: ("b", SLOT), 1: ("b", SLOT)}, ""),
    ("replicated: another node's unshared disk serves nobody else: fresh",
     {"a": [0], "b": [1]}, {"a": [rep(3, 0, DISK)]}, 2, None, None, ""),
    ("replicated: another node's unshared disk: the older step in memory everywhere wins",
     {"a": [0], "b": [1]}, {"a": [rep(3, 0, DISK), rep(2)], "b": [rep(2, 1)]}, 2, 2,
     {0: ("a", SLOT), 1: ("b", SLOT)}, ""),
    ("replicated: a shared disk serves every node",
     {"a": [0], "b": [1]}, {"a": [rep(3, 0, DISK, shared=True)]}, 2, 3, {0: ("a", DISK), 1: ("a", DISK)}, ""),
    ("replicated: own disk before another's shared disk",
     {"a": [0], "b": [1]}, {"a": [rep(3, 0, DISK, shared=True)], "b": [rep(3, 1, DISK)]}, 2, 3,
     {0: ("a", DISK), 1: ("b", DISK)}, ""),
    ("replicated serves any world size (4 saved, 3 now)",
     {"a": [0, 1], "c": [2]}, {"a": [rep(9, 0, ws=4)]}, 3, 9, {0: ("a", SLOT), 1: ("a", SLOT), 2: ("a", SLOT)}, ""),
    ("replicated: fetches spread over the peers holding the step",
     {"new": [0, 1, 2, 3]}, {"p": [rep(4, 0)], "q": [rep(4, 1)]}, 4, 4,
     {0: ("p", SLOT), 1: ("q", SLOT), 2: ("p", SLOT), 3: ("q", SLOT)}, ""),
    ("sharded: each rank its own shard, same world size",
     TWO, {"a": [shard(5, 0, 4), shard(5, 1, 4)], "b": [shard(5, 2, 4), shard(5, 3, 4)]}, 4, 5,
     {0: ("a", SLOT), 1: ("a", SLOT), 2: ("b", SLOT), 3: ("b", SLOT)}, ""),
    ("sharded: a rank without step 6 makes the job take 5 (never mixed steps)",
     TWO, {"a": [shard(6, 0, 4), shard(6, 1, 4), shard(5, 0, 4), shard(5, 1, 4)],
           "b": [shard(6, 2, 4), shard(5, 2, 4), shard(5, 3, 4)]}, 4, 5,
     {0: ("a", SLOT), 1: ("a", SLOT), 2: ("b", SLOT), 3: ("b", SLOT)}, ""),
    ("sharded: a replaced node's ranks come from the peer's replicas",
     {"a": [0, 1], "new": [2, 3]},
     {"a": [shard(5, 0, 4), shard(5, 1, 4), shard(5, 2, 4, REPLICA), shard(5, 3, 4, REPLICA)]}, 4, 5,
     {0: ("a", SLOT), 1: ("a", SLOT), 2: ("a", REPLICA), 3: ("a", REPLICA)}, ""),
    ("sharded: a rank's shard missing everywhere: fresh, no reason",
     TWO, {"a": [shard(5, 0, 4), shard(5, 1, 4)], "b": [shard(5, 2, 4)]}, 4, None, None, ""),
    ("sharded: the world size changed: fresh, with the reason",
     {"a": [0, 1], "c": [2]}, {"a": [shard(5, r, 4) for r in range(4)]}, 3, None, None,
     "sharded snapshot of step 5 of world size 4 cannot serve world size 3: load the persisted checkpoint "
     "with torch.distributed.checkpoint"),
    ("sharded: an incomplete other world size is no reason",
     {"a": [0, 1], "c": [2]}, {"a": [shard(5, r, 4) for r in range(3)]}, 3, None, None, ""),
    ("sharded: a shard of another world size never serves the same rank number",
     {"a": [0, 1]}, {"a": [shard(5, 0, 2), shard(5, 1, 3)]}, 2, None, None, ""),
    ("sharded: an older step saved at this world size serves; the reason names the newer one's world size",
     {"a": [0, 1]}, {"a": [shard(9, r, 4) for r in range(4)] + [shard(3, 0, 2), shard(3, 1, 2, DISK)]}, 2, 3,
     {0: ("a", SLOT), 1: ("a", DISK)}, "sharded snapshot of step 9 of world size 4 cannot serve world size 2"),
    ("reshardable, shrink 4 -> 2: the survivor's slots and replicas hold every saved rank's part",
     {"a": [0, 1]}, {"a": [part(5, 0, 4), part(5, 1, 4), part(5, 2, 4, REPLICA), part(5, 3, 4, REPLICA)]}, 2, 5,
     {0: ("a", SLOT), 1: ("a", SLOT)}, ""),
    ("reshardable, grow 2 -> 4: the new node's ranks get the peer's parts",
     TWO, {"a": [part(5, 0, 2), part(5, 1, 2)]}, 4, 5,
     {0: ("a", SLOT), 1: ("a", SLOT), 2: ("a", SLOT), 3: ("a", SLOT)}, ""),
    ("reshardable, unchanged world size with every own part: the own-part plan",
     TWO, {"a": [part(5, 0, 4), part(5, 1, 4)], "b": [part(5, 2, 4), part(5, 3, 4)]}, 4, 5,
     {0: ("a", SLOT), 1: ("a", SLOT), 2: ("b", SLOT), 3: ("b", SLOT)}, ""),
    ("reshardable: a part in no memory: the complete DCP directory of the step, on every node's disk",
     {"a": [0, 1]}, {"a": [part(5, 0, 4), part(5, 1, 4), part(5, 2, 4, REPLICA), dcp_dir(5)]}, 2, 5,
     {0: ("a", DISK), 1: ("a", DISK)}, ""),
    ("reshardable: a part in no memory, a shared DCP directory serves the other node too",
     TWO, {"a": [part(5, 0, 2), dcp_dir(5, shared=True)]}, 4, 5,
     {0: ("a", DISK), 1: ("a", DISK), 2: ("a", DISK), 3: ("a", DISK)}, ""),
    ("reshardable: a part in no memory, another node's unshared DCP directory serves nobody else: the older step",
     TWO, {"a": [part(5, 0, 2), dcp_dir(5), part(4, 0, 2), part(4, 1, 2)]}, 4, 4,
     {0: ("a", SLOT), 1: ("a", SLOT), 2: ("a", SLOT), 3: ("a", SLOT)},
     "reshardable step 5 of world size 2: the part of saved rank(s) 1 is in no node's memory"),
    ("reshardable: a part in no memory and no DCP directory: fresh, with the reason",
     {"a": [0, 1]}, {"a": [part(5, 0, 4), part(5, 1, 4), part(5, 3, 4, REPLICA)]}, 2, None, None,
     "reshardable step 5 of world size 4: the part of saved rank(s) 2 is in no node's memory, and no complete "
     "persisted DCP directory of that step is on a disk every node reads"),
    ("reshardable: parts of every rank only as replicas ahead of the own step are refused; the own step reshards",
     {"a": [0]}, {"a": [part(6, 0, 2), part(6, 1, 2, REPLICA), part(10**9, 0, 2, REPLICA),
                        part(10**9, 1, 2, REPLICA)]}, 1, 6, {0: ("a", SLOT)}, ""),
    ("reshardable: a DCP directory of a newer step than memory's complete one wins",
     {"a": [0, 1]}, {"a": [dcp_dir(9), part(7, 0, 4), part(7, 1, 4), part(7, 2, 4), part(7, 3, 4)]}, 2, 9,
     {0: ("a", DISK), 1: ("a", DISK)}, ""),
    ("sharded (ckpt.save, not reshardable) parts of every rank still cannot reshard",
     {"a": [0, 1]}, {"a": [shard(5, r, 4) for r in range(4)]}, 2, None, None,
     "sharded snapshot of step 5 of world size 4 cannot serve world size 2"),
    ("sharded: own disk shards are used when memory is gone",
     {"a": [0], "b": [1]}, {"a": [shard(5, 0, 2, DISK)], "b": [shard(5, 1, 2, DISK)]}, 2, 5,
     {0: ("a", DISK), 1: ("b", DISK)}, ""),
]


@pytest.mark.parametrize("name, ranks, held, ws, step, sources, reason", CASES, ids=[c[0] for c in CASES])
def test_choose(name, ranks, held, ws, step, sources, reason):
    me = sorted(ranks)[0]
    got = choose(ranks, held, ws, me)
    assert got.step == step
    if sources is None:
        assert got.sources == {} and got.mine == {}
    else:
        assert {r: (s.node, s.where) for r, s in got.sources.items()} == sources
        assert got.mine == {r: s for r, s in got.sources.items() if r in ranks[me]}
    assert reason in got.reason and bool(got.reason) == bool(reason)


def test_a_shrink_gathers_every_saved_rank_on_the_survivor_from_its_own_memory():
    held = {"a": [part(5, 0, 4), part(5, 1, 4), part(5, 2, 4, REPLICA), part(5, 3, 4, REPLICA)]}
    got = choose({"a": [0, 1]}, held, 2, "a")
    assert got.saved_world_size == 4
    assert got.parts == {"a": {0: Source("a", SLOT, "slot/0@5"), 1: Source("a", SLOT, "slot/1@5"),
                               2: Source("a", REPLICA, "replica/2@5"), 3: Source("a", REPLICA, "replica/3@5")}}
    assert got.sources == {0: got.parts["a"][0], 1: got.parts["a"][1]}  # each new rank's file: a part of its node


def test_a_grow_has_every_node_gather_every_part_fetches_spread_over_the_holders():
    held = {"a": [part(5, 0, 2), part(5, 1, 2)], "b": [part(5, 0, 2, REPLICA), part(5, 1, 2, REPLICA)], "new": []}
    ranks = {"a": [0, 1], "b": [2, 3], "new": [4, 5]}
    plans = {me: choose(ranks, held, 6, me) for me in ranks}
    assert len({repr(sorted(p.parts.items())) for p in plans.values()}) == 1  # every node computes the same
    got = plans["new"]
    assert {n: {r: (s.node, s.where) for r, s in ps.items()} for n, ps in got.parts.items()} == {
        "a": {0: ("a", SLOT), 1: ("a", SLOT)}, "b": {0: ("b", REPLICA), 1: ("b", REPLICA)},
        "new": {0: ("a", SLOT), 1: ("b", REPLICA)}}  # the newcomer's two fetches go to two peers
    assert got.parts_of("new") == got.parts["new"] and got.parts_of("nobody") == {}
    assert {r: s.node for r, s in got.mine.items()} == {4: "a", 5: "b"}  # rank 4: part 0, rank 5: part 1


def test_an_unchanged_world_with_every_own_part_gathers_nothing():
    held = {"a": [part(5, 0, 4), part(5, 1, 4), part(5, 2, 4, REPLICA), part(5, 3, 4, REPLICA)],
            "b": [part(5, 2, 4), part(5, 3, 4)]}
    got = choose(TWO, held, 4, "b")
    assert got.parts == {} and got.saved_world_size is None
    assert got.mine == {2: Source("b", SLOT, "slot/2@5"), 3: Source("b", SLOT, "slot/3@5")}


def test_every_node_computes_the_same_plan_and_fetches_only_from_peers():
    held = {"a": [rep(4, 0)], "b": [], "c": [rep(4, 4, REPLICA)]}
    ranks = {"a": [0, 1], "b": [2, 3], "c": [4, 5]}
    plans = {me: choose(ranks, held, 6, me) for me in ranks}
    assert len({tuple(sorted(p.sources.items())) for p in plans.values()}) == 1
    assert plans["b"].fetches("b") == {2: Source("a", SLOT, "slot/0@4"), 3: Source("c", REPLICA, "replica/4@4")}
    assert plans["a"].fetches("a") == {} and plans["a"].mine.keys() == {0, 1}


def test_a_refused_replica_is_named_with_its_node_rank_step_and_the_newest_own_step():
    got = choose({"a": [0], "b": [1]}, {"a": [rep(10**9, 0, REPLICA, "/shm/a/replicas/r0"), rep(3, 0)],
                                        "b": [rep(3, 1), rep(2, 1, REPLICA)]}, 2, "a")
    assert got.step == 3
    assert got.refused == ("the replica of rank 0 step 1000000000 on node a (/shm/a/replicas/r0): no node's own "
                           "snapshot is that new (newest: step 3)",)
    assert choose({"a": [0]}, {"a": [rep(3, 0)]}, 1, "a").refused == ()


def test_the_locator_is_the_held_entrys():
    got = choose({"a": [0]}, {"a": [rep(1, 0, SLOT, "/dev/shm/x/slots/0.1")]}, 1, "a")
    source = Source("a", SLOT, "/dev/shm/x/slots/0.1")
    assert got == Plan(1, {0: source}, {0: source})


@pytest.mark.parametrize("ranks, ws", [({"a": [0], "b": [0]}, 1), ({"a": [0, 2]}, 2), ({"a": [0]}, 2)])
def test_ranks_that_do_not_cover_the_world_are_a_value_error(ranks, ws):
    with pytest.raises(ValueError, match="rank"):
        choose(ranks, {}, ws, "a")


def _info(path, step, rank, ws=2, replicated=True):
    return SlotInfo(path, 2, step, rank, ws, replicated, 10, 20, 1.0)


def test_inventory_doc_round_trips_through_json():
    infos = [_info("/dev/shm/d/slots/0.1", 7, 0), _info("/dev/shm/d/replicas/r3", 6, 3, 4, False)]
    persisted = (5, {0: "/ck/step_000000000005/rank_0_of_4.pt", 1: "/ck/step_000000000005/rank_1_of_4.pt"}, False)
    doc = json.loads(json.dumps(plan.inventory_doc(infos, persisted, "10.0.0.2:4000", shared=True)))
    assert plan.addr_from_doc(doc) == "10.0.0.2:4000"
    assert plan.held_from_doc(doc) == [
        Held(7, 0, 2, True, SLOT, "/dev/shm/d/slots/0.1"),
        Held(6, 3, 4, False, REPLICA, "/dev/shm/d/replicas/r3"),
        Held(5, 0, 4, False, DISK, "/ck/step_000000000005/rank_0_of_4.pt", True),
        Held(5, 1, 4, False, DISK, "/ck/step_000000000005/rank_1_of_4.pt", True),
    ]
    assert plan.held_from_doc(plan.inventory_doc([], None, "")) == []


def test_a_reshardable_part_and_a_dcp_directory_round_trip_through_json():
    infos = [SlotInfo("/dev/shm/d/slots/0.1", 2, 7, 0, 4, False, 10, 20, 1.0, True)]
    doc = json.loads(json.dumps(plan.inventory_doc(infos, None, "h:1", dcp=(6, "/ck/dcp/step_000000000006"))))
    assert doc["v"] == plan.DOC_VERSION == 2
    assert plan.held_from_doc(doc) == [Held(7, 0, 4, False, SLOT, "/dev/shm/d/slots/0.1", False, True),
                                       Held(6, 0, 0, False, DISK, "/ck/dcp/step_000000000006", False, True)]


def test_an_older_document_of_seven_field_entries_is_read_as_not_reshardable():
    old = {"v": 1, "addr": "h:1", "held": [[7, 0, 2, False, "slot", "/a/slots/0.0", False]]}
    assert plan.held_from_doc(old) == [Held(7, 0, 2, False, SLOT, "/a/slots/0.0", False, False)]
    assert plan.held_from_doc({"v": 1, "held": [[7, 0, 2, False, "slot", "/a", False, True]]}) == []


@pytest.mark.parametrize("doc", [None, [], {"v": 3, "held": [[1, 0, 2, True, "slot", "p", False]]}, {"v": 1},
                                 {"v": 1, "held": "x"}, {"v": 2, "held": [[1, 0, 2, True, "slot", "p", False, 1]]},
                                 {"v": 1, "held": [[1, 0, 2, True, "cloud", "p", False]]},
                                 {"v": 1, "held": [[1.5, 0, 2, True, "slot", "p", False]]},
                                 {"v": 1, "held": [[1, 0, 2, True, "slot", "p"]]}])
def test_malformed_documents_hold_nothing(doc):
    assert plan.held_from_doc(doc) == []
    assert plan.addr_from_doc(doc) == ""


def test_the_plan_imports_no_torch():
    code = "import sys, elaunch.checkpoint.plan; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_newer_step_some_rank_had_not_committed_is_named_at_info_with_the_step_restored():
    # a node replaced during the save of step 26: ranks 2, 3 died before committing it; step 25 is whole
    held = {"a": [part(26, 0, 4), part(26, 1, 4), part(25, 0, 4), part(25, 1, 4),
                  part(25, 2, 4, REPLICA), part(25, 3, 4, REPLICA)], "new": []}
    got = choose({"a": [0, 1], "new": [2, 3]}, held, 4, "new")
    assert got.step == 25 and got.partial
    assert "reshardable step 26 of world size 4: the part of saved rank(s) 2, 3 is in no node's memory" in got.reason
    level, line = plan_reason_line(got)
    assert level == logging.INFO
    assert line.startswith("checkpoint restore: step 25 restored, not a newer one: reshardable step 26")


def test_a_step_blocked_by_its_world_size_or_no_step_at_all_is_a_warning():
    older = choose({"a": [0, 1]}, {"a": [shard(9, r, 4) for r in range(4)] + [shard(3, 0, 2), shard(3, 1, 2)]},
                   2, "a")
    assert older.step == 3 and not older.partial
    assert plan_reason_line(older) == (logging.WARNING, f"checkpoint restore: {older.reason}; step 3 restored")
    fresh = choose({"a": [0, 1]}, {"a": [part(5, 0, 4), part(5, 1, 4), part(5, 3, 4, REPLICA)]}, 2, "a")
    assert fresh.step is None and fresh.partial  # the newest step lacks a part, and none is older
    level, line = plan_reason_line(fresh)
    assert level == logging.WARNING and line.endswith("; the workers start fresh")
