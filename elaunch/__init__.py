"""elaunch: a drop-in replacement for torchrun, the PyTorch elastic launcher.

:func:`progress` is the one worker-side call: training scripts call it once per step
(``progress()``, or ``progress(step=n)`` to also say which step) so the agent can tell
a hung rank from a slow one, training time from start-up and from steps redone
after a restart (the goodput ledger), and a rank that reports its steps later than the
others (a straggler: call it after the optimizer step). It is loaded on first access
(``elaunch.progress`` or ``from elaunch import progress``), so ``import elaunch``
imports nothing else; loading it imports only the stdlib-only
:mod:`elaunch._worker_progress` (no torch).

:func:`restartable` (``@elaunch.restartable def main(): ...``) opts a script into
in-process restart (:mod:`elaunch.inprocess.worker`); it is loaded the same lazy way
and imports no torch either.
"""

from __future__ import annotations

TYPE_CHECKING = False  # not typing.TYPE_CHECKING: importing typing costs ~2 ms; checkers accept this
if TYPE_CHECKING:
    from ._worker_progress import progress
    from .inprocess.worker import restartable

__version__ = "0.1.0"
__all__ = ["progress", "restartable"]


def __getattr__(name: str):
    """Load :func:`progress` and :func:`restartable` lazily (PEP 562); any other missing name is an AttributeError."""
    if name == "progress":
        from ._worker_progress import progress

        globals()["progress"] = progress
        return progress
    if name == "restartable":
        from .inprocess.worker import restartable

        globals()["restartable"] = restartable
        return restartable
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
