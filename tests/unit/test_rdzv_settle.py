"""The adaptive last call's settings (``settle_timeout``) and its field in the state's JSON."""

from __future__ import annotations

import json

import pytest

from elaunch.rendezvous.contract import RendezvousConfigError, RendezvousParameters
from elaunch.rendezvous.dynamic.settings import DEFAULT_SETTLE_TIMEOUT, RendezvousSettings
from elaunch.rendezvous.dynamic.state import RendezvousState


def params(**conf) -> RendezvousParameters:
    return RendezvousParameters("c10d", "localhost:29400", "job", 1, 2, config={k: str(v) for k, v in conf.items()})


@pytest.mark.parametrize(
    "conf,settle,last_call",
    [
        ({}, DEFAULT_SETTLE_TIMEOUT, 30.0),
        ({"settle_timeout": "2.5"}, 2.5, 30.0),
        ({"last_call_timeout": "30"}, None, 30.0),  # explicit last call: torch's fixed deadline
        ({"last_call_timeout": "10", "settle_timeout": "0.5"}, 0.5, 10.0),  # both: window capped
    ],
    ids=["default", "settle only", "last call only", "both"],
)
def test_settle_timeout_from_conf(conf, settle, last_call):
    s = RendezvousSettings.from_params(params(**conf))
    assert (s.settle_timeout, s.last_call_timeout) == (settle, last_call)


@pytest.mark.parametrize("value", ["0", "-1", "soon"])
def test_bad_settle_timeout_names_the_value(value):
    with pytest.raises(RendezvousConfigError, match=f"settle_timeout={value}"):
        RendezvousSettings.from_params(params(settle_timeout=value))


def test_hard_deadline_round_trips():
    state = RendezvousState(deadline=5.0, participants={"a": -1}, last_call_deadline=30.5)
    data = state.to_bytes()
    assert json.loads(data)["last_call_deadline"] == 30.5
    assert RendezvousState.from_bytes(data) == state


def test_state_without_hard_deadline_still_decodes():
    doc = json.loads(RendezvousState(deadline=5.0).to_bytes())
    del doc["last_call_deadline"]
    state = RendezvousState.from_bytes(json.dumps(doc))
    assert state.deadline == 5.0 and state.last_call_deadline is None


def test_handler_completes_a_partial_world_after_the_settle_window():
    """1:2 nodes, one present: the round completes after the quiet window, not the 60 s last call."""
    from elaunch.rendezvous.contract import NodeInfo
    from elaunch.rendezvous.dynamic.handler import DynamicRendezvousHandler
    from tests.unit.fakes import FakeRoundStores, InMemoryBackend

    s = RendezvousSettings("job", 1, 2, join_timeout=10, last_call_timeout=60, settle_timeout=0.2, poll_interval=0.02)
    h = DynamicRendezvousHandler(NodeInfo("a", "default", 1), s, InMemoryBackend(), FakeRoundStores())
    try:
        info = h.next_rendezvous()  # with torch's fixed last call this would time out (join_timeout 10 < 60)
        assert (info.rank, info.world_size) == (0, 1)
    finally:
        h._stop_heartbeats()
