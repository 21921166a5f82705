"""The control channel's messages: one JSON object per line, each checked for its shape on arrival.

The channel joins each worker that opted in (``elaunch.restartable``) to its agent: a
Unix stream socket in the abstract namespace whose name the agent gives every worker in
:data:`CONTROL_ENV`. The agent knows who speaks by the kernel's peer credentials (the
connecting process's pid must be one of its workers' and its uid the agent's), never by
what a message says, so a worker can only speak for itself. Nothing is unpickled.

Worker -> agent (:data:`WORKER_OPS`):

* ``{"op": "hello"}``: this worker runs under ``restartable``; it can be restarted in process.
* ``{"op": "raised", "error": "<type: text>"}``: its ``main()`` raised (sent at once, before its
  process group is torn down: the failure's time); "ready" follows.
* ``{"op": "ready"}``: its round ended (interrupted after an "abort", or raised); its process
  group is torn down; it waits for "go".

Agent -> worker (:data:`AGENT_OPS`):

* ``{"op": "abort"}``: the round is over: interrupt ``main()``.
* ``{"op": "go", "env": {...}, "stdout": path|null, "stderr": path|null}``: the next
  round's full environment and this attempt's log files: call ``main()`` again.

Stdlib only.
"""

from __future__ import annotations

import json

#: The variable that names the agent's channel (an abstract Unix socket name, without its leading NUL).
CONTROL_ENV = "ELAUNCH_CONTROL"
#: Set ("1") in the environment of a replacement the agent starts before the next round forms (a warm spare
#: handed the dead worker's environment as soon as its death is seen): the wrapper says "hello" and waits for
#: the round's "go" before its first call of ``main()``, like a survivor. Removed from the environment then.
PRESTART_ENV = "ELAUNCH_RESTARTABLE_PRESTARTED"
#: Longest line either side accepts, bytes (a "go" carries a whole environment); a longer one closes the connection.
MAX_LINE = 1 << 20
#: Ops a worker may send.
WORKER_OPS = frozenset({"hello", "raised", "ready"})
#: Ops the agent may send.
AGENT_OPS = frozenset({"abort", "go"})
#: Longest error text a "raised" keeps, characters (the error file has the whole traceback).
MAX_ERROR = 2000


class BadMessage(ValueError):
    """A line that is not a well-formed message of the expected side (its text says what was wrong)."""


def encode(msg: dict) -> bytes:
    """One message as its line (UTF-8 JSON, ``\\n``-terminated)."""
    return json.dumps(msg, separators=(",", ":")).encode() + b"\n"


def decode_worker(line: bytes) -> dict:
    """Parse a worker's line; return ``{"op": ...}`` with only the fields that op has.

    Raises:
        BadMessage: not JSON, not an object, an unknown op or a field of the wrong type.
    """
    msg = _object(line)
    op = msg.get("op")
    if op not in WORKER_OPS:
        raise BadMessage(f"unknown op {str(op)[:40]!r}")
    if op == "raised":
        error = msg.get("error", "")
        if not isinstance(error, str):
            raise BadMessage("raised: error is not a string")
        return {"op": op, "error": error[:MAX_ERROR]}
    return {"op": op}


def decode_agent(line: bytes) -> dict:
    """Parse the agent's line; return ``{"op": ...}`` with its fields.

    Raises:
        BadMessage: not JSON, not an object, an unknown op, or a "go" whose ``env`` is not
            a mapping of str to str or whose log paths are not str or null.
    """
    msg = _object(line)
    op = msg.get("op")
    if op not in AGENT_OPS:
        raise BadMessage(f"unknown op {str(op)[:40]!r}")
    if op == "abort":
        return {"op": op}
    env = msg.get("env")
    if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
        raise BadMessage("go: env is not a mapping of str to str")
    for key in ("stdout", "stderr"):
        if msg.get(key) is not None and not isinstance(msg.get(key), str):
            raise BadMessage(f"go: {key} is not a path or null")
    return {"op": op, "env": env, "stdout": msg.get("stdout"), "stderr": msg.get("stderr")}


def _object(line: bytes) -> dict:
    try:
        msg = json.loads(line)
    except (UnicodeDecodeError, ValueError) as exc:
        raise BadMessage(f"not JSON: {exc}") from exc
    if not isinstance(msg, dict):
        raise BadMessage("not a JSON object")
    return msg


class LineReader:
    """Splits a byte stream into lines of at most :data:`MAX_LINE` bytes.

    Raises (from :meth:`feed`):
        BadMessage: a line grew past :data:`MAX_LINE` without its newline.
    """

    def __init__(self, limit: int = MAX_LINE) -> None:
        self._buf = b""
        self._limit = limit

    def feed(self, data: bytes) -> list[bytes]:
        """Add ``data``; return the complete lines it finished (without their newline)."""
        self._buf += data
        *lines, self._buf = self._buf.split(b"\n")
        if len(self._buf) > self._limit or any(len(line) > self._limit for line in lines):
            raise BadMessage(f"a line longer than {self._limit} bytes")
        return lines
