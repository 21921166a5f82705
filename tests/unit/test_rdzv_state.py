"""The rendezvous state's JSON encoding and settings parsing."""

from __future__ import annotations

import json

import pytest

from elaunch.rendezvous.api import NodeInfo, RendezvousConfigError, RendezvousParameters, RendezvousStateError
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
    assert json.loads(data)["participants"] == {"a": 1, "b": 0}  # plain JSON, not pickle
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


@pytest.mark.parametrize("data, says", [
    (_edited(participants={"a": 1, "b": "0"}), "integer ranks"),
    (_edited(participants={"a": 1, "b": True}), "integer ranks"),
    (_edited(last_heartbeats={"a": "1.5"}), "expected a number"),
    (_edited(node_infos={"a": ["10.0.0.1", "trainer"]}), r"\[addr, role, local_world_size\]"),
    (_edited(node_infos={"a": ["10.0.0.1", "trainer", "4"]}), r"\[addr, role, local_world_size\]"),
])
def test_bad_node_tables_are_named(data, says):
    with pytest.raises(RendezvousStateError, match=says):
        RendezvousState.from_bytes(data)


def test_a_state_of_the_previous_layout_is_refused_naming_both_versions():
    # an agent of an older elaunch (node_infos as objects) must fail clearly, not misread
    old = _edited(version=1, node_infos={"a": {"addr": "10.0.0.1", "role": "trainer", "local_world_size": 4}})
    with pytest.raises(RendezvousStateError, match="state version 1, expected 2"):
        RendezvousState.from_bytes(old)


def test_integer_heartbeats_read_as_seconds():
    assert RendezvousState.from_bytes(_edited(last_heartbeats={"a": 2})).last_heartbeats == {"a": 2.0}


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
