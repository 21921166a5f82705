"""The node directory: the shared memory an agent owns for its workers' in-memory snapshots.

One per agent run, ``/dev/shm/elaunch-<run id>-<agent pid>/`` (mode 0700), holding

* ``slots/<local_rank>.0`` and ``.1``: each worker's two slot files (the worker
  creates and writes them, ``elaunch.checkpoint.slotfile``);
* ``replicas/``: copies of peers' snapshots (the replica service writes them);
* ``restore/``: what the agent fetched from a peer for the current round.

The agent makes it at the start of its run and removes it at the end (success,
failure, a handled signal); after a ``kill -9`` of the agent its reaper removes it
(``reaper.Reaper.remove_on_exit``), once the workers are dead; one left when the
reaper died too is removed by the next agent that starts on the node (:func:`sweep`), and so
is a progress directory (``elaunch-progress-<random>-<pid>``, ``progress_files``) left the same way.
The reaper runs without ``site`` and imports this module by path: stdlib only, no
package-relative import. torchrun keeps no such thing.
"""

from __future__ import annotations

import logging
import os
import re
import shutil

try:
    from . import _proctree
except ImportError:  # the reaper runs beside this file without the package (python -S): a sibling
    import _proctree

log = logging.getLogger(__name__)

#: Where node directories live: a tmpfs every process of the node can map.
SHM_ROOT = "/dev/shm"
#: Every node directory's name starts with this (the reaper removes nothing else).
PREFIX = "elaunch-"
#: The largest pid Linux hands out (``/proc/sys/kernel/pid_max`` is at most 2**22).
PID_MAX = 1 << 22
#: Every progress directory's name starts with this (``progress_files.ProgressFiles``; it ends
#: with ``-<agent pid>``).
PROGRESS_PREFIX = PREFIX + "progress-"
#: The subdirectories, made with the node directory.
SUBDIRS = ("slots", "replicas", "restore")
_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]")


def dir_name(run_id: str, pid: int) -> str:
    """``elaunch-<run id>-<pid>``, the run id cut to 64 characters of ``[A-Za-z0-9_.-]`` (others become ``_``)."""
    return f"{PREFIX}{_UNSAFE.sub('_', run_id)[:64]}-{pid}"


def removable(path: str, root: str = SHM_ROOT) -> bool:
    """True when ``path`` is a node directory the reaper may remove: ``root/elaunch-*`` itself, no link."""
    real = os.path.realpath(path)
    return (os.path.dirname(real) == os.path.realpath(root) and os.path.basename(real).startswith(PREFIX)
            and real == os.path.abspath(path))


def remove(path: str) -> None:
    """Remove the node directory ``path`` and everything in it; a missing one is fine. Never raises."""
    shutil.rmtree(path, ignore_errors=True)


def _progress_dir(path: str) -> bool:
    """True when ``path`` holds nothing but a progress directory's files (``progress_<n>``, ``stacks_<n>``)."""
    try:
        names = os.listdir(path)
    except OSError:
        return False
    return all(re.fullmatch(r"(progress|stacks)_\d+", name) for name in names)


def sweep(root: str = SHM_ROOT) -> list[str]:
    """Remove the node and progress directories under ``root`` that no agent owns any more; return their paths.

    Such a directory outlives its agent only when its reaper died with it (a whole
    process tree or cgroup killed at once: a test's kill of every descendant, a batch
    system ending the job). One is stale when it has a node directory's parts (or a
    progress directory's files only), is this user's, and the agent pid at the end of
    its name is gone (a live pid, whoever it is, keeps it). Never raises.
    """
    removed = []
    try:
        entries = list(os.scandir(root))
    except OSError:
        return removed
    for entry in entries:
        pid = entry.name.rpartition("-")[2]
        # a name ending in a number no pid can be (Linux's pid_max is at most 2**22) is not an agent's
        if not (entry.name.startswith(PREFIX) and pid.isdigit() and int(pid) <= PID_MAX) or _proctree.exists(int(pid)):
            continue
        try:
            mine = entry.is_dir(follow_symlinks=False) and entry.stat(follow_symlinks=False).st_uid == os.getuid()
        except OSError:
            continue
        if not mine:
            continue
        if (_progress_dir(entry.path) if entry.name.startswith(PROGRESS_PREFIX)
                else all(os.path.isdir(os.path.join(entry.path, sub)) for sub in SUBDIRS)):
            remove(entry.path)
            removed.append(entry.path)
    return removed


class NodeDir:
    """One agent run's node directory (see the module docstring).

    Attributes:
        path: the directory (absolute).
    """

    def __init__(self, path: str) -> None:
        self.path = path

    @classmethod
    def create(cls, run_id: str, pid: int | None = None, root: str = SHM_ROOT) -> "NodeDir | None":
        """Make ``root/elaunch-<run id>-<pid>`` (0700) and its subdirectories; None when it cannot be.

        Node directories whose agents are gone are removed first (:func:`sweep`), and
        a directory of the same name left by an earlier agent of the same pid is
        emptied. When ``root`` is missing or not writable, one warning is logged and
        None returned: the job runs without in-memory checkpoints.

        Args:
            run_id: the job's id (``--rdzv-id``).
            pid: the agent's pid (default: this process's).
            root: the tmpfs (default :data:`SHM_ROOT`).
        """
        path = os.path.join(root, dir_name(run_id, os.getpid() if pid is None else pid))
        for stale in sweep(root):
            log.info("removed %s: its agent is gone", stale)
        try:
            if os.path.lexists(path):
                remove(path)
            os.mkdir(path, 0o700)
            os.chmod(path, 0o700)  # whatever the umask
            for sub in SUBDIRS:
                os.mkdir(os.path.join(path, sub), 0o700)
        except OSError as exc:
            remove(path)
            log.warning("in-memory checkpoints are off: cannot make %s (%s); ckpt.load() returns None "
                        "and ckpt.save() writes to ELAUNCH_CHECKPOINT_DIR", path, exc.strerror or exc)
            return None
        return cls(path)

    @property
    def restore(self) -> str:
        """``restore/``: files fetched from peers for the current round."""
        return os.path.join(self.path, "restore")

    def clear_restore(self) -> None:
        """Delete what an earlier round fetched (its memory is freed once no worker maps it)."""
        try:
            names = os.listdir(self.restore)
        except OSError:
            return
        for name in names:
            try:
                os.unlink(os.path.join(self.restore, name))
            except OSError:
                pass

    def bytes_held(self) -> int:
        """Bytes of the files under the directory (slots, replicas, restore); 0 when gone."""
        total = 0
        for sub in SUBDIRS:
            try:
                with os.scandir(os.path.join(self.path, sub)) as entries:
                    for entry in entries:
                        try:
                            total += entry.stat(follow_symlinks=False).st_blocks * 512
                        except OSError:
                            pass
            except OSError:
                pass
        return total

    def remove(self) -> None:
        """Remove the directory and everything in it. Idempotent, never raises."""
        remove(self.path)
