"""In-process restart's decisions, as pure functions of what the agent observed (no processes, no sockets).

The agent's side (:mod:`elaunch.inprocess.restarts`) observes the workers' exit codes and
what each said on the control channel, and applies these; the restart itself is decided
and counted by the agent's own table (``agent.decide.next_step``), as for any failure.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

#: Seconds a "raised" waits for a death on the node before the failure is judged: torch's default
#: ``--monitor-interval``, within which torchrun sees two exits as one look's.
RAISED_SETTLE = 0.1


def goes_in_process(local_ranks: Collection[int], opted_in: Collection[int], fixable: bool, offered: bool) -> bool:
    """Whether a failure of this node's group is restarted in process.

    Args:
        local_ranks: the group's local ranks.
        opted_in: local ranks whose worker said "hello" (``elaunch.restartable``).
        fixable: False for a failure no restart fixes (the job ends; nothing to keep).
        offered: the agent offers its control channel (exec'd script workers; off for
            function workers, or once the channel's thread died).

    Returns:
        True when every local rank opted in (one that did not would be left running a
        round that is over), the failure is fixable and the channel is offered. Else the
        node's workers are all stopped and started again, as torchrun does.
    """
    return offered and fixable and bool(local_ranks) and set(local_ranks) <= set(opted_in)


def laggards(codes: Mapping[int, int | None], waiting: Collection[int]) -> list[int]:
    """Local ranks still running that are not waiting for the next round yet (sorted).

    Args:
        codes: local rank -> exit code, None while running.
        waiting: local ranks that said "ready" or "raised" since the round ended or failed.
    """
    return sorted(lr for lr, c in codes.items() if c is None and lr not in waiting)


def kept(codes: Mapping[int, int | None], waiting: Collection[int]) -> list[int]:
    """Local ranks kept for the next round: running and waiting for it (sorted); the rest start anew."""
    return sorted(lr for lr, c in codes.items() if c is None and lr in waiting)


def with_raised(codes: Mapping[int, int | None], raised: Collection[int]) -> dict[int, int | None]:
    """``codes`` with each rank that reported "raised" (alive, waiting) failed with exit code 1.

    That is the code the same worker would have exited with without the wrapper (an
    uncaught exception), so the failure is reported and counted as one.
    """
    return {lr: (1 if lr in raised and c is None else c) for lr, c in codes.items()}


def failure_times(exits: Mapping[int, float], raised: Mapping[int, float],
                  settle: float = RAISED_SETTLE) -> dict[int, float]:
    """Each failed local rank's failure time, for the root cause (the earliest is the root).

    A killed worker's sockets close before the agent can see its exit, so its peers'
    collectives break, and their "raised" arrives, first. A death seen no later than
    ``settle`` seconds after a "raised" arrived is therefore taken to come first: the
    "raised" is dated just after the earliest death. A "raised" more than ``settle``
    seconds before every death keeps its own time.

    Args:
        exits: local rank -> when the agent saw its exit (dead ranks only), seconds since the epoch.
        raised: local rank -> when its "raised" arrived, seconds since the epoch.
        settle: seconds; see above.

    Returns:
        local rank -> time, for every rank of ``exits`` and ``raised``.
    """
    out = dict(exits)
    first_death = min(exits.values(), default=None)
    for lr, at in raised.items():
        late = first_death is not None and at >= first_death - settle
        out[lr] = max(at, first_death + 1e-6) if late else at
    return out
