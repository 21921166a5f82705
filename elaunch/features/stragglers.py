"""The straggler watch's settings: the ``--rdzv-conf`` keys ``straggler_*``, parsed (stdlib only).

``elaunch.config`` resolves them into ``LaunchConfig.stragglers``; the agent's watch
(:mod:`elaunch.agent.straggler_watch`, deciding with :mod:`elaunch.agent.stragglers`)
runs with them. Imports nothing of elaunch.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

#: Default seconds per window (the ``straggler_window`` rdzv-conf key).
DEFAULT_WINDOW = 10.0
#: Default lateness, as a fraction of the step time, above which a window counts against a rank
#: (``straggler_factor``): the rank's own work after the step's last collective takes a quarter
#: of a step longer than the other ranks'.
DEFAULT_FACTOR = 0.25
#: Default windows in a row above the factor that name a straggler (``straggler_windows``).
DEFAULT_WINDOWS = 2


#: The ``--rdzv-conf`` keys of the straggler watch (the agent reads them; the backends never see them).
CONF_KEYS = ("straggler_window", "straggler_factor", "straggler_windows", "straggler_exclude")


@dataclass(frozen=True)
class StragglerSettings:
    """The straggler watch's knobs (``--rdzv-conf`` keys; elaunch only).

    Attributes:
        window: seconds per window (``straggler_window``, default 10; 0 turns the watch off).
            The agents sample :data:`~elaunch.agent.stragglers.SAMPLES_PER_WINDOW` times a window, at the same wall-clock
            instants, and exchange one document per window.
        factor: lateness above which a window counts against a rank, a fraction of the step
            time (``straggler_factor``, > 0, default 0.25).
        windows: windows in a row that name a straggler (``straggler_windows``, an integer >= 1,
            default 2).
        exclude: the node of a named straggler sits out the next round, as a node that failed
            does (``straggler_exclude``, 0 or 1, default 0: only named).
    """

    window: float = DEFAULT_WINDOW
    factor: float = DEFAULT_FACTOR
    windows: int = DEFAULT_WINDOWS
    exclude: bool = False

    @property
    def on(self) -> bool:
        """True unless ``straggler_window=0``."""
        return self.window > 0

    @classmethod
    def from_conf(cls, conf: Mapping[str, object]) -> StragglerSettings:
        """The settings of ``--rdzv-conf`` (keys absent: the defaults).

        Raises:
            ValueError: a bad value; the message names the key and value, e.g.
                ``--rdzv-conf straggler_factor=-1: must be a number > 0 (a fraction of the step time)``.
        """
        def number(key: str, default: float, what: str, zero_ok: bool = False) -> float:
            raw = conf.get(key)
            if raw is None:
                return default
            try:
                value = float(str(raw).strip())
            except ValueError:
                value = math.nan
            if not math.isfinite(value) or value < 0 or (value == 0 and not zero_ok):
                raise ValueError(f"--rdzv-conf {key}={raw}: must be a number {'>= 0' if zero_ok else '> 0'} ({what})")
            return value

        window = number("straggler_window", DEFAULT_WINDOW, "seconds per window; 0: no straggler watch", True)
        factor = number("straggler_factor", DEFAULT_FACTOR, "a fraction of the step time")
        raw = conf.get("straggler_windows")
        windows = DEFAULT_WINDOWS
        if raw is not None:
            try:
                windows = int(str(raw).strip())
            except ValueError:
                windows = 0
            if windows < 1:
                raise ValueError(f"--rdzv-conf straggler_windows={raw}: must be an integer >= 1 (windows in a row)")
        raw = conf.get("straggler_exclude")
        exclude = False
        if raw is not None:
            text = str(raw).strip().lower()
            if text not in ("0", "1", "true", "false"):
                raise ValueError(f"--rdzv-conf straggler_exclude={raw}: must be 0 or 1")
            exclude = text in ("1", "true")
        return cls(window, factor, windows, exclude)
