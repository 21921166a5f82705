"""Reading what failed workers left behind: error files and stderr logs.

Stdlib only (the agent imports it). The error file is the JSON file a worker
writes to ``TORCHELASTIC_ERROR_FILE`` when its entrypoint is decorated with
``@record`` (ours or torch's). Two shapes exist, both read here:

* torch's current shape, written by ``ErrorHandler.record_exception``::

    {"message": {"message": "ValueError: bad", "errorCode": 1 (optional),
                 "extraInfo": {"py_callstack": "Traceback ...", "timestamp": "1700000000"}}}

* the older string form: ``{"message": "ValueError: bad", "timestamp": 1700000000}``.
"""

from __future__ import annotations

import json
import os
from typing import Any

#: Key set in the dict :func:`read_error_file` returns for a file that exists but
#: cannot be parsed; its ``"message"`` then says why.
UNREADABLE_KEY = "unreadable"

_HEAD_CHARS = 2000


def read_error_file(path: str | None) -> dict | None:
    """Parse a worker's error file.

    Mirrors how torch's ``ProcessFailure`` loads ``error_file`` but never raises:
    torch's agent crashes on a corrupt file, ours reports it.

    Args:
        path: the file's path (``TORCHELASTIC_ERROR_FILE`` of the worker), or None.

    Returns:
        None when ``path`` is None/empty, the file is missing, or it is empty
        (whitespace only). The parsed JSON object when it is one (either shape,
        returned unchanged). Otherwise a dict ``{"message": "<why it is
        unreadable>", "unreadable": True, "content": "<first 2000 chars>"}``.
    """
    if not path:
        return None
    try:
        with open(path, "rb") as fp:
            raw = fp.read()
    except FileNotFoundError:
        return None
    except OSError as exc:
        return _unreadable(path, f"{type(exc).__name__}: {exc}", "")
    text = raw.decode("utf-8", errors="replace")
    if not text.strip():
        return None
    try:
        data = json.loads(text)
    except ValueError as exc:
        return _unreadable(path, f"invalid JSON ({exc})", text)
    if not isinstance(data, dict):
        return _unreadable(path, f"expected a JSON object, got {type(data).__name__}", text)
    return data


def _unreadable(path: str, why: str, text: str) -> dict:
    return {
        "message": f"unreadable error file {path}: {why}",
        UNREADABLE_KEY: True,
        "content": text[:_HEAD_CHARS],
    }


def _message_obj(data: dict | None) -> Any:
    return data.get("message") if isinstance(data, dict) else None


def error_timestamp(data: dict | None) -> float | None:
    """Return when the worker recorded its error, seconds since the epoch.

    Reads ``message.extraInfo.timestamp`` (torch's shape; a string of int seconds)
    or the top-level ``timestamp`` (the older string form).

    Args:
        data: a dict from :func:`read_error_file`, or None.

    Returns:
        The timestamp as a float, or None when absent, unparsable or the file was
        unreadable (torch would use 0 for a missing one, wrongly making it first).
    """
    msg = _message_obj(data)
    if isinstance(msg, dict):
        extra = msg.get("extraInfo")
        value = extra.get("timestamp") if isinstance(extra, dict) else None
    elif isinstance(data, dict) and not data.get(UNREADABLE_KEY):
        value = data.get("timestamp")
    else:
        value = None
    if value is None or isinstance(value, bool):
        return None
    try:
        ts = float(value)
    except (TypeError, ValueError):
        return None
    return ts if ts > 0 else None


def error_message(data: dict | None) -> str:
    """Return the one-line error message (``"ValueError: bad"``) or ``""``."""
    msg = _message_obj(data)
    if isinstance(msg, dict):
        msg = msg.get("message", "")
    return msg if isinstance(msg, str) else ("" if msg is None else str(msg))


def error_traceback(data: dict | None) -> str:
    """Return the recorded Python traceback (``py_callstack``) or ``""``."""
    msg = _message_obj(data)
    if isinstance(msg, dict):
        extra = msg.get("extraInfo")
        if isinstance(extra, dict) and isinstance(extra.get("py_callstack"), str):
            return extra["py_callstack"]
    return ""


def tail_file(path: str | None, lines: int = 20, max_bytes: int = 64 * 1024) -> str:
    """Return the last ``lines`` lines of a text file, e.g. a worker's stderr log.

    Reads at most ``max_bytes`` from the end, so a huge log costs little; a line
    cut by that window is dropped. Undecodable bytes are replaced, trailing
    blank lines removed.

    Args:
        path: the file, or None.
        lines: how many lines to keep (>= 1).
        max_bytes: how many bytes at most to read from the end (>= 1).

    Returns:
        The lines joined by ``"\\n"`` (no trailing newline), or ``""`` when the
        path is None, missing, unreadable or the file is empty.

    Raises:
        ValueError: ``lines`` or ``max_bytes`` is < 1; the message names the value.
    """
    if lines < 1:
        raise ValueError(f"tail_file: lines={lines} must be >= 1")
    if max_bytes < 1:
        raise ValueError(f"tail_file: max_bytes={max_bytes} must be >= 1")
    if not path:
        return ""
    try:
        with open(path, "rb") as fp:
            fp.seek(0, os.SEEK_END)
            size = fp.tell()
            # Read one byte more than the window: it tells whether the window's
            # first line is whole (that byte is a newline) or cut.
            start = max(0, size - max_bytes - 1)
            fp.seek(start)
            raw = fp.read(max_bytes + 1)
    except OSError:
        return ""
    cut = False
    if size > max_bytes:
        cut = raw[:1] != b"\n"
        raw = raw[1:]
    parts = raw.decode("utf-8", errors="replace").splitlines()
    if cut and len(parts) > 1:
        parts = parts[1:]  # first line was cut by the window
    while parts and not parts[-1].strip():
        parts.pop()
    return "\n".join(parts[-lines:])
