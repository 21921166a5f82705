"""Hold a handled signal's exception back while the agent forks a process.

The agent's handlers turn a signal into ``SignalException`` (as torch's do), raised
in the main thread wherever it happens to be. Inside a fork that place can be one
of the interpreter's at-fork hooks: logging's releases its module lock there, and
an exception raised in a hook is printed and dropped. The signal is then lost, and
the lock stays held by the main thread: it goes on (the lock is re-entrant), every
other thread that logs blocks forever. Blocking signals in the main thread does
not prevent it: the kernel hands a process's signal to any thread that does not
block it, and the interpreter then runs the handler in the main thread.

So the handlers ask :func:`raise_or_defer` to raise; inside a :func:`deferred`
block it keeps the exception, and the block raises it when it ends, in the
forking code's own frame (which then stops the half-started child). Main thread
only, as signal handlers are. Stdlib only.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

_depth = 0
_held: list[BaseException] = []


@contextmanager
def deferred() -> Iterator[None]:
    """Run the block with handled signals' exceptions held back until it ends.

    Raises:
        BaseException: the first exception a handler passed to
            :func:`raise_or_defer` during the block (e.g. ``SignalException``),
            when the outermost block ends, also over an exception of the block's own.
    """
    global _depth
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1
        if _depth == 0 and _held:
            exc = _held[0]
            _held.clear()
            raise exc


def raise_or_defer(exc: BaseException) -> None:
    """Raise ``exc`` now, or at the end of the :func:`deferred` block running now (from a signal handler).

    Raises:
        BaseException: ``exc``, outside a deferred block.
    """
    if _depth:
        _held.append(exc)
        return
    raise exc
