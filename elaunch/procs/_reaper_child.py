"""The reaper watchdog's main program (run as ``python -S -E <this file> <fd>``).

Reads commands from the agent on pipe ``fd`` (one per line):

* ``w <pid> <start>`` — watch worker ``pid`` (its process group/session leader),
  ``start`` being its /proc start time, guarding against pid reuse;
* ``f <pid>`` — forget it (the agent stopped it); ``f *`` — forget all;
* ``s`` — snapshot the watched trees now, then write ``s`` to stdout (an ack).

Every ``SNAPSHOT_INTERVAL`` seconds (``EARLY_INTERVAL`` just after a watch) it records the descendants of the watched
workers, so that one which left the group (``setsid``) and whose parent died is
still known. On end-of-file (the agent exited, normally or by ``kill -9``) it
SIGKILLs every watched group, session, recorded and descendant process until none
is left, then exits. Stdlib only; imports its sibling ``_proctree`` by path.
"""

import os
import select
import signal
import sys
import time

import _proctree as pt

SNAPSHOT_INTERVAL = 1.0  # seconds between tree snapshots while something is watched
EARLY_INTERVAL = 0.1  # ... and during the first EARLY_PERIOD seconds after a watch, when
EARLY_PERIOD = 3.0  # workers start their children (DataLoader workers, daemons)
FINAL_ROUNDS = 50  # kill passes on EOF (each pass rescans; new forks get caught)


def main(fd: int) -> int:
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, signal.SIG_IGN)  # only EOF ends the watch
    watched: dict[int, int] = {}  # pid -> start
    known: dict[int, set] = {}  # pid -> {(pid, start)} of its tree
    buf = b""
    next_snap = 0.0
    acks = 0
    early_until = 0.0
    while True:
        timeout = max(0.0, next_snap - time.monotonic()) if watched else None
        ready, _, _ = select.select([fd], [], [], timeout)
        if ready:
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            buf += chunk
            *lines, buf = buf.split(b"\n")
            for line in lines:
                parts = line.decode("ascii", "replace").split()
                if len(parts) == 3 and parts[0] == "w":
                    watched[int(parts[1])] = int(parts[2])
                    known.setdefault(int(parts[1]), set())
                    next_snap = time.monotonic() + EARLY_INTERVAL
                    early_until = time.monotonic() + EARLY_PERIOD
                elif parts == ["s"]:
                    next_snap = 0.0
                    acks += 1
                elif len(parts) == 2 and parts[0] == "f":
                    if parts[1] == "*":
                        watched.clear()
                        known.clear()
                    else:
                        watched.pop(int(parts[1]), None)
                        known.pop(int(parts[1]), None)
        if watched and time.monotonic() >= next_snap:
            table = pt.scan()
            for pid, start in watched.items():
                fam = pt.tree(table, roots=_alive_roots({pid: start}, table), groups=(pid,), known=known[pid])
                known[pid] = {p.key for p in fam.values()}  # live members only: dead keys dropped
            now = time.monotonic()
            next_snap = now + (EARLY_INTERVAL if now < early_until else SNAPSHOT_INTERVAL)
        if acks:
            try:
                os.write(1, b"s" * acks)
            except OSError:  # the agent is gone; EOF follows
                pass
            acks = 0
    if watched:
        _kill_all(watched, known)
    return 0


def _alive_roots(watched: dict, table: dict) -> list:
    return [pid for pid, start in watched.items() if pid in table and table[pid].start == start]


def _kill_all(watched: dict, known: dict) -> None:
    allknown = set().union(*known.values()) if known else set()
    for _ in range(FINAL_ROUNDS):
        pt.killpg(watched, signal.SIGKILL)
        table = pt.scan()
        fam = pt.tree(table, roots=_alive_roots(watched, table), groups=watched, known=allknown)
        victims = [p for p in fam.values() if p.state not in ("Z", "X")]
        if not victims:
            return
        allknown.update(p.key for p in victims)
        pt.kill(victims, signal.SIGKILL)
        time.sleep(0.01)


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1])))
