"""Job-wide supervision as tables: job_ops.py over the rendezvous state, the agent's new decisions,
failure records to and from the rendezvous, the state's new JSON fields and the summary's root cause.

No processes, no backend: every function here is pure.
"""

from __future__ import annotations

import json
import re

import pytest

from elaunch.agent.decide import (EXIT_GRACE_MIN, Step, Verdict, exit_grace, hang_suspects, hung_ranks, judge,
                                  next_step, sits_out)
from elaunch.agent.failures import from_record, to_record, with_root
from elaunch.errors.summary import failure_text, format_failure_summary
from elaunch.rendezvous.contract import MAX_FAILURE_MESSAGE, FailureRecord, JobState, RendezvousStateError
from elaunch.rendezvous.dynamic import job_ops
from elaunch.rendezvous.dynamic.settings import RendezvousSettings
from elaunch.rendezvous.dynamic.state import RendezvousState
from elaunch.spec import ProcessFailure

REMOTE = " (reported by that node's agent through the rendezvous)"


def rec(round: int, at: float, node: str, rank: int = 0) -> FailureRecord:
    """A failure of ``rank`` in ``round`` at ``at``, published by ``node``."""
    return FailureRecord(round=round, at=at, node=node, host=f"host-{node}", rank=rank, local_rank=rank,
                         pid=1000 + rank, exitcode=1, message=f"boom on {node}")


def state(restarts: int = 0, root: FailureRecord | None = None, failed: bool = False,
          blame: list[str] | tuple[str, ...] = (), acks: list[str] | tuple[str, ...] = ()) -> RendezvousState:
    return RendezvousState(restarts=restarts, failure=None if root is None else root.to_dict(),
                           job_failed=failed, closed=failed, blame=list(blame), failure_acks=list(acks))


def key(record_doc: dict | None):
    """(round, at, node) of a stored record: what the tables compare."""
    return None if record_doc is None else (record_doc["round"], record_doc["at"], record_doc["node"])


# ---------------------------------------------------------------- job_ops.count_failure

A0 = rec(0, 10.0, "a")
A1 = rec(1, 10.0, "a")

FULL_BLAME = [f"n{i}" for i in range(job_ops.BLAME_KEPT)]


@pytest.mark.parametrize(
    "before, report, expected",
    [
        # the first failure of a round counts one restart and is the root cause
        (state(), rec(0, 10.0, "a"), (1, (0, 10.0, "a"), ["a"])),
        (state(3, A0, blame=["a"]), rec(2, 30.0, "b"), (4, (2, 30.0, "b"), ["a", "b"])),
        # a second report of the same round does not count again (only its node is noted) ...
        (state(1, A0, blame=["a"]), rec(0, 11.0, "b"), (1, (0, 10.0, "a"), ["a"])),
        (state(1, A0, blame=["a"]), rec(0, 10.0, "b"), (1, (0, 10.0, "a"), ["a"])),  # a tie keeps the first
        # ... and replaces the root cause only when it happened earlier
        (state(1, A0, blame=["a"]), rec(0, 9.5, "b"), (1, (0, 9.5, "b"), ["b"])),
        (state(2, A0, blame=["x", "a"]), rec(0, 9.5, "b"), (2, (0, 9.5, "b"), ["x", "b"])),
        # a report of an older round changes nothing, even an earlier one
        (state(2, A1, blame=["a", "a"]), rec(0, 1.0, "b"), None),
        # nothing after the job failed
        (state(1, A0, failed=True, blame=["a"]), rec(1, 20.0, "b"), None),
        (state(1, A0, failed=True, blame=["a"]), rec(0, 1.0, "b"), None),
        (state(0, None, failed=True), rec(0, 1.0, "b"), None),
        # blame keeps the latest BLAME_KEPT root causes
        (state(16, rec(15, 1.0, "n15"), blame=FULL_BLAME), rec(16, 2.0, "z"), (17, (16, 2.0, "z"), FULL_BLAME[1:] + ["z"])),
    ],
)
def test_count_failure(before, report, expected):
    snapshot = before.to_bytes()
    after = job_ops.count_failure(before, report)
    assert before.to_bytes() == snapshot  # decides on a copy
    if expected is None:
        assert after is None
        return
    restarts, root, blame = expected
    assert (after.restarts, key(after.failure), after.blame) == (restarts, root, blame)
    assert after.job_failed is False and after.closed is False
    assert after.counted and report.node in after.reported


def test_count_failure_stores_the_whole_record():
    report = FailureRecord(round=4, at=12.25, node="b", host="h2", rank=7, local_rank=3, pid=99, exitcode=-9,
                           message="x" * (MAX_FAILURE_MESSAGE + 10) + "END", hung=True)
    after = job_ops.count_failure(state(), report)
    stored = FailureRecord.from_dict(after.failure)
    assert len(stored.message) == MAX_FAILURE_MESSAGE and stored.message.endswith("END")
    assert "[... cut ...]" in stored.message  # head and tail kept, the middle cut
    assert stored == FailureRecord(round=4, at=12.25, node="b", host="h2", rank=7, local_rank=3, pid=99,
                                   exitcode=-9, message=stored.message, hung=True)


def test_count_failure_twice_counts_once():
    once = job_ops.count_failure(state(), rec(0, 10.0, "a"))
    assert job_ops.count_failure(once, rec(0, 10.0, "a")) is None
    assert once.restarts == 1


def test_count_failure_refuses_a_corrupt_root_cause():
    bad = RendezvousState(restarts=1, failure={"round": "zero", "at": 1.0})
    with pytest.raises(RendezvousStateError, match="corrupt failure record"):
        job_ops.count_failure(bad, rec(0, 1.0, "a"))


# ---------------------------------------------------------------- job_ops.note_failure / count_round

def test_a_noted_failure_is_not_counted_until_the_round_is():
    noted = job_ops.note_failure(state(2, A0, blame=["a"]), rec(1, 20.0, "b"), probe_at=20.5)
    assert (noted.restarts, key(noted.failure), noted.counted, noted.reported) == (2, (1, 20.0, "b"), False, ["b"])
    assert noted.probe_at == 20.5 and noted.blame == ["a"]  # no blame before it counts
    # a peer's report of the same round: its node is noted, an earlier one becomes the root cause
    peer = job_ops.note_failure(noted, rec(1, 19.0, "c"))
    assert (key(peer.failure), peer.counted, peer.reported, peer.blame) == ((1, 19.0, "c"), False, ["b", "c"], ["a"])
    assert job_ops.note_failure(peer, rec(1, 25.0, "c")) is None  # nothing new
    counted = job_ops.count_round(peer, 1)
    assert (counted.restarts, counted.counted, counted.blame) == (3, True, ["a", "c"])
    assert job_ops.count_round(counted, 1) is None  # once per round, whoever counts it
    assert job_ops.count_round(peer, 0) is None  # not the latest failed round


def test_a_probe_never_moves_back():
    s = RendezvousState(probe_at=30.0)
    assert job_ops.note_failure(s, rec(0, 1.0, "a"), probe_at=25.0).probe_at == 30.0


def test_an_uncounted_round_stays_uncounted_when_the_next_fails():
    lost = job_ops.note_failure(state(1, A0, blame=["a"]), rec(1, 20.0, "b"))  # round 1: a node loss, never counted
    nxt = job_ops.count_failure(lost, rec(2, 30.0, "c"))
    assert (nxt.restarts, key(nxt.failure), nxt.blame, nxt.reported) == (2, (2, 30.0, "c"), ["a", "c"], ["c"])


def test_states_without_the_count_fields_read_as_counted():
    doc = json.loads(state(1, A0).to_bytes())
    del doc["counted"], doc["reported"]
    old = RendezvousState.from_bytes(json.dumps(doc))
    assert old.counted is True and old.reported == []
    assert job_ops.count_round(old, 0) is None


def members(round: int = 3, **kw) -> RendezvousState:
    """Round ``round`` of a, b, c, d whose failure a reported."""
    s = RendezvousState(round=round, complete=True, participants={"a": 0, "b": 1, "c": 2, "d": 3},
                        failure=rec(3, 10.0, "a").to_dict(), counted=False, reported=["a"],
                        last_heartbeats={"a": 10.0, "b": 9.0, "c": 9.0, "d": 9.0})
    for k, v in kw.items():
        setattr(s, k, v)
    return s


@pytest.mark.parametrize(
    "s, dead, alive, lost",
    [
        (members(), set(), set(), set()),  # nobody answered yet
        (members(reported=["a", "b"]), set(), {"b"}, set()),  # b reported the round too
        (members(last_heartbeats={"b": 9.0, "c": 10.0, "d": 10.5}), set(), {"c", "d"}, set()),  # beats since
        (members(wait_list={"b"}), set(), {"b"}, set()),  # b waits for the next round
        (members(round=4, participants={"b": 0}), set(), {"b"}, set()),  # b joined the next round
        (members(participants={"a": 0, "b": 1, "c": 2}), set(), set(), {"d"}),  # d left the round
        (members(), {"c"}, set(), {"c"}),  # c did not answer the probe
        (members(failure_acks=["d"]), set(), {"d"}, set()),
        # another round's reporters say nothing about this one
        (members(failure=rec(4, 12.0, "b").to_dict(), reported=["b"]), set(), set(), set()),
    ],
)
def test_answers_after_a_failure(s, dead, alive, lost):
    assert job_ops.answers(s, 3, frozenset({"b", "c", "d"}), 10.0, dead) == (alive, lost)


# ---------------------------------------------------------------- job_ops.fail_job


@pytest.mark.parametrize(
    "before, report, root",
    [
        (state(), rec(0, 10.0, "a"), (0, 10.0, "a")),
        # the earliest root cause of the latest failed round is kept
        (state(1, A0, blame=["a"]), rec(0, 12.0, "b"), (0, 10.0, "a")),
        (state(1, A0, blame=["a"]), rec(0, 10.0, "b"), (0, 10.0, "a")),
        (state(1, A0, blame=["a"]), rec(0, 8.0, "b"), (0, 8.0, "b")),
        (state(1, A0, blame=["a"]), rec(1, 20.0, "b"), (1, 20.0, "b")),
        (state(2, rec(2, 10.0, "a"), blame=["a"]), rec(1, 5.0, "b"), (2, 10.0, "a")),
    ],
)
def test_fail_job_keeps_the_earliest_root_cause_of_the_latest_round_and_closes(before, report, root):
    after = job_ops.fail_job(before, report)
    assert key(after.failure) == root
    assert (after.job_failed, after.closed) == (True, True)
    # declaring is not counting
    assert (after.restarts, after.blame) == (before.restarts, before.blame)
    assert (before.job_failed, before.closed) == (False, False)


def test_fail_job_once():
    failed = job_ops.fail_job(state(1, A0), rec(0, 1.0, "b"))
    assert job_ops.fail_job(failed, rec(0, 0.5, "c")) is None
    assert key(failed.failure) == (0, 1.0, "b")


# ---------------------------------------------------------------- acknowledgements


@pytest.mark.parametrize(
    "before, node, acks",
    [
        (state(), "a", None),  # nothing to acknowledge: the job did not fail
        (state(failed=True), "a", ["a"]),
        (state(failed=True, acks=["a"]), "a", None),
        (state(failed=True, acks=["a"]), "b", ["a", "b"]),
    ],
)
def test_acknowledge_failure(before, node, acks):
    after = job_ops.acknowledge_failure(before, node)
    assert (after.failure_acks if after is not None else None) == acks


def test_acknowledge_failure_is_idempotent():
    once = job_ops.acknowledge_failure(state(failed=True), "b")
    assert job_ops.acknowledge_failure(once, "b") is None
    assert once.failure_acks == ["b"]


def acks_state(heartbeats=("a", "b", "c"), participants=(), waiting=(), acks=(), spares=(), out=(),
               succeeded=False) -> RendezvousState:
    return RendezvousState(job_failed=not succeeded, job_succeeded=succeeded, closed=True,
                           last_heartbeats={n: 1.0 for n in heartbeats},
                           participants={n: i for i, n in enumerate(participants)}, wait_list=set(waiting),
                           redundancy_list=set(spares), sitting_out=set(out), failure_acks=list(acks))


@pytest.mark.parametrize(
    "st, members, dead, pending",
    [
        (acks_state(), {"a", "b", "c"}, set(), ["b", "c"]),  # never self ("a")
        (acks_state(acks=["c"]), {"a", "b", "c"}, set(), ["b"]),
        (acks_state(acks=["b", "c"]), {"a", "b", "c"}, set(), []),
        (acks_state(), {"a", "b", "c"}, {"c"}, ["b"]),  # the dead never acknowledge
        (acks_state(acks=["b"]), {"a", "b", "c"}, {"c"}, []),
        # a waiting node must see the verdict too
        (acks_state(heartbeats=("a", "b", "d"), waiting=("d",)), {"a", "b"}, set(), ["b", "d"]),
        # a member gone from the state (no heartbeat, not a participant) has left
        (acks_state(heartbeats=("a",)), {"a", "b"}, set(), []),
        (acks_state(heartbeats=("a",), participants=("a", "b")), {"a", "b"}, set(), ["b"]),
        (acks_state(acks=["a"]), {"a"}, set(), []),
        # spares and nodes sitting out must see the verdict too
        (acks_state(heartbeats=("a", "b", "s", "o"), spares=("s",), out=("o",)), {"a", "b"}, set(), ["b", "o", "s"]),
        (acks_state(heartbeats=("a", "s", "o"), spares=("s",), out=("o",), acks=["o"]), {"a"}, {"s"}, []),
        # after a success, only the nodes outside the round (it passed the exit barrier) ...
        (acks_state(heartbeats=("a", "b", "w", "o"), waiting=("w",), out=("o",), succeeded=True), {"a", "b"},
         set(), ["o", "w"]),
        # ... and a watcher that saw it left the state
        (acks_state(heartbeats=("a", "b"), succeeded=True), {"a", "b"}, set(), []),
    ],
)
def test_unacknowledged(st, members, dead, pending):
    assert job_ops.unacknowledged(st, frozenset(members), "a", dead) == pending


# ---------------------------------------------------------------- the job's success, sitting out


@pytest.mark.parametrize(
    "before, written",
    [
        (RendezvousState(), True),
        (RendezvousState(closed=True), True),  # closed by a node on its way out: the verdict is still news
        (state(failed=True), False),  # a failed job stays failed
        (RendezvousState(job_succeeded=True, closed=True), False),
    ],
)
def test_succeed_job(before, written):
    after = job_ops.succeed_job(before)
    assert (after is not None) == written
    if after is not None:
        assert after.job_succeeded and after.closed and not after.job_failed


def test_sit_out_leaves_the_round_and_keeps_a_heartbeat():
    s = RendezvousSettings(run_id="r", min_nodes=1, max_nodes=2)
    before = RendezvousState(round=3, complete=True, participants={"a": 0, "b": 1},
                             node_infos={"a": ("ha", "r", 1), "b": ("hb", "r", 1)},
                             last_heartbeats={"a": 1.0, "b": 1.0})
    after = job_ops.sit_out(before, "b", 5.0, s)
    assert after.participants == {"a": 0} and after.sitting_out == {"b"}
    assert after.last_heartbeats == {"a": 1.0, "b": 5.0} and "b" not in after.node_infos
    assert job_ops.sit_out(after, "b", 6.0, s) is None  # sits out already
    alone = job_ops.sit_out(job_ops.sit_out(after, "a", 5.0, s), "a", 5.0, s)
    assert alone is None  # a sits out too, once
    # the last member out: the next round opens, as when it leaves
    emptied = job_ops.sit_out(after, "a", 5.0, s)
    assert (emptied.round, emptied.complete, emptied.sitting_out) == (4, False, {"a", "b"})
    assert RendezvousState.from_bytes(emptied.to_bytes()) == emptied


# ---------------------------------------------------------------- dumps and the job state


@pytest.mark.parametrize("dump_id", [0, 1, 4])
def test_request_dump_increments(dump_id):
    before = RendezvousState(dump_id=dump_id, dump_by=rec(0, 1.0, "z").to_dict())
    hung = FailureRecord(round=2, at=3.5, node="b", host="hb", rank=3, local_rank=1, pid=7, exitcode=-9,
                         message="HUNG", hung=True)
    after = job_ops.request_dump(before, hung)
    assert after.dump_id == dump_id + 1
    assert FailureRecord.from_dict(after.dump_by) == hung
    assert before.dump_id == dump_id and before.dump_by["node"] == "z"


def test_request_dump_twice_is_two_requests():
    once = job_ops.request_dump(RendezvousState(), rec(0, 1.0, "a"))
    assert job_ops.request_dump(once, rec(0, 1.0, "a")).dump_id == 2


SETTINGS = RendezvousSettings(run_id="r", min_nodes=2, max_nodes=4, exclude_after=3, exclude_cooldown=60.0)


def test_job_state_reads_every_field():
    hung = rec(2, 5.0, "c", rank=5)
    st = RendezvousState(restarts=2, failure=A1.to_dict(), job_failed=True, closed=True, dump_id=3,
                         dump_by=hung.to_dict(), blame=["b", "a"])
    assert job_ops.job_state(st, "a", 2, SETTINGS) == JobState(
        restarts=2, failure=A1, failed=True, closed=True, dump_id=3, dump_by=hung, blame=("b", "a"), node="a",
        others=2, min_nodes=2, exclude_after=3, exclude_cooldown=60.0)
    done = job_ops.job_state(RendezvousState(job_succeeded=True, closed=True), "a", 0, SETTINGS)
    assert (done.succeeded, done.closed, done.failed) == (True, True, False)


def test_job_state_of_a_fresh_state():
    assert job_ops.job_state(RendezvousState(), "x", 0, SETTINGS) == JobState(
        restarts=0, failure=None, failed=False, dump_id=0, dump_by=None, blame=(), node="x", others=0,
        min_nodes=2, exclude_after=3, exclude_cooldown=60.0)


@pytest.mark.parametrize("field", ["failure", "dump_by"])
def test_job_state_refuses_a_corrupt_record(field):
    st = RendezvousState(**{field: {"at": 1.0}})  # no round
    with pytest.raises(RendezvousStateError, match="corrupt failure record"):
        job_ops.job_state(st, "a", 0, SETTINGS)


# ---------------------------------------------------------------- decide: judge and next_step


@pytest.mark.parametrize(
    "codes, changes, new, failed, expected",
    [
        # the job failed elsewhere: whatever happens here
        ({0: None, 1: None}, 0, 0, True, Verdict.JOB_FAILED),
        ({0: 1, 1: None}, 0, 0, True, Verdict.JOB_FAILED),
        ({0: 0, 1: 0}, 0, 0, True, Verdict.JOB_FAILED),
        ({0: None, 1: None}, 2, 1, True, Verdict.JOB_FAILED),
        # not: the old verdicts (a hang reaches the loop as a watchdog's alarm, not a verdict here)
        ({0: None, 1: None}, 0, 0, False, Verdict.RUNNING),
        ({0: 1, 1: None}, 0, 2, False, Verdict.MEMBERSHIP_CHANGE),
        ({0: 0, 1: 0}, 0, 0, False, Verdict.SUCCEEDED),
    ],
)
def test_judge_job_failed(codes, changes, new, failed, expected):
    assert judge(codes, changes, new, job_failed=failed) is expected


@pytest.mark.parametrize(
    "codes, failed, expected",
    [
        ({0: None, 1: None}, False, Verdict.MEMBERSHIP_CHANGE),  # re-form now, the reporter counts
        ({0: 1, 1: None}, False, Verdict.FAILED),  # its own workers failed too: it reports them
        ({0: 0, 1: 0}, False, Verdict.SUCCEEDED),  # done before the failure: nothing to re-form
        ({0: None, 1: None}, True, Verdict.JOB_FAILED),
    ],
)
def test_judge_a_round_failed_elsewhere(codes, failed, expected):
    assert judge(codes, 0, job_failed=failed, round_failed=True) is expected


@pytest.mark.parametrize(
    "verdict, used, budget, fixable, expected",
    [
        (Verdict.JOB_FAILED, 0, 5, True, Step.FINISH_FAILED),  # budget left: the job failed anyway
        (Verdict.JOB_FAILED, 0, 0, True, Step.FINISH_FAILED),
        (Verdict.JOB_FAILED, 0, 5, False, Step.FINISH_FAILED),
        (Verdict.FAILED, 0, 5, False, Step.FAIL_AT_ONCE),  # no restart fixes it, budget or not
        (Verdict.FAILED, 5, 5, False, Step.FAIL_AT_ONCE),
        (Verdict.FAILED, 0, 5, True, Step.RESTART),
        (Verdict.FAILED, 5, 5, True, Step.FINISH_FAILED),
        (Verdict.SUCCEEDED, 0, 0, False, Step.FINISH_OK),  # fixable only matters for a failure
        (Verdict.MEMBERSHIP_CHANGE, 9, 0, False, Step.REJOIN),
    ],
)
def test_next_step_job_failed_and_unfixable(verdict, used, budget, fixable, expected):
    assert next_step(verdict, used, budget, fixable=fixable) is expected


@pytest.mark.parametrize("used, budget", [(0, 5), (5, 5)])
def test_next_step_rejoins_uncounted_when_a_lost_member_failed_the_round(used, budget):
    assert next_step(Verdict.FAILED, used, budget, lost=True) is Step.REJOIN
    assert next_step(Verdict.FAILED, used, budget, fixable=False, lost=True) is Step.FAIL_AT_ONCE


def test_next_step_rejects_running_even_unfixable():
    with pytest.raises(ValueError, match="RUNNING"):
        next_step(Verdict.RUNNING, 0, 1, fixable=False)


# ---------------------------------------------------------------- decide: hung_ranks


@pytest.mark.parametrize(
    "progress, codes, timeout, expected",
    [
        ({0: (True, 5.0), 1: (True, 0.5)}, {0: None, 1: None}, 2.0, [0]),
        ({0: (True, 5.0), 1: (True, 9.0)}, {0: None, 1: None}, 2.0, [0, 1]),
        ({3: (True, 9.0), 1: (True, 9.0)}, {1: None, 3: None}, 2.0, [1, 3]),  # sorted
        # never reported: not judged, however long
        ({0: (False, 1e6), 1: (True, 3.0)}, {0: None, 1: None}, 2.0, [1]),
        # exited ranks do not hang, whatever their exit code
        ({0: (True, 5.0), 1: (True, 5.0)}, {0: 0, 1: -9}, 2.0, []),
        ({0: (True, 5.0), 1: (True, 5.0)}, {0: 0, 1: None}, 2.0, [1]),
        # a rank that failed is the cause: its peer, quiet behind it, is not hung
        ({0: (True, 5.0), 1: (True, 5.0)}, {0: 1, 1: None}, 2.0, []),
        ({0: (True, 5.0), 1: (True, 5.0)}, {0: -15, 1: None}, 2.0, []),
        # strictly longer than the timeout
        ({0: (True, 2.0)}, {0: None}, 2.0, []),
        ({0: (True, 2.01)}, {0: None}, 2.0, [0]),
        # 0 turns the watch off
        ({0: (True, 1e6)}, {0: None}, 0.0, []),
        ({0: (True, 1e6)}, {0: None}, -1.0, []),
        ({}, {0: None}, 2.0, []),
    ],
)
def test_hung_ranks(progress, codes, timeout, expected):
    assert hung_ranks(progress, codes, timeout) == expected


@pytest.mark.parametrize(
    "hung, progress, codes, expected",
    [
        # the peer it waits for reported its last step a little later (a save, a slow step): judged too
        ([1], {0: (True, 1.5), 1: (True, 2.1)}, {0: None, 1: None}, [0, 1]),
        # a peer busy in its step (quiet for less than half the timeout) is not
        ([1], {0: (True, 0.9), 1: (True, 2.1)}, {0: None, 1: None}, [1]),
        # never reported, or exited: never a suspect
        ([1], {0: (False, 9.0), 1: (True, 2.1), 2: (True, 1.5)}, {0: None, 1: None, 2: 0}, [1]),
        ([0, 2], {0: (True, 3.0), 1: (True, 1.1), 2: (True, 3.0)}, {0: None, 1: None, 2: None}, [0, 1, 2]),
    ],
)
def test_hang_suspects_are_the_hung_and_their_quiet_peers(hung, progress, codes, expected):
    assert hang_suspects(hung, progress, codes, 2.0) == expected


@pytest.mark.parametrize(
    "codes, exiting, timeout, expected",
    [
        ({0: None, 1: None}, {}, 2.0, [0, 1]),
        # a rank in its interpreter's teardown (exit mark set, still alive) is not hung,
        # nor is its peer, who may wait on it: the exit code decides
        ({0: None, 1: None}, {1: 0.0}, 2.0, []),
        ({0: None, 1: None}, {0: 1.0, 1: 5.0}, 2.0, []),
        # ... for the grace: max(hang timeout, 30 s) from when the agent first saw the mark
        ({0: None, 1: None}, {1: 30.0}, 2.0, []),
        ({0: None, 1: None}, {1: 30.01}, 2.0, [1]),  # a hang in its teardown: it alone
        ({0: None, 1: None}, {0: 30.5, 1: 29.0}, 2.0, [0]),
        ({0: None, 1: None}, {0: 31.0, 1: 31.0}, 2.0, [0, 1]),
        ({0: None, 1: None}, {1: 45.0}, 60.0, []),  # a longer hang timeout is the grace
        ({0: None, 1: None}, {1: 60.01}, 60.0, [1]),
        # the exiting rank is gone (reaped): its mark no longer holds the others back
        ({0: None, 1: 0}, {1: 0.5}, 2.0, [0]),
        ({0: None, 1: 0}, {1: 99.0}, 2.0, [0]),
        # a mark of a rank not on this node (no exit code known) holds nothing back
        ({0: None, 1: None}, {7: 99.0}, 2.0, [0, 1]),
        # a failed rank is the root cause, whatever else exits slowly
        ({0: None, 1: 1}, {0: 99.0}, 2.0, []),
        # detection off: nothing, ever
        ({0: None, 1: None}, {1: 1e6}, 0.0, []),
    ],
)
def test_hung_ranks_while_a_rank_exits(codes, exiting, timeout, expected):
    progress = {0: (True, 500.0), 1: (True, 500.0)}
    assert hung_ranks(progress, codes, timeout, exiting) == expected


def test_exit_grace():
    assert exit_grace(2.0) == EXIT_GRACE_MIN == 30.0
    assert exit_grace(120.0) == 120.0


# ---------------------------------------------------------------- decide: sits_out


@pytest.mark.parametrize(
    "blame, node, exclude_after, others, min_nodes, expected",
    [
        (["a", "a"], "a", 2, 1, 1, True),
        (["b", "a", "a"], "a", 2, 1, 1, True),  # the last two count
        (["a", "a", "b"], "a", 2, 1, 1, False),  # the streak ended
        (["a", "b", "a"], "a", 2, 1, 1, False),
        (["a"], "a", 2, 1, 1, False),  # streak too short
        ([], "a", 1, 1, 1, False),
        (["a"], "a", 1, 1, 1, True),
        (["a", "a"], "b", 2, 1, 1, False),  # someone else's streak
        (["a", "a", "a"], "a", 3, 3, 3, True),
        (["a", "a", "a"], "a", 0, 5, 1, False),  # 0: never exclude
        # the others must still make min_nodes without this node
        (["a", "a"], "a", 2, 1, 2, False),
        (["a", "a"], "a", 2, 2, 2, True),
        (["a", "a"], "a", 2, 0, 1, False),
    ],
)
def test_sits_out(blame, node, exclude_after, others, min_nodes, expected):
    assert sits_out(blame, node, exclude_after, others, min_nodes) is expected


# ---------------------------------------------------------------- failures.py

LOCAL = ProcessFailure(local_rank=1, global_rank=3, pid=4242, exitcode=-9, timestamp=100.0, hostname="node-b",
                       error_file="/r/3/error.json", stderr_tail="last line")


@pytest.mark.parametrize("hung", [False, True])
def test_to_record(hung):
    assert to_record(LOCAL, 2, "the text", 99.5, hung=hung) == FailureRecord(
        round=2, at=99.5, node="", host="node-b", rank=3, local_rank=1, pid=4242, exitcode=-9,
        message="the text", hung=hung)


def test_from_record_is_a_remote_failure():
    record = FailureRecord(round=2, at=99.5, node="n1", host="node-b", rank=3, local_rank=1, pid=4242,
                           exitcode=-9, message="the text")
    assert from_record(record) == ProcessFailure(local_rank=1, global_rank=3, pid=4242, exitcode=-9,
                                                 timestamp=99.5, hostname="node-b", remote=True, detail="the text")


def test_record_round_trip_through_the_state_json():
    record = to_record(LOCAL, 2, "the text", 99.5, hung=True)
    back = FailureRecord.from_dict(json.loads(json.dumps(record.to_dict())))
    assert back == record
    again = from_record(back)
    assert (again.global_rank, again.local_rank, again.pid, again.exitcode, again.hostname, again.detail) == (
        3, 1, 4242, -9, "node-b", "the text")


MINE = {3: LOCAL}


@pytest.mark.parametrize(
    "root, ranks, remote",
    [
        (FailureRecord(round=0, at=1.0, node="me", rank=0), [3], set()),  # our own root cause: nothing added
        (FailureRecord(round=0, at=1.0, node="other", rank=3), [3], set()),  # already known here
        (FailureRecord(round=0, at=1.0, node="other", rank=0, host="node-a"), [0, 3], {0}),
        (FailureRecord(round=0, at=1.0, node="", rank=7), [3, 7], {7}),
    ],
)
def test_with_root(root, ranks, remote):
    out = with_root(MINE, root, "me")
    assert sorted(out) == ranks
    assert {r for r, f in out.items() if f.remote} == remote
    assert out[3] is LOCAL
    assert out is not MINE and sorted(MINE) == [3]


def test_with_root_for_static_where_no_node_has_an_id():
    # static/standalone: records are never published (node "" on both sides)
    out = with_root(MINE, FailureRecord(round=0, at=1.0, node="", rank=9), "")
    assert sorted(out) == [3]


# ---------------------------------------------------------------- the state's new fields in JSON

NEW_FIELDS = ("restarts", "failure", "job_failed", "dump_id", "dump_by", "blame", "failure_acks")


def job_failed_state() -> RendezvousState:
    return RendezvousState(round=4, complete=True, closed=True, participants={"a": 0, "b": 1},
                           last_heartbeats={"a": 1.0, "b": 2.0}, restarts=3, failure=A1.to_dict(),
                           job_failed=True, dump_id=2, dump_by=rec(3, 4.5, "b", rank=2).to_dict(),
                           blame=["b", "a"], failure_acks=["b"])


def test_state_round_trip_of_the_job_fields():
    st = job_failed_state()
    data = st.to_bytes()
    doc = json.loads(data)
    assert {k: doc[k] for k in NEW_FIELDS} == {
        "restarts": 3, "failure": A1.to_dict(), "job_failed": True, "dump_id": 2,
        "dump_by": rec(3, 4.5, "b", rank=2).to_dict(), "blame": ["b", "a"], "failure_acks": ["b"]}
    back = RendezvousState.from_bytes(data)
    assert back == st
    assert back.to_bytes() == data


def test_an_old_state_without_the_job_fields_decodes_with_defaults():
    doc = json.loads(job_failed_state().to_bytes())
    for k in NEW_FIELDS:
        del doc[k]
    back = RendezvousState.from_bytes(json.dumps(doc))
    assert (back.restarts, back.failure, back.job_failed, back.dump_id, back.dump_by, back.blame,
            back.failure_acks) == (0, None, False, 0, None, [], [])
    assert back.participants == {"a": 0, "b": 1} and back.closed is True


@pytest.mark.parametrize("field, bad", [
    ("restarts", "1"), ("restarts", True), ("failure", ["x"]), ("job_failed", 1), ("dump_id", 1.5),
    ("dump_by", "x"), ("blame", "ab"), ("failure_acks", {"a": 1}),
])
def test_job_fields_of_the_wrong_type_are_refused(field, bad):
    doc = json.loads(RendezvousState().to_bytes())
    doc[field] = bad
    with pytest.raises(RendezvousStateError, match="corrupt rendezvous state"):
        RendezvousState.from_bytes(json.dumps(doc))


def test_copy_does_not_share_the_job_fields():
    st = job_failed_state()
    c = st.copy()
    c.failure["round"] = 99
    c.dump_by["rank"] = 99
    c.blame.append("z")
    c.failure_acks.append("z")
    assert st == job_failed_state()


# ---------------------------------------------------------------- the summary's root cause


def pf(rank: int, t: float, remote: bool = False, detail: str = "") -> ProcessFailure:
    return ProcessFailure(local_rank=rank % 2, global_rank=rank, pid=100 + rank, exitcode=1, timestamp=t,
                          hostname=f"h{rank}", remote=remote, detail=detail)


FOUR = {0: pf(0, 40.0), 1: pf(1, 10.0), 2: pf(2, 30.0), 3: pf(3, 20.0)}


@pytest.mark.parametrize(
    "first, order",
    [
        (None, [1, 3, 2, 0]),  # by time
        (1, [1, 3, 2, 0]),
        (0, [0, 1, 3, 2]),  # the job's root cause first, the others by time
        (2, [2, 1, 3, 0]),
        (9, [1, 3, 2, 0]),  # not among the failures: by time
    ],
)
def test_summary_first_puts_the_jobs_root_cause_first(first, order):
    text = format_failure_summary(FOUR, title="t FAILED", first=first)
    assert [int(m) for m in re.findall(r"^  rank      : (\d+) ", text, re.M)] == order
    root = text.split("Root Cause (first observed failure):\n", 1)[1].split("\nOther Failures:\n", 1)[0]
    assert root.startswith("[0]:\n  time      : ")
    assert f"  rank      : {order[0]} (local_rank: {order[0] % 2})" in root


def test_summary_marks_a_remote_root_cause():
    failures = {0: pf(0, 5.0), 3: pf(3, 9.0, remote=True, detail="Traceback: ValueError: bad batch")}
    text = format_failure_summary(failures, title="t FAILED", first=3)
    lines = text.split("\n")
    assert lines[lines.index("Root Cause (first observed failure):") + 3] == "  host      : h3" + REMOTE
    assert "  traceback : Traceback: ValueError: bad batch" in text
    assert "  host      : h0\n" in text  # the local one is not marked
    assert text.count(REMOTE) == 1


@pytest.mark.parametrize(
    "failure, text",
    [
        (pf(0, 1.0, detail="remote text"), "remote text"),
        (ProcessFailure(0, 0, 42, -9, 1.0, detail="HUNG: no progress", stderr_tail="a\nb"),
         "HUNG: no progress\n  stderr tail (last 2 lines of the worker's stderr):\n    a\n    b"),
        (ProcessFailure(0, 0, 42, -9, 1.0), "Signal 9 (SIGKILL) received by PID 42"),
    ],
)
def test_failure_text(failure, text):
    assert failure_text(failure) == text


def test_a_long_hung_stack_keeps_its_hung_header_when_published():
    from elaunch.agent.failures import from_record
    from elaunch.rendezvous.contract import FailureRecord
    from elaunch.errors import format_failure_summary

    text = "HUNG: no progress for 3.0 s\nstacks (py-spy):\n" + "\n".join(f"  frame {i} (x.py:{i})" for i in range(400))
    doc = FailureRecord(round=0, at=1.0, rank=3, exitcode=-9, message=text, hung=True).to_dict()
    assert len(doc["message"]) <= 4000
    summary = format_failure_summary({3: from_record(FailureRecord.from_dict(doc))}, title="t FAILED")
    assert "HUNG: no progress for 3.0 s" in summary and "frame 399 (x.py:399)" in summary


@pytest.mark.parametrize("blame, restarts, fresh_after, expected", [
    (["a", "a"], 2, 0, True),
    (["a", "a", "a"], 3, 2, False),  # came back after 2: one failure since is no streak yet
    (["a", "a", "a", "a"], 4, 2, True),  # two in a row since it came back
])
def test_a_streak_starts_afresh_after_sitting_out(blame, restarts, fresh_after, expected):
    from elaunch.agent.decide import sits_out

    assert sits_out(blame, "a", 2, 2, 2, restarts, fresh_after) is expected


@pytest.mark.parametrize("hung, counters, quiet, waits, expected", [
    ([0, 1], {0: 5, 1: 5}, {0: 3.0, 1: 3.0}, {0: True, 1: False}, [1, 0]),  # rank 0 waits in a collective
    ([0, 1], {0: 6, 1: 5}, {0: 3.0, 1: 3.0}, {0: False, 1: False}, [1, 0]),  # rank 1 is a step behind
    ([0, 1], {0: 5, 1: 5}, {0: 3.0, 1: 4.0}, {}, [1, 0]),  # quiet longer
    ([1, 0], {0: 5, 1: 5}, {0: 3.0, 1: 3.0}, {}, [0, 1]),  # a tie: the lower rank
])
def test_order_hung_puts_the_rank_the_others_wait_behind_first(hung, counters, quiet, waits, expected):
    from elaunch.agent.decide import order_hung

    assert order_hung(hung, counters, quiet, waits) == expected


def test_waits_on_peer_reads_a_collective_in_the_stack():
    from elaunch.agent.hang_watchdog import waits_on_peer

    assert waits_on_peer("Thread 1 (idle)\n    all_reduce (torch/distributed/distributed_c10d.py:2501)\n")
    assert not waits_on_peer("Thread 1 (idle)\n    hang_forever (ddp_digits.py:120)\n")
    # DistributedDataParallel all-reduces its gradients from C++ inside backward: a rank waiting
    # for a stopped peer's gradients shows only the autograd engine (seen in the chaos test,
    # where its node then competed as root cause with the stopped rank's by time alone)
    assert waits_on_peer("Thread 1 (idle)\n    _engine_run_backward (torch/autograd/graph.py:979)\n"
                         "    backward (torch/autograd/__init__.py:395)\n    Tensor.backward (torch/_tensor.py:623)\n"
                         "    main (ddp_digits.py:400)\n")


@pytest.mark.parametrize("known, report, root_after", [
    # a worker not blocked behind a peer beats one that was, whatever the time
    (dict(at=1.0, rank=0, blocked=True), dict(at=2.0, rank=3, blocked=False), 3),
    (dict(at=2.0, rank=3, blocked=False), dict(at=1.0, rank=0, blocked=True), 3),
    # among equals, the earlier one
    (dict(at=2.0, rank=3), dict(at=1.0, rank=0), 0),
    (dict(at=1.0, rank=3, blocked=True), dict(at=0.5, rank=0, blocked=True), 0),
    # a worker found stopped beats the rest, even an earlier victim that looked behind its own peers
    (dict(at=1.0, rank=1), dict(at=1.03, rank=3, stopped=True), 3),
    (dict(at=1.03, rank=3, stopped=True), dict(at=1.0, rank=1), 3),
])
def test_a_report_not_blocked_behind_a_peer_is_the_rounds_root_cause(known, report, root_after):
    first = job_ops.count_failure(state(), FailureRecord(round=2, node="a", hung=True, **known))
    second = job_ops.count_failure(first, FailureRecord(round=2, node="b", hung=True, **report))
    final = second if second is not None else first
    assert final.restarts == 1
    assert FailureRecord.from_dict(final.failure).rank == root_after
    failed = job_ops.fail_job(first, FailureRecord(round=2, node="b", hung=True, **report))
    assert FailureRecord.from_dict(failed.failure).rank == root_after


def test_dump_acknowledgements_belong_to_their_request():
    asked = job_ops.request_dump(state(), FailureRecord(round=0, at=1.0, rank=3))
    assert asked.dump_id == 1 and asked.dump_acks == []
    acked = job_ops.acknowledge_dump(asked, "b", 1)
    assert acked.dump_acks == ["b"] and job_ops.acknowledge_dump(acked, "b", 1) is None
    assert job_ops.acknowledge_dump(acked, "c", 0) is None  # an answer to an older request
    assert job_ops.dumps_pending(acked, 1, {"b", "c"}) == ["c"]
    again = job_ops.request_dump(acked, FailureRecord(round=0, at=2.0, rank=4))
    assert again.dump_id == 2 and again.dump_acks == []  # a new request starts afresh
    assert job_ops.dumps_pending(again, 1, {"b", "c"}) == []  # the old one is superseded


def test_a_worker_that_raised_is_described_by_its_exception_not_an_exit_code():
    from elaunch.agent.failures import describe_exits

    codes = {0: 1, 1: None, 2: -9, 3: 0, 4: 2}
    assert describe_exits(codes) == "local rank 0: exitcode 1, local rank 2: SIGKILL, local rank 4: exitcode 2"
    raised = {0: "RuntimeError: Connection closed by peer [127.0.0.1]:1: a: b", 1: "ValueError: x"}
    assert describe_exits(codes, raised) == \
        "local rank 0: raised RuntimeError, local rank 1: raised ValueError, local rank 2: SIGKILL, " \
        "local rank 4: exitcode 2"
