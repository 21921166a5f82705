"""The reaper watchdog's main program (run as ``python -S -E <this file> <fd>``).

Reads commands from the agent on pipe ``fd`` (one per line):

* ``w <pid> <start> [<markers>]`` — watch worker ``pid`` (its process group/session
  leader), ``start`` being its /proc start time, guarding against pid reuse;
  ``markers``, hex of the ``NAME=value`` environment entries the worker's
  descendants inherit, joined by NUL bytes (run id, error file, ranks: see
  ``spawn.marker_entries``);
* ``f <pid>`` — forget it (the agent stopped it); ``f *`` — forget all;
* ``d <path>`` — hex of a node directory (``/dev/shm/elaunch-*``, see ``snapshot_dir``)
  to remove once the workers are killed; any other path is ignored;
* ``s`` — write ``s`` to stdout (an ack: every command before it was read).

Between commands it sleeps in ``select`` on the pipe: no periodic work. On
end-of-file (the agent exited, normally or by ``kill -9``) it finds the victims
then: every watched group and session, the live descendants of those, and every
process whose environment carries all the markers of a watched worker (a child
that left its worker's session with ``setsid`` and whose parent died, wherever
it was re-parented), with their descendants. It SIGKILLs them until none is
left, removes the node directories it was given, then exits. A process that cleared its environment *and* left its
worker's session after its parent died is not found. Stdlib only; imports its
siblings ``_proctree`` and ``snapshot_dir`` by path.
"""

import os
import signal
import sys
import time

import _proctree as pt

FINAL_ROUNDS = 50  # kill passes on EOF (each pass rescans; new forks get caught)


def main(fd: int) -> int:
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, signal.SIG_IGN)  # only EOF ends the watch
    watched: dict[int, int] = {}  # pid -> start
    markers: dict[int, frozenset] = {}  # pid -> the env entries its descendants carry
    dirs: list = []  # node directories to remove at the end
    buf = b""
    while True:
        chunk = os.read(fd, 65536)  # blocks until a command or EOF
        if not chunk:
            break
        buf += chunk
        *lines, buf = buf.split(b"\n")
        acks = 0
        for line in lines:
            parts = line.decode("ascii", "replace").split()
            if len(parts) in (3, 4) and parts[0] == "w":
                pid = int(parts[1])
                watched[pid] = int(parts[2])
                entries = frozenset(bytes.fromhex(parts[3]).split(b"\0")) if len(parts) == 4 else frozenset()
                markers[pid] = entries - {b""}
            elif len(parts) == 2 and parts[0] == "d":
                dirs.append(os.fsdecode(bytes.fromhex(parts[1])))
            elif parts == ["s"]:
                acks += 1
            elif len(parts) == 2 and parts[0] == "f":
                if parts[1] == "*":
                    watched.clear()
                    markers.clear()
                else:
                    watched.pop(int(parts[1]), None)
                    markers.pop(int(parts[1]), None)
        if acks:
            try:
                os.write(1, b"s" * acks)
            except OSError:  # the agent is gone; EOF follows
                pass
    if watched:
        _kill_all(watched, [m for m in markers.values() if m])
    if dirs:
        _remove_dirs(dirs)
    return 0


def _remove_dirs(dirs: list) -> None:
    """Remove each node directory of ``dirs`` (after the workers died: nothing writes them any more).

    Those already gone (the agent's ``Reaper.close`` removes them before its end of file) cost
    nothing: ``snapshot_dir`` and its imports are loaded only for one still there.
    """
    dirs = [path for path in dirs if os.path.lexists(path)]
    if not dirs:
        return
    import snapshot_dir

    for path in dirs:
        if snapshot_dir.removable(path):
            snapshot_dir.remove(path)


def _alive_roots(watched: dict, table: dict) -> list:
    return [pid for pid, start in watched.items() if pid in table and table[pid].start == start]


def _environ(pid: int) -> frozenset:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return frozenset(f.read().split(b"\0"))
    except OSError:
        return frozenset()


def _marked(table: dict, markers: list) -> list:
    """Pids of ``table`` whose environment carries every entry of one of ``markers``."""
    if not markers:
        return []
    me = os.getpid()
    found = []
    for pid, p in table.items():
        if pid != me and p.state not in ("Z", "X"):
            env = _environ(pid)
            if any(m <= env for m in markers):
                found.append(pid)
    return found


def _kill_all(watched: dict, markers: list) -> None:
    known: set = set()
    for _ in range(FINAL_ROUNDS):
        pt.killpg(watched, signal.SIGKILL)
        table = pt.scan()
        roots = _alive_roots(watched, table) + _marked(table, markers)
        fam = pt.tree(table, roots=roots, groups=watched, known=known)
        victims = [p for p in fam.values() if p.state not in ("Z", "X")]
        if not victims:
            return
        known.update(p.key for p in victims)
        pt.kill(victims, signal.SIGKILL)
        time.sleep(0.01)


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1])))
