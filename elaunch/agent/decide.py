"""The agent's decisions, as pure functions of what it observed (no processes).

``judge`` turns the workers' exit codes and the rendezvous' waiting count into a
verdict; ``next_step`` turns a verdict and the restart budget into what the agent
does next. The loop in ``agent.py`` only observes and applies.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping


class Verdict(enum.Enum):
    """What the worker group's state is after one observation."""

    RUNNING = "running"  # some worker still running, none failed, nobody waiting
    SUCCEEDED = "succeeded"  # every worker exited 0
    FAILED = "failed"  # some worker exited non-zero or was killed
    MEMBERSHIP_CHANGE = "membership_change"  # healthy, but nodes wait to join or members are gone


class Step(enum.Enum):
    """What the agent does after a group stopped running."""

    RESTART = "restart"  # failed, budget left: counts one restart
    REJOIN = "rejoin"  # membership change: restart without counting
    FINISH_OK = "finish_ok"
    FINISH_FAILED = "finish_failed"


def judge(exit_codes: Mapping[int, int | None], membership_changes: int, new_nodes: int = 0) -> Verdict:
    """Classify the group, as torch's ``_monitor_workers`` + ``_invoke_run`` do.

    Args:
        exit_codes: local rank -> exit code, None while running; negative = -signum.
        membership_changes: nodes waiting to join the next round plus members of the
            running round that are gone (>= 0).
        new_nodes: nodes outside the running round that joined since it formed
            (``RendezvousHandler.num_nodes_new``, >= 0).

    Returns:
        FAILED if any worker failed, unless new nodes joined: then the failure is
        the scale-up's doing (another node re-formed first and closed the workers'
        sockets) and the verdict is MEMBERSHIP_CHANGE. Else SUCCEEDED when all
        exited 0, else MEMBERSHIP_CHANGE when membership changed, else RUNNING.
    """
    codes = list(exit_codes.values())
    if any(c is not None and c != 0 for c in codes):
        return Verdict.MEMBERSHIP_CHANGE if new_nodes > 0 else Verdict.FAILED
    if codes and all(c == 0 for c in codes):
        return Verdict.SUCCEEDED
    if membership_changes > 0:
        return Verdict.MEMBERSHIP_CHANGE
    return Verdict.RUNNING


def next_step(verdict: Verdict, restarts_used: int, max_restarts: int) -> Step:
    """Decide what follows a stopped group (``--max-restarts`` semantics of torchrun).

    Args:
        verdict: SUCCEEDED, FAILED or MEMBERSHIP_CHANGE (RUNNING is not a stop).
        restarts_used: failed-group restarts already spent.
        max_restarts: the budget (>= 0).

    Raises:
        ValueError: ``verdict`` is RUNNING.
    """
    if verdict is Verdict.SUCCEEDED:
        return Step.FINISH_OK
    if verdict is Verdict.MEMBERSHIP_CHANGE:
        # membership changes do not count as restarts (torchrun)
        return Step.REJOIN
    if verdict is Verdict.FAILED:
        return Step.RESTART if restarts_used < max_restarts else Step.FINISH_FAILED
    raise ValueError(f"no step follows verdict {verdict}")
