"""The persister: writes the node's newest committed snapshots to ``--checkpoint-dir`` in the background.

The workers' snapshots (``elaunch.checkpoint.save``) live in the agent's node
directory in ``/dev/shm``; a node that loses power loses them. The persister is
one of the agent's helpers (``helper_process``), never a worker: a child that
imports torch (``_persister_child.py``), runs at low priority (``nice`` 10, one
torch thread) and writes, every ``interval`` seconds and whenever the agent asks
(:meth:`Persister.persist_now`: a worker died, a preemption notice, SIGTERM before
the group stops), the node's newest consistent snapshot in the persisted layout
(``elaunch.checkpoint.persisted``): for sharded state, the newest step every local
rank has committed (a rank one save ahead is not persisted ahead of its peers),
one ``torch.save`` file per rank; for replicated state, the newest step any local
rank committed, one file per node. Each is written to a temporary name,
fsynced and renamed, so a reader never sees a torn file; older steps are pruned
only once the new one is complete, keeping the previous complete step. A child
killed in the middle of a write leaves a temporary file that readers ignore and
the previous checkpoint whole. Its policy is restart (3 times): a persister that
died loses nothing but the write it was doing. A persist that fails (the directory
is full or read-only; the state holds an object of a class the child cannot import,
such as one defined in the training script's ``__main__``) is logged once as a
warning and tried again at the next persist.

torchrun has no counterpart (torch keeps no snapshots); DLRover's flash
checkpoint persists from its agent the same way. Stdlib only: the agent imports
this module.
"""

from __future__ import annotations

import logging
import os
import select
import time

from elaunch.procs.helper_process import HelperProcess

log = logging.getLogger(__name__)

_CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_persister_child.py")
#: Seconds :meth:`Persister.close` lets a write in progress finish before the child is killed.
GRACE = 30.0
#: Restarts of a child that died before the persister is reported (``HelperDied``).
RESTARTS = 3


class Persister:
    """The agent's persister child (see the module docstring).

    Args:
        node_dir: the agent's node directory (``ELAUNCH_CHECKPOINT_SHM``): the
            slots read are ``node_dir/slots/<local_rank>.{0,1}``.
        ckpt_dir: where to write (``--checkpoint-dir``); made if missing.
        interval: seconds between background persists (``--checkpoint-persist-interval``);
            0 or less: only when asked (:meth:`persist_now`).
        reaper: the watchdog (``Reaper``) that kills the child if the agent dies, or None.
        env: the child's environment (default: the agent's).

    Use from the agent's main thread (``PR_SET_PDEATHSIG`` follows the starting thread).
    """

    def __init__(self, node_dir: str, ckpt_dir: str, interval: float, reaper=None,
                 env: dict[str, str] | None = None) -> None:
        self._helper = HelperProcess("checkpoint persister", _CHILD, node_dir, ckpt_dir, repr(float(interval)),
                                     env=env, reaper=reaper, restarts=RESTARTS, grace=GRACE)
        self._done: list[tuple[int, str, float]] = []  # read from the channel, not yet handed out
        self._asked = 0  # the number of the last persist request
        self._error = ""  # the child's last error report

    @property
    def name(self) -> str:
        """How the supervisor (``elaunch.supervision``) and its warnings name it."""
        return self._helper.name

    @property
    def pid(self) -> int | None:
        """The child's process id while it runs, else None."""
        return self._helper.pid

    def start(self) -> None:
        """Start the child (nothing if it runs).

        Raises:
            OSError: it cannot be started.
        """
        self._helper.start()

    def check(self) -> bool:
        """Restart the child if it died (True when it was restarted); call from the agent's monitor.

        Raises:
            HelperDied: it died and its 3 restarts are spent (an ``OSError``).
            OSError: it could not be restarted.
        """
        return self._helper.check()

    def persist_now(self, wait: float | None = None) -> int | None:
        """Ask the child to persist the newest consistent snapshot of the node's ranks now.

        The child finishes a write in progress first. A child found dead is restarted
        first (:meth:`check`).

        Args:
            wait: seconds to block until the child answered; None: do not wait.

        Returns:
            The newest step written between the request and the child's answer (a
            write already under way included), or None: not waiting, nothing new
            to write (every rank's newest consistent step is on disk already, or no
            rank saved), or no answer within ``wait`` seconds (the write goes on).
            What was written is also returned by :meth:`poll_done`.

        Raises:
            HelperDied: the child died and its restarts are spent.
            OSError: the child cannot be reached or restarted.
        """
        self.check()
        chan = self._helper.chan
        if chan is None:
            raise OSError("the checkpoint persister is not running")
        self._asked += 1
        number, before = self._asked, len(self._done)
        chan.send(f"persist {number}".encode("ascii"))
        if wait is None:
            return None
        deadline = time.monotonic() + wait
        while not self._read(deadline - time.monotonic(), until=number):
            if time.monotonic() >= deadline:
                return None
        steps = [step for step, _path, _seconds in self._done[before:]]
        return max(steps) if steps else None

    def poll_done(self) -> list[tuple[int, str, float]]:
        """What the child persisted since the last call, without blocking.

        Returns:
            ``(step, step_dir, seconds)`` per step whose files (this node's) were all
            written, oldest first; ``seconds`` is how long reading and writing took.
        """
        self._read(0.0)
        done, self._done = self._done, []
        return done

    def _read(self, timeout: float, until: int | None = None) -> bool:
        """Read the child's messages for up to ``timeout`` seconds; True once ``ran <until>`` arrived."""
        chan = self._helper.chan
        deadline = time.monotonic() + max(timeout, 0.0)
        while chan is not None:
            ready, _, _ = select.select([chan], [], [], max(deadline - time.monotonic(), 0.0))
            if not ready:
                return False
            try:
                msg = chan.recv(65536).decode("utf-8", "replace")
            except OSError:
                return False
            if not msg:
                return False  # the child died: check() will say so
            if self._take(msg) == until and until is not None:
                return True
        return False

    def _take(self, msg: str) -> int | None:
        """Keep one message of the child; return N for ``ran N``."""
        kind, _, rest = msg.partition(" ")
        if kind == "done":  # done STEP PATH SECONDS (the path may hold spaces)
            step, _, tail = rest.partition(" ")
            path, _, seconds = tail.rpartition(" ")
            self._done.append((int(step), path, float(seconds)))
            self._error = ""
        elif kind == "ran":
            return int(rest)
        elif kind == "error":  # said once while it lasts: the child tries again at each persist
            log.log(logging.DEBUG if rest == self._error else logging.WARNING, "checkpoint persister: %s", rest)
            self._error = rest
        return None

    def private_fds(self) -> tuple[int, ...]:
        """File descriptors a worker forked from the agent must close (the channel to the child)."""
        return self._helper.private_fds()

    def close(self) -> None:
        """Stop the child and reap it; a write in progress gets up to :data:`GRACE` seconds to finish. Idempotent.

        Ask :meth:`persist_now` with ``wait`` first to persist the newest snapshot;
        :meth:`poll_done` still returns what was written before the close.
        """
        if self._helper.chan is not None:
            self._read(0.0)
        self._helper.stop()
