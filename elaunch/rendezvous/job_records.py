"""The job-wide records of the rendezvous contract: a published failure and the job's shared facts.

Re-exported by ``elaunch.rendezvous.contract`` (import them from there); kept in a
module of their own so the contract module holds the handler interface.
Stdlib only.
"""

from __future__ import annotations

from dataclasses import dataclass

#: Longest ``FailureRecord.message`` kept in the rendezvous state (characters).
MAX_FAILURE_MESSAGE = 4000


def _clip(text: str) -> str:
    """``text`` cut to :data:`MAX_FAILURE_MESSAGE` characters: its head (what it is) and tail (where)."""
    if len(text) <= MAX_FAILURE_MESSAGE:
        return text
    head = MAX_FAILURE_MESSAGE // 4
    cut = "\n[... cut ...]\n"
    return text[:head] + cut + text[-(MAX_FAILURE_MESSAGE - head - len(cut)):]


@dataclass(frozen=True)
class FailureRecord:
    """One worker failure as published to every agent of the job through the rendezvous.

    Attributes:
        round: the rendezvous round whose workers failed (one failure counts once per round).
        at: when the failure happened, seconds since the epoch (the earliest one of
            a round is its root cause).
        node: the rendezvous node id of the agent that saw it ("" until published).
        host: that agent's host name.
        rank, local_rank: the failed worker's global and local rank (-1 if unknown).
        pid: its process id (-1 if unknown).
        exitcode: its exit status; negative for death by signal (``-signum``).
        message: the error file's traceback, or its stderr tail, or a description
            (at most :data:`MAX_FAILURE_MESSAGE` characters are published: the head and the tail).
        hung: True when the worker was stopped for making no progress (``--hang-timeout``).
        blocked: True for a hung worker that was itself waiting on a peer (its stack
            inside ``torch.distributed``, not stopped, not behind): likely not the
            cause. Any other report of the same round ranks before it as root cause.
        stopped: True for a hung worker found stopped (SIGSTOP, a debugger: process
            state ``T``): the others wait behind it, wherever they are; it ranks before
            any other report of the same round.
    """

    round: int
    at: float
    node: str = ""
    host: str = ""
    rank: int = -1
    local_rank: int = -1
    pid: int = -1
    exitcode: int = 1
    message: str = ""
    hung: bool = False
    blocked: bool = False
    stopped: bool = False

    def to_dict(self) -> dict:
        """Return the record as a JSON-ready dict."""
        return {"round": self.round, "at": self.at, "node": self.node, "host": self.host, "rank": self.rank,
                "local_rank": self.local_rank, "pid": self.pid, "exitcode": self.exitcode,
                "message": _clip(self.message), "hung": self.hung, "blocked": self.blocked,
                "stopped": self.stopped}

    @classmethod
    def from_dict(cls, doc: dict) -> "FailureRecord":
        """Decode :meth:`to_dict`'s output.

        Raises:
            TypeError, ValueError, KeyError: a field is missing or of the wrong type.
        """
        return cls(round=int(doc["round"]), at=float(doc["at"]), node=str(doc.get("node", "")),
                   host=str(doc.get("host", "")), rank=int(doc.get("rank", -1)),
                   local_rank=int(doc.get("local_rank", -1)), pid=int(doc.get("pid", -1)),
                   exitcode=int(doc.get("exitcode", 1)), message=str(doc.get("message", "")),
                   hung=bool(doc.get("hung", False)), blocked=bool(doc.get("blocked", False)),
                   stopped=bool(doc.get("stopped", False)))

    def precedes(self, other: "FailureRecord") -> bool:
        """True when this report is the better root cause of a round than ``other``.

        A worker found stopped beats every other (``stopped``: the others wait behind it,
        while a victim on another node can look behind its own peers); then one that was
        not waiting on a peer beats one that was (``blocked``); then the earlier failure
        (``at``) wins.
        """
        return (not self.stopped, self.blocked, self.at) < (not other.stopped, other.blocked, other.at)


@dataclass(frozen=True)
class JobState:
    """What the rendezvous knows about the whole job (an elaunch addition; torch has none).

    Attributes:
        restarts: failure restarts the job used so far (one per failed round, whichever
            node saw it); every worker of a round gets it as ``TORCHELASTIC_RESTART_COUNT``.
        failure: the root cause of the latest failed round, or None.
        failed: True once an agent declared the job failed (its budget was spent, or
            the failure cannot be fixed by a restart); the rendezvous is then closed.
        succeeded: True once an agent declared the job succeeded (its last round's
            workers all exited 0); the rendezvous is then closed.
        closed: True once the rendezvous is closed: no round forms any more (with
            neither verdict, an agent ended the job on an error of its own).
        dump_id: increases each time an agent asks every agent to dump its workers'
            stacks (a hang was found); 0 = never.
        dump_by: who asked for the latest dump (the hung worker), or None: no dump yet,
            or a person asked (``elaunch status --stacks``; not a hang).
        blame: node ids of the root causes of the latest counted failures, oldest first.
        node: this handler's own node id (compare with ``blame`` and ``failure.node``).
        others: live members of this node's round besides itself.
        min_nodes: the job's minimum number of nodes.
        exclude_after: failures in a row of which a node is the root cause after which it
            sits out (conf ``exclude_after``; 0 = never).
        exclude_cooldown: seconds a node sits out (conf ``exclude_cooldown``).
        lost: set by ``JobChannel.record_failure`` only: the other members of the
            failed round that did not answer after the failure (they left, or their
            agent is dead). The failure was then their loss's doing: a membership
            change, not counted in ``restarts``.
    """

    restarts: int = 0
    failure: FailureRecord | None = None
    failed: bool = False
    succeeded: bool = False
    closed: bool = False
    dump_id: int = 0
    dump_by: FailureRecord | None = None
    blame: tuple[str, ...] = ()
    node: str = ""
    others: int = 0
    min_nodes: int = 1
    exclude_after: int = 0
    exclude_cooldown: float = 0.0
    lost: tuple[str, ...] = ()
