"""What an agent publishes for ``elaunch status`` beside the rendezvous state (never in it).

Two small JSON documents per node, each in the node's own key of the rendezvous
backend (``JobChannel.publish_node_record``), overwritten in place:

* ``agent``: written when the node's workers start in a round: its pid, the
  round, its global ranks, its ``--max-restarts`` budget, when it joined the
  round, its log directory. One write per round, after the workers are started.
* ``stacks``: its answer to a stack-dump request of ``elaunch status --stacks``:
  every worker's Python stacks, at most :data:`MAX_STACKS_CHARS` characters in all.

Both go out through ``rendezvous.job_channel.publish`` (a daemon thread each). torchrun
publishes nothing of the kind. Stdlib only.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping


#: Most characters of stack text one node publishes for a request, all its workers together.
MAX_STACKS_CHARS = 256_000
#: Most characters of one worker's stacks (its head and tail are kept).
MAX_RANK_CHARS = 64_000


def agent_record(round: int, ranks: list[int], max_restarts: int, restarts: int, role: str,
                 host: str, log_dir: str | None, joined_at: float | None = None) -> dict:
    """Return the ``agent`` document of this node for ``round`` (times in seconds since the epoch)."""
    return {"pid": os.getpid(), "host": host, "round": round, "ranks": list(ranks), "role": role,
            "max_restarts": max_restarts, "restarts": restarts,
            "joined_at": time.time() if joined_at is None else joined_at, "log_dir": log_dir}


def _clip(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    cut = "\n[... cut ...]\n"
    head = limit // 4
    return text[:head] + cut + text[-(limit - head - len(cut)):]


def stacks_record(dump_id: int, round: int, host: str, dumps: Mapping, pids: Mapping[int, int],
                  ranks: Mapping[int, int], path: str | None) -> dict:
    """Return the ``stacks`` document answering request ``dump_id``.

    Args:
        dumps: local rank -> ``procs.stacks.StackDump``.
        pids: local rank -> worker pid.
        ranks: local rank -> global rank (a local rank without one is published as -1).
        path: the stacks file written in the log directory, or None.

    Each worker's text is cut to ``min(MAX_RANK_CHARS, MAX_STACKS_CHARS / workers)`` characters.
    """
    limit = min(MAX_RANK_CHARS, MAX_STACKS_CHARS // max(1, len(dumps)))
    workers = [{"rank": ranks.get(lr, -1), "local_rank": lr, "pid": pids.get(lr, -1), "method": d.method,
                "reason": d.reason, "text": _clip(d.text, limit)} for lr, d in sorted(dumps.items())]
    return {"dump_id": dump_id, "round": round, "host": host, "pid": os.getpid(), "at": time.time(),
            "path": path, "workers": workers}


