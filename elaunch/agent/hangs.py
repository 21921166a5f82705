"""Hang detection for one node's workers (``--hang-timeout``) and stack dumps on request.

Workers call ``elaunch.progress()`` each step; it bumps a counter in a file this
module creates per local rank (``procs.progress_files``). The agent reads the counters
every monitor tick (no system call), the pure verdict ``decide.hung_ranks`` names
the ranks that went quiet, and the Python stacks of every worker are dumped with
py-spy (or the faulthandler fallback, ``procs.stacks``) into the log directory:
on a hang here, and when another node asks through the rendezvous. torchrun has
no such check (pytorch#122694: a hung job shows no stack).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from typing import Callable

from elaunch.agent.decide import hung_ranks

log = logging.getLogger("elaunch.agent")

#: Seconds one worker's stack dump may take (py-spy, then the fallback: twice at most).
DUMP_TIMEOUT = 10.0


class HangWatch:
    """Progress counters and stack dumps of one agent's workers, across its attempts.

    Args:
        hang_timeout: seconds without progress (after a first ``elaunch.progress()``)
            that make a rank hung; 0 turns detection off (no files are made, and
            stack dumps use py-spy only).
        local_ranks: this node's local ranks.
        clock: monotonic seconds (injectable for tests).

    Raises:
        OSError: the progress files cannot be created.
    """

    def __init__(self, hang_timeout: float, local_ranks: range | list[int],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.hang_timeout = hang_timeout
        self._clock = clock
        self._files = None
        self._watch = None
        self._exit_seen: dict[int, float] = {}  # local rank -> when its exit mark was first seen
        self._exiting: dict[int, float] = {}  # local rank -> seconds exiting, as of the last check
        if hang_timeout > 0:
            from elaunch.procs.progress_files import ProgressFiles, ProgressWatch

            self._files = ProgressFiles(local_ranks)
            self._watch = ProgressWatch()

    def env(self, local_rank: int) -> dict[str, str]:
        """Variables for ``local_rank``'s worker (``ELAUNCH_PROGRESS_FILE``...); {} when off."""
        return self._files.env(local_rank) if self._files is not None else {}

    def new_attempt(self) -> None:
        """Zero the counters and stacks files: a new attempt's workers start afresh."""
        if self._files is not None:
            self._files.reset()
            self._watch.reset()
            self._exit_seen, self._exiting = {}, {}

    def hung(self, exit_codes: Mapping[int, int | None]) -> list[int]:
        """Return the local ranks that hang now (sorted); [] when detection is off.

        A rank's quiet is measured on this agent's monotonic clock from the first
        reading that saw its counter change: a late check (a loaded machine) can
        only see more progress, never less. A worker whose exit mark names a live
        process is exiting, from the first check that saw the mark on: see
        ``decide.hung_ranks``.
        """
        if self._files is None:
            return []
        now = self._clock()
        table = self._watch.update(self._files.read(), now)
        progress = {lr: (p.ever_reported, p.seconds_since_last_change) for lr, p in table.items()}
        marked = [lr for lr, pid in self._files.exit_marks().items() if _alive(pid)]
        self._exiting = {lr: now - self._exit_seen.setdefault(lr, now) for lr in marked}
        return hung_ranks(progress, exit_codes, self.hang_timeout, self._exiting)

    def exiting_for(self, local_rank: int) -> float | None:
        """Seconds ``local_rank``'s worker has been exiting as of the last check; None when it was not."""
        return self._exiting.get(local_rank)

    def counter(self, local_rank: int) -> int:
        """``local_rank``'s progress counter as last read (0 when unknown)."""
        if self._watch is None:
            return 0
        row = self._watch.table().get(local_rank)
        return row.counter if row is not None else 0

    def quiet_for(self, local_rank: int) -> float:
        """Seconds since ``local_rank`` last made progress (0 when unknown)."""
        if self._watch is None:
            return 0.0
        row = self._watch.table().get(local_rank)
        return row.seconds_since_last_change if row is not None else 0.0

    def dump(self, pids: Mapping[int, int], log_root: str | None, label: str, why: str) -> tuple[dict, str | None]:
        """Dump the Python stacks of every worker; write them under ``log_root/stacks/``.

        Args:
            pids: local rank -> worker pid (running workers).
            log_root: the run's log directory (None or ``os.devnull``: not written).
            label: names the file, e.g. ``"round3_rank2"``.
            why: the first line of the file (what asked for the dump).

        Returns:
            (local rank -> ``StackDump``, the file written or None).
        """
        from elaunch.procs.stacks import dump_stacks, process_state

        states = {lr: process_state(pid) for lr, pid in pids.items()}  # before py-spy touches them
        files = self._files.stacks_files() if self._files is not None else None
        dumps = dump_stacks(pids, files, DUMP_TIMEOUT)
        path = None
        if log_root and log_root != os.devnull:
            path = os.path.join(log_root, "stacks", f"{label}_{int(time.time() * 1000)}.txt")
            try:
                os.makedirs(os.path.dirname(path), exist_ok=True)
                with open(path, "w") as f:
                    f.write(why + "\n\n" + format_dumps(dumps, pids, states))
            except OSError as exc:
                log.warning("could not write the stacks to %s: %s", path, exc)
                path = None
        return dumps, path

    def close(self) -> None:
        """Remove the progress files. Idempotent."""
        if self._files is not None:
            self._files.close()


def _alive(pid: int) -> bool:
    """True while ``pid`` exists (a zombie too): an exit mark counts only while its process is exiting."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # EPERM: it exists
    return True


#: Frames that show a worker blocked in a collective, waiting for its peers (py-spy and
#: faulthandler both print the file path): ``torch.distributed`` (a collective, a barrier),
#: and the autograd engine, where DistributedDataParallel's gradient all-reduce waits (its
#: reducer runs in C++ under ``backward``: no ``torch/distributed`` frame is on the stack).
_COLLECTIVE_MARKERS = ("torch/distributed/", "torch\\distributed\\", "torch/autograd/", "torch\\autograd\\")


def waits_on_peer(stack_text: str) -> bool:
    """True when a dumped stack shows the worker inside ``torch.distributed`` or a backward pass (DDP's all-reduce)."""
    return any(marker in stack_text for marker in _COLLECTIVE_MARKERS)


def format_dumps(dumps: Mapping, pids: Mapping[int, int], states: Mapping[int, str] | None = None) -> str:
    """Return the dumps as text: a header per local rank (pid, stopped or not, method) and its stacks."""
    parts = []
    states = states or {}
    for lr in sorted(dumps):
        d = dumps[lr]
        how = d.method + (f" ({d.reason})" if d.reason else "")
        stopped = ", STOPPED (SIGSTOP or a debugger)" if states.get(lr) in ("T", "t") else ""
        parts.append(f"--- local rank {lr} (pid {pids.get(lr, '?')}{stopped}), stacks by {how}\n{d.text.rstrip()}\n")
    return "\n".join(parts)
