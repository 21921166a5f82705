"""An ``elaunch`` agent (``python -m elaunch``'s argv) that reports work done inside a notice's signal handler.

Spies (they call the real function) on what a notice leads to: writing an event
(``EventLog.emit``), signalling (``os.kill``, ``os.killpg``) and logging
(``logging.Logger.handle``). Each call made while a frame of the Python handler of
SIGUSR1 or SIGUSR2 is on the stack appends one line to the file ``$NOTICE_SPY_OUT``
(``emit notice``, ``killpg 10``...): the handler must only record.
"""

from __future__ import annotations

import logging
import os
import signal
import sys

from elaunch.agent import events

OUT = os.environ["NOTICE_SPY_OUT"]
NOTICES = (signal.SIGUSR1, signal.SIGUSR2)


def _in_handler() -> bool:
    codes = set()
    for sig in NOTICES:
        handler = signal.getsignal(sig)
        code = getattr(getattr(handler, "__func__", handler), "__code__", None)
        if code is not None:
            codes.add(code)
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code in codes:
            return True
        frame = frame.f_back
    return False


def _report(what: str) -> None:
    fd = os.open(OUT, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, f"{what}\n".encode())
    finally:
        os.close(fd)


def _spy(owner, name: str, describe) -> None:
    real = getattr(owner, name)

    def spy(*args, **kwargs):
        if _in_handler():
            _report(describe(*args, **kwargs))
        return real(*args, **kwargs)

    setattr(owner, name, spy)


_spy(events.EventLog, "emit", lambda self, kind, *a, **k: f"emit {kind}")
_spy(os, "kill", lambda pid, sig: f"kill {sig}")
_spy(os, "killpg", lambda pgid, sig: f"killpg {sig}")
_spy(logging.Logger, "handle", lambda self, record: f"log {record.getMessage()[:80]}")

if __name__ == "__main__":
    from elaunch.cli import main

    sys.argv[0] = "elaunch"
    main()
