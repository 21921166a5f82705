"""The rendezvous state's JSON encoding and settings parsing."""

from __future__ import annotations

import gc
import json

import pytest

from elaunch.rendezvous.contract import NodeInfo, RendezvousConfigError, RendezvousParameters, RendezvousStateError
from elaunch.rendezvous.dynamic.settings import RendezvousSettings
from elaunch.rendezvous.dynamic.state import RendezvousState


def full_state() -> RendezvousState:
    return RendezvousState(
        round=3, complete=True, deadline=12.5, closed=False,
        participants={"b": 0, "a": 1},
        node_infos={"a": NodeInfo("10.0.0.1", "trainer", 4),
                    "b": NodeInfo("10.0.0.2", "trainer", 2),
                    "c": NodeInfo("10.0.0.3", "default", 1)},
        wait_list={"c"}, redundancy_list=set(), last_heartbeats={"a": 1.5, "b": 2.0, "c": 3.0},
    )


def test_round_trip_is_exact_and_json():
    state = full_state()
    data = state.to_bytes()
    nodes = json.loads(data)["nodes"]  # plain JSON, not pickle: one column table, each id once
    assert nodes["id"] == ["a", "b", "c"] and nodes["rank"] == [1, 0, None] and nodes["size"] == [4, 2, 1]
    assert data.count(b'"a"') == 1
    assert RendezvousState.from_bytes(data) == state
    assert RendezvousState.from_bytes(data).to_bytes() == data


def test_ranked_nodes_follow_group_rank():
    assert full_state().ranked_nodes() == (NodeInfo("10.0.0.2", "trainer", 2), NodeInfo("10.0.0.1", "trainer", 4))


@pytest.mark.parametrize("data", [
    b"\x80\x04pickle", b"[]", b'{"version": 99}',
    RendezvousState().to_bytes().replace(b'"round":0', b'"round":"zero"'),
    RendezvousState().to_bytes().replace(b'"wait_list":[]', b'"wait_list":{}'),
    RendezvousState().to_bytes().replace(b',"round":0', b''),
])
def test_corrupt_state_raises_state_error(data):
    with pytest.raises(RendezvousStateError, match="corrupt rendezvous state"):
        RendezvousState.from_bytes(data)


def _edited(**fields) -> bytes:
    doc = json.loads(full_state().to_bytes())
    doc.update(fields)
    return json.dumps(doc).encode()


def _columns(**columns) -> bytes:
    """full_state()'s bytes with some columns of its node table (ids a, b, c) replaced."""
    doc = json.loads(full_state().to_bytes())
    doc["nodes"].update(columns)
    return json.dumps(doc).encode()


@pytest.mark.parametrize("data, says", [
    (_columns(rank=[1, "0", None]), "integer ranks"),
    (_columns(rank=[1, True, None]), "integer ranks"),
    (_columns(beat=["1.5", 2.0, 3.0]), "expected a number"),
    (_columns(size=[4, 2, "1"]), r"\[addr, role, local_world_size\] .* for 'c'"),
    (_columns(role=["trainer", None, "default"]), r"\[addr, role, local_world_size\] .* for 'b'"),
    (_columns(addr=["10.0.0.1", "10.0.0.2"]), r"columns \['addr'\] do not have one entry per id \(3\)"),
    (_columns(id=["a", "a", "c"]), "distinct strings"),
    (_edited(nodes=[]), "expected an object"),
])
def test_bad_node_tables_are_named(data, says):
    with pytest.raises(RendezvousStateError, match=says):
        RendezvousState.from_bytes(data)


def test_a_state_of_the_previous_layout_is_refused_naming_both_versions():
    # an agent of an older elaunch (per-node objects keyed by id) must fail clearly, not misread
    old = _edited(version=2, node_infos={"a": ["10.0.0.1", "trainer", 4]}, participants={"a": 0})
    with pytest.raises(RendezvousStateError, match="state version 2, expected 3"):
        RendezvousState.from_bytes(old)


def test_integer_heartbeats_read_as_seconds():
    beats = RendezvousState.from_bytes(_columns(beat=[2, 2.5, None])).last_heartbeats
    assert beats == {"a": 2.0, "b": 2.5} and type(beats["a"]) is float


def test_decoded_node_rows_are_left_untracked_by_the_garbage_collector():
    # every agent holds a decoded state while it waits: at 1024 nodes, rows the collector
    # tracks (NodeInfo, a tuple subclass, is never untracked) made it ~40% of a round
    state = RendezvousState.from_bytes(full_state().to_bytes())
    gc.collect()
    assert state.node_infos and not any(gc.is_tracked(row) for row in state.node_infos.values())
    assert all(type(n) is NodeInfo for n in state.ranked_nodes())


def test_nodes_in_only_some_tables_round_trip():
    # a heartbeat without info or rank, info without a heartbeat, a participant with neither
    state = RendezvousState(participants={"p": 0}, node_infos={"i": NodeInfo("10.0.0.9", "x", 3)},
                            last_heartbeats={"h": 4.0})
    back = RendezvousState.from_bytes(state.to_bytes())
    assert back == state
    assert (back.participants, back.node_infos, back.last_heartbeats) == (
        {"p": 0}, {"i": NodeInfo("10.0.0.9", "x", 3)}, {"h": 4.0})


def test_ranked_nodes_refuse_ranks_that_are_not_a_permutation():
    state = full_state()
    state.participants = {"a": 1, "b": 1}
    with pytest.raises(RendezvousStateError, match="ranks participant"):
        state.ranked_nodes()


def params(**conf) -> RendezvousParameters:
    return RendezvousParameters("c10d", "localhost:29400", "job", 1, 2, config={k: str(v) for k, v in conf.items()})


def test_settings_defaults_mirror_torch():
    s = RendezvousSettings.from_params(params())
    assert (s.join_timeout, s.last_call_timeout, s.close_timeout, s.heartbeat_timeout) == (600, 30, 30, 5)
    assert (s.keep_alive_interval, s.keep_alive_max_attempt, s.dead_after) == (5, 3, 15)


def test_settings_read_conf_in_seconds():
    s = RendezvousSettings.from_params(params(join_timeout=2.5, last_call_timeout=0.5, keep_alive_interval=1,
                                              keep_alive_max_attempt=2))
    assert (s.join_timeout, s.last_call_timeout, s.dead_after) == (2.5, 0.5, 2.0)


@pytest.mark.parametrize("conf,needle", [
    ({"join_timeout": "soon"}, "join_timeout=soon"),
    ({"last_call_timeout": "-1"}, "last_call_timeout=-1"),
    ({"keep_alive_max_attempt": "0"}, "keep_alive_max_attempt=0"),
])
def test_bad_conf_names_the_value(conf, needle):
    with pytest.raises(RendezvousConfigError, match=needle):
        RendezvousSettings.from_params(params(**conf))


def test_bad_node_range_names_it():
    with pytest.raises(RendezvousConfigError, match="--nnodes=3:2"):
        RendezvousSettings("job", 3, 2)


@pytest.mark.parametrize("conf,lost,beat", [
    ({}, 3.0, 0.375),  # elaunch's default (every backend): a running member is lost after 3 s, beats every 0.375 s
    ({"keep_alive_interval": 1}, 3.0, 1.0),  # a torch key keeps torch's rule: 1 x 3
    ({"keep_alive_max_attempt": 4}, 20.0, 5.0),  # 5 x 4
    ({"lost_after": 6}, 6.0, 0.75),  # explicit
    ({"lost_after": 2, "keep_alive_interval": 1}, 2.0, 0.25),  # lost_after is the more specific key
])
def test_lost_after_is_elaunchs_rule_unless_a_torch_keep_alive_key_is_given(conf, lost, beat):
    s = RendezvousSettings.from_params(params(**conf))
    assert (s.member_lost_after, s.heartbeat_interval) == (lost, beat)
    assert s.dead_after == s.keep_alive_interval * s.keep_alive_max_attempt  # joining nodes: always torch's


def test_a_bad_lost_after_names_the_key():
    with pytest.raises(RendezvousConfigError, match="lost_after=soon"):
        RendezvousSettings.from_params(params(lost_after="soon"))
