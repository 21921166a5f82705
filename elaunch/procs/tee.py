"""Copy tee'd worker log files to the agent's console, each line prefixed.

Mirrors torch's ``TailLog`` (tee = redirect to the file + follow the file), with
one thread for all files instead of one per file, and partial lines held back
until their newline (or the end) so prefixes never land mid-line.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import TextIO

log = logging.getLogger(__name__)

POLL_INTERVAL = 0.05  # seconds between looks at the followed files


class _Follow:
    def __init__(self, path: str, dst: TextIO, prefix: str) -> None:
        self.path, self.dst, self.prefix = path, dst, prefix
        self.fh = None
        self.partial = b""

    def pump(self, final: bool) -> None:
        if self.fh is None:
            try:
                self.fh = open(self.path, "rb")  # noqa: SIM115 - closed in close()
            except FileNotFoundError:
                return
        data = self.fh.read()
        if not data and not (final and self.partial):
            return
        data = self.partial + data
        lines = data.split(b"\n")
        self.partial = lines.pop()
        if final and self.partial:
            lines.append(self.partial)
            self.partial = b""
        if lines:
            text = "".join(f"{self.prefix}{line.decode('utf-8', 'replace')}\n" for line in lines)
            try:
                self.dst.write(text)
                self.dst.flush()
            except (OSError, ValueError):  # console closed: keep the files, drop the copy
                pass

    def close(self) -> None:
        if self.fh is not None:
            self.fh.close()
            self.fh = None


class Tee:
    """Follow files and copy their new lines, prefixed, to console streams.

    Args:
        follows: ``(path, destination stream, prefix)`` triples; files need not exist yet.
        interval: seconds between polls of the files.
    """

    def __init__(self, follows: list[tuple[str, TextIO, str]], interval: float = POLL_INTERVAL) -> None:
        self._follows = [_Follow(p, d, pre) for p, d, pre in follows]
        self._interval = interval
        self._done = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> "Tee":
        """Start the follower thread (no-op when there is nothing to follow)."""
        if self._follows and self._thread is None:
            self._thread = threading.Thread(target=self._run, name="elaunch-tee", daemon=True)
            self._thread.start()
        return self

    def _run(self) -> None:
        try:
            while not self._done.wait(self._interval):
                for f in self._follows:
                    f.pump(final=False)
        except Exception:  # never take the agent down for a console copy
            log.exception("tee of worker logs failed")

    def stop(self) -> None:
        """Copy whatever is left (including a last unterminated line) and stop. Idempotent."""
        self._done.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        for f in self._follows:
            try:
                f.pump(final=True)
            except OSError:
                pass
            f.close()
        self._follows = []


def follows_for(
    files: dict[int, str], dst: TextIO, prefixes: dict[int, str], unprefixed: frozenset[int] | set[int] = frozenset()
) -> list[tuple[str, TextIO, str]]:
    """Build Tee triples for ``files`` (local rank -> path).

    The prefix is ``prefixes[local_rank]`` (default ``[<local_rank>]:``), or "" for the
    local ranks in ``unprefixed``.
    """
    return [
        (path, dst, "" if lr in unprefixed else prefixes.get(lr, f"[{lr}]:"))
        for lr, path in sorted(files.items())
        if path != os.devnull
    ]
