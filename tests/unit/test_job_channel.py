"""The job channel seam: the agent's JobView over the in-memory and local channels, and who hands out which.

Pure logic: no processes, no stores. The in-memory channel scripts the job's facts
as data; the local one is what static, standalone and plugin handlers hand out.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from elaunch.agent.decide import Step, Verdict
from elaunch.agent.job import JobView
from elaunch.agent.published import publish
from elaunch.rendezvous.api import FailureRecord, JobState, NodeInfo
from elaunch.rendezvous.dynamic.handler import DynamicRendezvousHandler
from elaunch.rendezvous.dynamic.settings import RendezvousSettings
from elaunch.rendezvous.job_channel import InMemoryJobChannel, JobChannel, LocalJobChannel
from elaunch.rendezvous.standalone import StandaloneRendezvous
from elaunch.spec import WorkerState
from tests.unit.fakes import FakeRoundStores, InMemoryBackend

PACKAGE = Path(__file__).resolve().parents[2] / "elaunch"


class _Handler(StandaloneRendezvous):
    """A standalone handler handing out a given channel (the agent only sees the interface)."""

    def __init__(self, channel: JobChannel) -> None:
        super().__init__("job-channel-test", NodeInfo("127.0.0.1"))
        self._channel = channel

    def job_channel(self) -> JobChannel:
        return self._channel


def _rec(round: int, rank: int = 0) -> FailureRecord:
    return FailureRecord(round=round, at=1.0 + round, host="h", rank=rank, exitcode=3)


def test_handlers_without_job_state_hand_out_the_local_channel():
    channel = StandaloneRendezvous("r", NodeInfo("127.0.0.1")).job_channel()
    assert isinstance(channel, LocalJobChannel) and not channel.keeps_job_state
    assert channel.node_id is None and channel.round_members == frozenset()
    assert channel.state() is None and channel.record_failure(_rec(0)) is None
    assert channel.fail_job(_rec(0)) == _rec(0)
    assert (channel.num_nodes_lost(), channel.num_nodes_new(), channel.request_stack_dump(_rec(0))) == (0, 0, 0)
    assert publish(channel, "agent", {"pid": 1}) is None  # nothing to publish to: no thread


def test_the_dynamic_handler_hands_out_one_channel_named_after_its_node():
    h = DynamicRendezvousHandler(NodeInfo("127.0.0.1"), RendezvousSettings("r", 1, 1), InMemoryBackend(),
                                 FakeRoundStores())
    assert h.job_channel() is h.job_channel() and h.job_channel().keeps_job_state
    assert h.job_channel().node_id == h.node_id and h.can_reform


@pytest.mark.parametrize("max_restarts, step, used", [(1, Step.RESTART, 1), (0, Step.FINISH_FAILED, 0)])
def test_jobview_counts_a_failure_once_through_the_channel(max_restarts, step, used):
    channel = InMemoryJobChannel()
    view = JobView(_Handler(channel), max_restarts)
    got = view.decide(Verdict.FAILED, _rec(0))
    assert (got[0], view.restarts, view.left) == (step, used, max_restarts - used) and channel.job.restarts == 1
    assert channel.job.failed is (step is Step.FINISH_FAILED)


def test_jobview_counts_alone_without_job_state_and_decides_other_stops_on_its_budget():
    view = JobView(StandaloneRendezvous("r", NodeInfo("127.0.0.1")), 1)
    assert view.decide(Verdict.FAILED, _rec(0)) == (Step.RESTART, _rec(0)) and (view.restarts, view.left) == (1, 0)
    view.joined(None)  # a round without the job's count keeps the agent's own
    assert view.decide(Verdict.FAILED, _rec(1)) == (Step.FINISH_FAILED, _rec(1)) and view.restarts == 1
    assert view.decide(Verdict.FAILED, None, fixable=False)[0] is Step.FAIL_AT_ONCE
    assert [view.decide(v)[0] for v in (Verdict.SUCCEEDED, Verdict.MEMBERSHIP_CHANGE, Verdict.JOB_FAILED)] == [
        Step.FINISH_OK, Step.REJOIN, Step.FINISH_FAILED]
    assert view.restarts == 1


def test_jobview_rejoins_uncounted_when_a_lost_member_caused_the_failure():
    channel = InMemoryJobChannel()
    channel.lost = ("b",)
    view = JobView(_Handler(channel), 3)
    assert view.decide(Verdict.FAILED, _rec(0))[0] is Step.REJOIN
    assert channel.job.restarts == view.restarts == 0


def test_jobview_acknowledges_a_job_failed_elsewhere():
    channel = InMemoryJobChannel(job=JobState(failed=True, closed=True, failure=_rec(2, rank=5)))
    step, root = JobView(_Handler(channel), 3).decide(Verdict.FAILED, _rec(2))
    assert (step, root.rank) == (Step.FINISH_FAILED, 5) and channel.calls[-1] == "acknowledge_failure"


def test_jobview_publishes_success_and_reads_the_channel():
    channel = InMemoryJobChannel()
    view = JobView(_Handler(channel), 0)
    view.succeed()
    assert view.read().succeeded and view.state.node == "node0"
    view.joined(1)
    result = view.failed_elsewhere(_rec(0, rank=2))
    assert result.state is WorkerState.FAILED and result.root_rank == 2 and result.restarts == 1


def test_no_capability_is_probed_with_getattr_on_a_handler_or_backend():
    probes = []
    for path in [*PACKAGE.joinpath("agent").glob("*.py"), *PACKAGE.joinpath("rendezvous").rglob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
                    and ast.unparse(node.args[0]) in ("self._rdzv", "rdzv", "self._backend", "backend")):
                probes.append(f"{path.name}:{node.lineno}")
    assert probes == []
