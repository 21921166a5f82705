"""The persisted checkpoint layout: plain ``torch.save`` files that torch alone loads.

Written by the agent's persister (``--checkpoint-dir``) and, without elaunch's shared
memory (torchrun, no launcher), by the worker itself::

    DIR/step_<step:012d>/rank_<rank>_of_<world_size>.pt

Each file is ``torch.save({"step": int, "rank": int, "world_size": int, "replicated": bool,
"state": <the state>})``, so ``torch.load(path, weights_only=False)["state"]`` is all a user
who leaves elaunch needs. A file is written as ``.rank_..pt.tmp-<pid>`` beside it, fsynced,
renamed into place (``os.replace``) and its directory fsynced: a reader sees a whole file
or none, and names starting with ``.`` (a writer killed midway) are never read.

A step is *complete* when every rank ``0 .. world_size-1`` of one world size has its
file, or, for replicated state (the same on every rank, DDP), when any file is there.
Pruning keeps the newest complete step: the previous checkpoint stays until the new one
is complete.

torch is imported inside the functions that need it.
"""

from __future__ import annotations

import os
import re
import shutil
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


def load_rank_file(path: str, map_location=None) -> dict:
    """The dict a rank file holds (keys ``step``, ``rank``, ``world_size``, ``replicated``, ``state``).

    Uses ``torch.load(weights_only=False)``: a state may hold any picklable leaf, and these
    are the job's own files. ``map_location`` is ``torch.load``'s.

    Raises:
        OSError: the file cannot be read. Exception: torch cannot load it.
    """
    import torch

    return torch.load(path, map_location=map_location, weights_only=False)


def _is_replicated(path: str) -> bool:
    import torch

    st = os.stat(path)
    key = (path, st.st_mtime_ns, st.st_size)
    if key not in _REPLICATED:  # mmap: the structure is read, not the tensors' bytes
        _REPLICATED[key] = bool(torch.load(path, mmap=True, weights_only=False, map_location="cpu")["replicated"])
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
            except (OSError, RuntimeError, KeyError, EOFError):
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
