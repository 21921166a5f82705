"""The persisted checkpoint layout: plain ``torch.save`` files that torch alone loads.

Written by the agent's persister (``--checkpoint-dir``) and, without elaunch's shared
memory (torchrun, no launcher), by the worker itself::

    DIR/step_<step:012d>/rank_<rank>_of_<world_size>.pt

Each file is ``torch.save({"step": int, "rank": int, "world_size": int, "replicated": bool,
"state": <the state>})``, so ``torch.load(path)["state"]`` (weights-only, torch's default) is
all a user who leaves elaunch needs; a state holding classes of the user's own needs them
allowed there too (``torch.serialization.add_safe_globals``). A file is written as ``.rank_..pt.tmp-<pid>`` beside it, fsynced,
renamed into place (``os.replace``) and its directory fsynced: a reader sees a whole file
or none, and names starting with ``.`` (a writer killed midway) are never read.

A step is *complete* when every rank ``0 .. world_size-1`` of one world size has its
file, or, for replicated state (the same on every rank, DDP), when any file is there.
Pruning keeps the newest complete step: the previous checkpoint stays until the new one
is complete.

elaunch reads these files with ``torch.load(weights_only=True)`` only: no file runs code
when loaded. This holds for files written by earlier elaunch versions too: they are the
same ``torch.save`` payload (only the in-memory snapshots' meta format changed), so they
load under the same rules. The ``replicated`` flag of a file is read from its pickle's
opcodes (``pickletools``), without unpickling anything, so an agent can tell which steps
are complete whatever classes the state holds.

torch is imported inside the functions that need it.
"""

from __future__ import annotations

import os
import pickle
import pickletools
import re
import shutil
import zipfile
from typing import Any

_STEP_DIR = re.compile(r"^step_(\d{12,})$")
_RANK_FILE = re.compile(r"^rank_(\d+)_of_(\d+)\.pt$")
#: (path, mtime_ns, size) -> the file's "replicated" flag: it is read once per file
_REPLICATED: dict[tuple[str, int, int], bool] = {}


def rank_and_world(path: str) -> tuple[int, int] | None:
    """``(rank, world_size)`` named by a rank file (``rank_<r>_of_<w>.pt``), or None for another name."""
    m = _RANK_FILE.match(os.path.basename(path))
    return (int(m.group(1)), int(m.group(2))) if m else None


def step_dir(directory: str, step: int) -> str:
    """The directory of ``step``'s files under ``directory``."""
    return os.path.join(directory, f"step_{step:012d}")


def rank_file(directory: str, step: int, rank: int, world_size: int) -> str:
    """The path of the file of ``rank`` (of ``world_size``) at ``step``."""
    return os.path.join(step_dir(directory, step), f"rank_{rank}_of_{world_size}.pt")


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_rank_file(directory: str, step: int, rank: int, world_size: int, replicated: bool, state: Any) -> str:
    """Write one rank's state at ``step`` atomically; return the file's path.

    Args:
        directory: the checkpoint directory (made if missing).
        step: the training step (>= 0). rank, world_size: the saving rank and its world size.
        replicated: True when the state is the same on every rank (any file serves any rank).
        state: what ``torch.save`` can write (tensors are saved where they are; the
            persister passes CPU tensors).

    Raises:
        OSError: the file system refused (full, read-only); no partial file is left
            under the final name (the temporary one is removed when possible).
    """
    import torch

    d = step_dir(directory, step)
    made = not os.path.isdir(d)
    os.makedirs(d, exist_ok=True)
    if made:
        _fsync_dir(directory)
    final = rank_file(directory, step, rank, world_size)
    tmp = os.path.join(d, f".{os.path.basename(final)}.tmp-{os.getpid()}")
    payload = {"step": step, "rank": rank, "world_size": world_size, "replicated": replicated, "state": state}
    try:
        with open(tmp, "wb") as f:
            torch.save(payload, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    _fsync_dir(d)
    return final


def load_rank_file(path: str, map_location=None, *, mmap: bool = False) -> dict:
    """The dict a rank file holds (keys ``step``, ``rank``, ``world_size``, ``replicated``, ``state``).

    Uses ``torch.load(weights_only=True)``: whoever wrote the file, loading it runs no
    code; classes of the user's own must be allowed first
    (``torch.serialization.add_safe_globals``). ``map_location`` and ``mmap`` are ``torch.load``'s
    (``mmap=True``: the tensors' bytes are not read).

    Raises:
        UnsafeStateError: the file needs a class weights-only loading does not allow (the
            message names it and how to allow it).
        OSError: the file cannot be read. Exception: torch cannot load it.
    """
    import torch

    from elaunch.checkpoint import UnsafeStateError, _tree

    try:
        return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as exc:
        try:
            names = torch.serialization.get_unsafe_globals_in_checkpoint(path)
        except Exception:  # noqa: BLE001 - not a zip torch can scan: torch's message says why
            names = []
        what = f"it needs {', '.join(n.removeprefix('builtins.') for n in names)}, which" if names else "it holds what"
        raise UnsafeStateError(f"cannot load the persisted checkpoint {path}: {what} weights-only loading (as "
                               f"torch.load(weights_only=True)) does not allow: {_tree.how_to_allow(names)}. "
                               f"({str(exc).splitlines()[0] if str(exc) else exc!r})") from exc


def _flag_from_pickle(path: str) -> bool | None:
    """The payload's ``replicated`` flag, read from the opcodes of the file's ``data.pkl`` (nothing unpickled).

    The payload dict is pickled with its keys in :func:`write_rank_file`'s order, so the
    first string ``"replicated"`` followed by a bool opcode is its flag (``"state"``, the
    only key that can hold user strings, comes last). None when it is not found.
    """
    with zipfile.ZipFile(path) as z:
        name = next((n for n in z.namelist() if n.endswith("/data.pkl") or n == "data.pkl"), None)
        if name is None:
            return None
        with z.open(name) as f:
            previous = None
            for op, arg, _ in pickletools.genops(f):
                if previous == "replicated" and op.name in ("NEWTRUE", "NEWFALSE"):
                    return op.name == "NEWTRUE"
                if previous == "state" or op.name == "STOP":
                    return None
                previous = arg if op.name in ("BINUNICODE", "SHORT_BINUNICODE", "UNICODE") else (
                    previous if op.name in ("BINPUT", "LONG_BINPUT", "MEMOIZE") else None)
    return None


def _is_replicated(path: str) -> bool:
    st = os.stat(path)
    key = (path, st.st_mtime_ns, st.st_size)
    if key not in _REPLICATED:
        flag = _flag_from_pickle(path)
        if flag is None:  # another payload layout: torch alone, weights-only, reads it
            flag = bool(load_rank_file(path, map_location="cpu", mmap=True)["replicated"])  # no tensor bytes read
        _REPLICATED[key] = flag
    return _REPLICATED[key]


def steps(directory: str) -> dict[int, dict[int, dict[int, str]]]:
    """The rank files under ``directory``: ``{step: {world_size: {rank: path}}}`` (temporary files left out)."""
    found: dict[int, dict[int, dict[int, str]]] = {}
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return found
    for name in names:
        m = _STEP_DIR.match(name)
        if not m:
            continue
        try:
            files = os.listdir(os.path.join(directory, name))
        except OSError:  # pruned meanwhile
            continue
        for fname in files:
            named = rank_and_world(fname)
            if named:
                by_world = found.setdefault(int(m.group(1)), {}).setdefault(named[1], {})
                by_world[named[0]] = os.path.join(directory, name, fname)
    return found


def newest_complete(directory: str, at_most: int | None = None) -> tuple[int, dict[int, str], bool] | None:
    """The newest complete step under ``directory`` (no newer than ``at_most`` when given).

    Returns:
        ``(step, {rank: path}, replicated)``, or None when no step is complete. For a
        step written by several world sizes, a complete one of the largest is taken.
    """
    for step, by_world in sorted(steps(directory).items(), reverse=True):
        if at_most is not None and step > at_most:
            continue
        for world, files in sorted(by_world.items(), reverse=True):
            try:
                replicated = _is_replicated(next(iter(files.values())))
            except (OSError, RuntimeError, KeyError, EOFError, zipfile.BadZipFile, ValueError, pickle.PickleError):
                continue  # pruned meanwhile, or not ours
            if replicated or set(range(world)) <= set(files):
                return step, dict(files), replicated
    return None


def prune(directory: str, keep_from_step: int) -> list[int]:
    """Remove every step directory older than ``keep_from_step``; return the steps removed.

    Call it with the newest complete step once a new step is complete, so the previous
    checkpoint stays until then. Directories another pruner removed first are skipped.
    """
    removed = []
    for step in sorted(steps_on_disk(directory)):
        if step < keep_from_step:
            shutil.rmtree(step_dir(directory, step), ignore_errors=True)
            removed.append(step)
    return removed


def steps_on_disk(directory: str) -> list[int]:
    """Every step that has a directory under ``directory`` (complete or not)."""
    try:
        return [int(m.group(1)) for m in map(_STEP_DIR.match, os.listdir(directory)) if m]
    except FileNotFoundError:
        return []
