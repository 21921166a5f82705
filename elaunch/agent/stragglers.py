"""Stragglers, decided: which ranks report their steps late, window after window (pure functions).

In a synchronous job every rank runs at the pace of the slowest: their step *times*
are the same, so comparing them names nobody. What differs is *when* in the step a
rank gets through its own work: after the step's last collective (an all-reduce, a
barrier) releases every rank at once, a slow rank reaches its next
``elaunch.progress()`` call later than the others. So the watch compares when the
ranks report the same step.

The input: at sample instants shared by every node (multiples of ``window / samples``
seconds of wall-clock time), each agent asks its workers to stamp their next call
(:meth:`elaunch.procs.progress_files.ProgressFiles.ask_stamps`): a ``(step, time)``
per rank per answered request. Asked at the same instant, the ranks stamp the same
step or a neighbouring one. For each step a rank stamped, the other ranks' times of
that step are their stamps of it, or of the nearest step they stamped (within
:data:`MAX_STEP_SPREAD`) moved by the window's median step time. The rank's
*lateness* at that step is its time minus the median of the others'; its lateness in
a window is the mean over the steps it stamped, as a fraction of the median step
time. The mean makes zero-mean noise (±20 % jitter per step on every rank) fade with
the number of steps, while a rank that is late at every step keeps its lateness.

A rank whose lateness exceeds ``factor`` in ``windows`` windows in a row is a
straggler; it stays one until a window in which it is not late. A window without
enough stamps of a rank (:data:`MIN_STEPS`) neither extends nor ends its streak.

What this sees, and what it does not: only the work between the step's last
collective and the rank's ``progress()`` call. A rank slow in every part of its step
(a CPU-capped or throttled host, a slow accelerator whose kernels run after the
all-reduce) shows; work done entirely *before* the collective (e.g. an extra forward
pass in a DDP loop, whose all-reduce sits in ``backward()``) makes the others wait
inside the collective and leaves no trace in when anyone reports. Calling
``progress(step=)`` after the optimizer step (the common place) sees the optimizer
step, logging and anything else done before it; see docs/fault-tolerance.md.

Clocks: the times are wall-clock times of different hosts; a host whose clock is off
by a fraction of a step time shifts its ranks' lateness by that much (NTP keeps hosts
within milliseconds; steps of a few hundred milliseconds or more are fine).

Its settings (``--rdzv-conf``'s ``straggler_*`` keys) are :mod:`elaunch.features.stragglers`.
Stdlib only; no I/O, no clock.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from elaunch.features.stragglers import DEFAULT_FACTOR, DEFAULT_WINDOWS

#: Sample instants per window: the stamps asked for per window.
SAMPLES_PER_WINDOW = 20
#: The fewest steps a rank must have stamped in a window to be judged in it (steps longer than a
#: third of the window are never judged: raise ``straggler_window``).
MIN_STEPS = 3
#: Instants at which the stamped steps differ by more than this are skipped: the ranks do not
#: number their steps alike (a counter on one, a step on another), or one is stopped.
MAX_STEP_SPREAD = 2


@dataclass(frozen=True)
class Sample:
    """One rank's stamp at one sample instant.

    Attributes:
        instant: the sample instant's index (wall-clock seconds // the sample period).
        step: the stamped call's step (or call counter).
        time: the stamped call's time, seconds since the epoch.
    """

    instant: int
    step: int
    time: float


@dataclass(frozen=True)
class WindowLateness:
    """What one window's samples say.

    Attributes:
        step_time: the median seconds per step over the window, None when no rank stamped two
            different steps (no verdict is possible).
        lateness: global rank -> mean lateness, as a fraction of ``step_time``, for the ranks
            with :data:`MIN_STEPS` compared steps or more.
        steps: how many different steps were compared.
    """

    step_time: float | None
    lateness: dict[int, float] = field(default_factory=dict)
    steps: int = 0


def step_time(samples: Mapping[int, Sequence[Sample]]) -> float | None:
    """The median seconds per step between each rank's consecutive samples of different steps; None: none."""
    rates = []
    for rank_samples in samples.values():
        ordered = sorted(rank_samples, key=lambda s: s.instant)
        for a, b in zip(ordered, ordered[1:]):
            if b.step > a.step and b.time > a.time:
                rates.append((b.time - a.time) / (b.step - a.step))
    return statistics.median(rates) if rates else None


def in_step(samples: Mapping[int, Sequence[Sample]]) -> bool:
    """True when the ranks ran in step over the window: between its first and last shared instants,
    every rank advanced by the same number of steps, give or take :data:`MAX_STEP_SPREAD`.

    A synchronous job's ranks do (each step waits for every rank); ranks that run apart (no
    collective between them, or a rank stopped) do not, and their lateness means nothing.
    """
    common = None
    for rows in samples.values():
        instants = {s.instant for s in rows}
        common = instants if common is None else common & instants
    if not common or len(common) < 2:
        return True  # nothing to compare: the per-instant rule alone decides
    first, last = min(common), max(common)
    advances = []
    for rows in samples.values():
        at = {s.instant: s.step for s in rows}
        advances.append(at[last] - at[first])
    return max(advances) - min(advances) <= MAX_STEP_SPREAD


def window_lateness(samples: Mapping[int, Sequence[Sample]], min_steps: int = MIN_STEPS) -> WindowLateness:
    """Each rank's mean lateness over one window, as a fraction of the median step time.

    Args:
        samples: global rank -> its samples in the window (any order; at most one per instant).
        min_steps: the fewest compared steps a rank needs to be judged.

    Returns:
        The window's :class:`WindowLateness`; ranks with too few steps compared are left out of
        ``lateness``, and so is everything when ``step_time`` is None, fewer than two
        ranks were stamped at any instant, or the ranks did not run in step (:func:`in_step`).
    """
    per_step = step_time(samples)
    if per_step is None or per_step <= 0:
        return WindowLateness(None)
    if not in_step(samples):
        return WindowLateness(per_step)
    stamped = {rank: {s.step: s.time for s in rows} for rank, rows in samples.items() if rows}
    sums: dict[int, float] = {}
    counts: dict[int, int] = {}
    used: set[int] = set()
    for rank, steps in stamped.items():
        for step, t in steps.items():
            others = [u for u in (_time_at(stamped[o], step, per_step) for o in stamped if o != rank) if u is not None]
            if not others:
                continue
            used.add(step)
            sums[rank] = sums.get(rank, 0.0) + t - statistics.median(others)
            counts[rank] = counts.get(rank, 0) + 1
    lateness = {rank: sums[rank] / counts[rank] / per_step for rank in sorted(sums) if counts[rank] >= min_steps}
    return WindowLateness(per_step, lateness, len(used))


def _time_at(steps: Mapping[int, float], step: int, per_step: float) -> float | None:
    """When a rank reached ``step``: its stamp of that step, else of the nearest one within
    :data:`MAX_STEP_SPREAD` moved by ``per_step`` seconds a step; None: no stamp near enough."""
    if step in steps:
        return steps[step]
    near = [k for k in steps if abs(k - step) <= MAX_STEP_SPREAD]
    if not near:
        return None
    k = min(near, key=lambda k: (abs(k - step), k))
    return steps[k] + (step - k) * per_step


@dataclass(frozen=True)
class StragglerState:
    """The decision carried from window to window.

    Attributes:
        streaks: global rank -> windows in a row (up to the latest) in which its lateness exceeded the factor.
        named: the ranks named stragglers now.
    """

    streaks: Mapping[int, int] = field(default_factory=dict)
    named: frozenset[int] = frozenset()


def judge(state: StragglerState, window: WindowLateness, factor: float = DEFAULT_FACTOR,
          windows: int = DEFAULT_WINDOWS) -> StragglerState:
    """The state after one more window.

    A rank late by more than ``factor`` (a fraction of the step time) extends its streak;
    a rank judged and not that late starts again from 0; a rank not judged in this window
    (too few stamps, or a window in which nobody reported a new step) keeps its streak as
    it was. A rank whose streak reaches ``windows`` is named; a named rank stays named
    while its streak lasts (a new attempt starts from ``StragglerState()``).

    Args:
        state: the state after the previous window (``StragglerState()`` at the start of a round).
        window: this window's :func:`window_lateness`.
        factor: lateness threshold, a fraction of the step time (> 0).
        windows: windows in a row that name a rank (>= 1).
    """
    streaks = {rank: n for rank, n in state.streaks.items() if rank not in window.lateness}
    streaks.update({rank: state.streaks.get(rank, 0) + 1 for rank, late in window.lateness.items() if late > factor})
    named = frozenset(rank for rank, n in streaks.items() if n >= windows)
    return StragglerState(streaks, named)


def samples_from_doc(doc: Mapping, base: float) -> dict[int, list[Sample]]:
    """The samples of one node's exchanged document (:func:`doc_of`), times back to seconds since the epoch.

    Malformed entries are skipped (a document is another node's: never trusted to raise).
    """
    out: dict[int, list[Sample]] = {}
    ranks = doc.get("ranks") if isinstance(doc, Mapping) else None
    if not isinstance(ranks, Mapping):
        return out
    for rank, rows in ranks.items():
        try:
            out[int(rank)] = [Sample(int(i), int(k), base + float(t)) for i, k, t in rows]
        except (TypeError, ValueError):
            continue
    return out


def doc_of(samples: Mapping[int, Iterable[Sample]], base: float) -> dict:
    """This node's document for a window's exchange: global rank -> ``[instant, step, time - base]`` rows.

    ``base`` (the window's start, seconds since the epoch) keeps the times short (microseconds kept).
    """
    return {"ranks": {str(rank): [[s.instant, s.step, round(s.time - base, 6)] for s in rows]
                      for rank, rows in samples.items()}}
