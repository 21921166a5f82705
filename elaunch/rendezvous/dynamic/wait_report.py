"""What a node waiting in rendezvous is waiting for, said every few seconds.

:func:`describe_wait` is pure: the line for one state (``waiting for nodes: 2/4
joined (min 2, max 4), round closes in 0.8 s``, or that the node waits for the
running round to finish, or for nodes while below MIN). :class:`WaitReporter`
says it as one INFO line every :data:`LOG_EVERY` seconds, or as one line updated in
place when stderr is a terminal; nothing for a round that completes within
:data:`QUIET_FOR` seconds. torchrun says nothing while it waits. Stdlib only.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Callable, TextIO

from elaunch.rendezvous.dynamic.settings import RendezvousSettings
from elaunch.rendezvous.dynamic.state import RendezvousState

log = logging.getLogger("elaunch.rendezvous")

#: Seconds of waiting before the first line (a round that forms sooner prints nothing).
QUIET_FOR = 2.0
#: Seconds between log lines; on a terminal the line is updated every :data:`TTY_EVERY` seconds.
LOG_EVERY = 5.0
TTY_EVERY = 0.5


def describe_wait(state: RendezvousState, settings: RendezvousSettings, me: str, now: float,
                  gives_up_at: float) -> str | None:
    """Return what ``me`` waits for in ``state`` at ``now`` (seconds since the epoch), or None (not waiting).

    Args:
        gives_up_at: when this node's ``join_timeout`` ends (seconds since the epoch).
    """
    if state.closed:
        return None
    s = settings
    bounds = f"(min {s.min_nodes}, max {s.max_nodes})"
    left = max(0.0, gives_up_at - now)
    if state.complete:
        if me in state.participants:
            return None
        if me in state.redundancy_list:
            return (f"waiting as a spare: round {state.round} is running at max_nodes={s.max_nodes} "
                    f"{bounds}; joining when a node leaves")
        return (f"waiting for the running round {state.round} ({len(state.participants)} node(s)) to re-form "
                f"with this node {bounds}; gives up in {left:.0f} s")
    joined = len(state.participants)
    if joined < s.min_nodes:
        return (f"waiting for nodes: {joined}/{s.max_nodes} joined {bounds}, {s.min_nodes - joined} more "
                f"needed to start; gives up in {left:.0f} s")
    closes = "" if state.deadline is None else f", round closes in {max(0.0, state.deadline - now):.1f} s"
    return f"waiting for nodes: {joined}/{s.max_nodes} joined {bounds}{closes}"


class WaitReporter:
    """Says :func:`describe_wait`'s line while one ``next_rendezvous`` waits.

    Args:
        settings: the rendezvous settings.
        node_id: this node's id.
        stream: the terminal to update in place (default ``sys.stderr``), used only
            when it is a TTY and INFO is logged.
        clock: monotonic seconds (the pacing; the state's times are epoch seconds).
    """

    def __init__(self, settings: RendezvousSettings, node_id: str, stream: TextIO | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._settings = settings
        self._me = node_id
        self._stream = stream if stream is not None else sys.stderr
        self._clock = clock
        self._started = 0.0
        self._next = 0.0
        self._on_tty = False  # a line is showing that the next output must end

    def start(self) -> None:
        """A wait begins."""
        self._started = self._clock()
        self._next = self._started + QUIET_FOR

    def update(self, state: RendezvousState, now: float, gives_up_at: float) -> None:
        """Say the line if it is time (``now``, ``gives_up_at``: epoch seconds)."""
        t = self._clock()
        if t < self._next or not log.isEnabledFor(logging.INFO):
            return
        line = describe_wait(state, self._settings, self._me, now, gives_up_at)
        if line is None:
            return
        waited = t - self._started
        if self._tty():
            self._stream.write(f"\r\x1b[K[elaunch] {line} (waited {waited:.0f} s)")
            self._stream.flush()
            self._on_tty = True
            self._next = t + TTY_EVERY
        else:
            log.info("%s (waited %.0f s)", line, waited)
            self._next = t + LOG_EVERY

    def finish(self) -> None:
        """The wait ended: end the updated line, if one is showing."""
        if self._on_tty:
            self._stream.write("\n")
            self._stream.flush()
            self._on_tty = False

    def _tty(self) -> bool:
        try:
            return self._stream.isatty()
        except (AttributeError, ValueError):
            return False
