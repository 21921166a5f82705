"""The agent's decisions, as pure functions of what it observed (no processes).

``judge`` turns the workers' exit codes, the rendezvous' waiting count and the
job's shared state into a verdict; ``next_step``, the one decision table, turns
a verdict and the job's restart budget into what the agent does next; ``hung_ranks`` is the hang verdict
and ``sits_out`` the bad-node exclusion. The loop in ``agent.py`` only observes
and applies.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence

#: Least seconds an exiting rank's teardown may take before its quiet is a hang again:
#: 15 times the 2.0 s that torch's and gloo's teardown took on 2 loaded cores (issue 22).
EXIT_GRACE_MIN = 30.0


class Verdict(enum.Enum):
    """What the worker group's state is after one observation."""

    RUNNING = "running"  # some worker still running, none failed, nobody waiting
    SUCCEEDED = "succeeded"  # every worker exited 0
    FAILED = "failed"  # some worker exited non-zero or was killed
    MEMBERSHIP_CHANGE = "membership_change"  # healthy, but nodes wait to join or members are gone
    JOB_FAILED = "job_failed"  # another node declared the whole job failed


class Step(enum.Enum):
    """What the agent does after a group stopped running (:func:`next_step`)."""

    RESTART = "restart"  # a failure, budget left: counts one restart
    REJOIN = "rejoin"  # membership changed, or a lost member failed the workers: re-form, not counted
    FINISH_OK = "finish_ok"  # every worker exited 0
    FINISH_FAILED = "finish_failed"  # no restart left, or the job failed on another node
    FAIL_AT_ONCE = "fail_at_once"  # a failure no restart fixes: the job fails now, budget or not


def judge(exit_codes: Mapping[int, int | None], membership_changes: int, new_nodes: int = 0,
          job_failed: bool = False, round_failed: bool = False) -> Verdict:
    """Classify the group, as torch's ``_monitor_workers`` + ``_invoke_run`` do.

    A hang is not judged here: it reaches the loop as a watchdog's alarm.

    Args:
        exit_codes: local rank -> exit code, None while running; negative = -signum.
        membership_changes: nodes waiting to join the next round plus members of the
            running round that are gone (>= 0).
        new_nodes: nodes outside the running round that joined since it formed
            (``JobChannel.num_nodes_new``, >= 0).
        job_failed: another agent declared the job failed (``JobState.failed``).
        round_failed: another node reported a failure of the running round
            (``JobState.failure``): its collectives are broken, re-form now.

    Returns:
        JOB_FAILED when the job failed elsewhere: nothing here can change that.
        FAILED if any worker failed, unless new nodes joined: then the
        failure is the scale-up's doing (another node re-formed first and closed
        the workers' sockets) and the verdict is MEMBERSHIP_CHANGE. Else SUCCEEDED
        when all exited 0, else MEMBERSHIP_CHANGE when the round failed elsewhere (this
        node re-forms without counting: the reporter counts) or membership changed,
        else RUNNING.
    """
    if job_failed:
        return Verdict.JOB_FAILED
    codes = list(exit_codes.values())
    if any(c is not None and c != 0 for c in codes):
        return Verdict.MEMBERSHIP_CHANGE if new_nodes > 0 else Verdict.FAILED
    if codes and all(c == 0 for c in codes):
        return Verdict.SUCCEEDED
    if round_failed or membership_changes > 0:
        return Verdict.MEMBERSHIP_CHANGE
    return Verdict.RUNNING


def next_step(verdict: Verdict, restarts_used: int, max_restarts: int, fixable: bool = True,
              lost: bool = False) -> Step:
    """The agent's decision table: what follows a stopped group (``--max-restarts`` semantics of torchrun).

    Args:
        verdict: SUCCEEDED, FAILED, MEMBERSHIP_CHANGE or JOB_FAILED (RUNNING is not a stop).
        restarts_used: failed-group restarts the job spent before this failure (the
            job's count, shared by every node, where the rendezvous keeps one).
        max_restarts: the budget for the whole job (>= 0).
        fixable: False for a failure no restart can fix (the workers could not be
            started at all, e.g. a bad script path; a worker stuck in the kernel).
        lost: a member of the failed round is gone (``JobState.lost``): the failure
            is that loss's doing, not the job's.

    Returns:
        JOB_FAILED -> FINISH_FAILED; SUCCEEDED -> FINISH_OK; MEMBERSHIP_CHANGE ->
        REJOIN (membership changes do not count as restarts, as under torchrun);
        FAILED -> FAIL_AT_ONCE when not ``fixable``, REJOIN when ``lost``, else
        RESTART while ``restarts_used < max_restarts``, FINISH_FAILED after.

    Raises:
        ValueError: ``verdict`` is RUNNING.
    """
    if verdict is Verdict.JOB_FAILED:
        return Step.FINISH_FAILED
    if verdict is Verdict.SUCCEEDED:
        return Step.FINISH_OK
    if verdict is Verdict.MEMBERSHIP_CHANGE:
        return Step.REJOIN
    if verdict is Verdict.FAILED:
        if not fixable:
            return Step.FAIL_AT_ONCE
        if lost:
            return Step.REJOIN
        return Step.RESTART if restarts_used < max_restarts else Step.FINISH_FAILED
    raise ValueError(f"no step follows verdict {verdict}")


def exit_grace(timeout: float) -> float:
    """Seconds an exiting rank is exempt from the hang verdict: ``max(timeout, EXIT_GRACE_MIN)``.

    A teardown is no step of the program, so ``timeout`` (``--hang-timeout``, the
    user's bound on the gap between two steps) alone would be too tight where it is
    short; and a teardown longer than both is not one the machine's load explains.
    """
    return max(timeout, EXIT_GRACE_MIN)


def hung_ranks(progress: Mapping[int, tuple[bool, float]], exit_codes: Mapping[int, int | None],
               timeout: float, exiting: Mapping[int, float] | None = None) -> list[int]:
    """Return the local ranks that hang (sorted): the hang verdict of ``--hang-timeout``.

    Args:
        progress: local rank -> (it called ``elaunch.progress()`` at least once,
            seconds since its counter last changed).
        exit_codes: local rank -> exit code, None while running (exited ranks do not hang).
        timeout: ``--hang-timeout``, seconds without progress that make a rank hung; 0 = off.
        exiting: local rank -> seconds since the agent first saw that rank's worker
            start to exit (its interpreter ran the exit mark that
            ``elaunch.progress()`` registers) while it is still alive.

    Returns:
        The running ranks that reported progress once and then not for more than
        ``timeout`` seconds. A rank that never reported is not judged (it may
        not call ``elaunch.progress()`` at all). Nothing is judged after a rank of
        the node failed (exited non-zero or by a signal: that failure is the root
        cause, its peers' quiet is its doing); the exit codes then decide. While a
        rank of the node is exiting, only exiting ranks are judged: each is exempt
        for :func:`exit_grace` seconds (its teardown takes seconds on a loaded
        machine, and its peers may wait on it), then hung in its teardown.
    """
    if timeout <= 0:
        return []
    if any(c is not None and c != 0 for c in exit_codes.values()):
        return []
    exiting = {lr: s for lr, s in (exiting or {}).items() if exit_codes.get(lr, 0) is None}
    if exiting:
        # its peers' quiet may be waiting on it: the exiting rank is the one to judge
        return sorted(lr for lr, seconds in exiting.items() if seconds > exit_grace(timeout))
    return sorted(lr for lr, (reported, quiet) in progress.items()
                  if reported and quiet > timeout and exit_codes.get(lr) is None)


def hang_suspects(hung: Sequence[int], progress: Mapping[int, tuple[bool, float]],
                  exit_codes: Mapping[int, int | None], timeout: float) -> list[int]:
    """Return the ranks to judge for a hang found in ``hung`` (sorted): ``hung`` and its quiet peers.

    Peers stuck in one collective do not go quiet at the same moment: the one that
    reached it first (blocked, waiting) crosses ``timeout`` first, and the one it waits
    for (stopped, or stuck outside the collective) may have reported its last step a
    little later: a save, a slow step, a loaded machine. So a running rank that reported
    once and has been quiet for more than half of ``timeout`` is judged with them, and
    ``order_hung`` picks the culprit among all (stopped, behind, not in a collective).

    Args:
        hung: :func:`hung_ranks`' answer (non-empty).
        progress, exit_codes, timeout: as for :func:`hung_ranks`.
    """
    peers = [lr for lr, (reported, quiet) in progress.items()
             if reported and quiet > timeout / 2 and exit_codes.get(lr) is None]
    return sorted(set(hung) | set(peers))


def sits_out(blame: Sequence[str], node: str, exclude_after: int, others: int, min_nodes: int,
             restarts: int | None = None, fresh_after: int = 0) -> bool:
    """Decide whether ``node`` sits out the next rounds (bad-node exclusion).

    Args:
        blame: node ids of the root causes of the job's latest counted failures, oldest first.
        node: this node's id.
        exclude_after: failures in a row it must be the root cause of (0 = never exclude).
        others: live nodes of the job besides this one.
        min_nodes: the job's minimum number of nodes.
        restarts: the job's counted failures so far (``blame[-1]`` is the latest of them),
            or None to judge ``blame`` alone.
        fresh_after: the job's count when this node last came back from sitting out;
            only failures after it make a new streak.

    Returns:
        True when the last ``exclude_after`` failures were all this node's (since it
        last sat out) and the others still make ``min_nodes`` without it (Horovod's
        host blacklist and NVIDIA's fault-tolerance launcher do the same).
    """
    if exclude_after <= 0 or len(blame) < exclude_after or others < min_nodes:
        return False
    if restarts is not None and restarts - exclude_after < fresh_after:
        return False  # part of the streak happened before this node last sat out
    return all(b == node for b in blame[-exclude_after:])


def order_hung(hung: Sequence[int], counters: Mapping[int, int], quiet: Mapping[int, float],
               waits_on_peer: Mapping[int, bool], stopped: Mapping[int, bool] | None = None) -> list[int]:
    """Order hung local ranks culprit first: the one the others are blocked behind.

    A rank stuck in a collective (its stack is inside ``torch.distributed``) is
    usually waiting for a peer that stopped; every such peer goes quiet at about
    the same moment, so the time alone cannot tell them apart.

    Args:
        hung: the hung local ranks.
        counters: local rank -> its progress counter (a rank behind the others is
            the likelier culprit).
        quiet: local rank -> seconds since its last progress.
        waits_on_peer: local rank -> its stack shows it inside a collective.
        stopped: local rank -> the process is stopped (SIGSTOP, a debugger): the culprit
            whatever its stack shows.

    Returns:
        ``hung`` sorted by: stopped, lowest counter, not waiting on a peer, longest quiet, rank.
    """
    stopped = stopped or {}
    return sorted(hung, key=lambda lr: (not stopped.get(lr), counters.get(lr, 0), bool(waits_on_peer.get(lr)),
                                        -quiet.get(lr, 0.0), lr))
