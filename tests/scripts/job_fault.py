"""Worker whose fate is scripted as data, for job-wide supervision tests.

argv[1]: JSON {"<restart>:<rank>": fate, ...} where restart and rank may be "*";
         the most specific key wins ("r:k", then "r:*", then "*:k", then "*:*");
         no key: exit 0. A fate is an exit code (int; -N = kill myself with signal N),
         "hang" (block forever, as a rank whose collective lost its peer),
         or "hang-progress" (call elaunch.progress() once, then block).
argv[2]: a directory; each start appends "<restart> <rank> <pid> <host>\n" to starts.log.
"""
import json
import os
import socket
import sys
import time

schedule = json.loads(sys.argv[1])
restart = os.environ["TORCHELASTIC_RESTART_COUNT"]
rank = os.environ["RANK"]
with open(os.path.join(sys.argv[2], "starts.log"), "a") as f:
    f.write(f"{restart} {rank} {os.getpid()} {socket.gethostname()}\n")
fate = 0
for key in (f"{restart}:{rank}", f"{restart}:*", f"*:{rank}", "*:*"):
    if key in schedule:
        fate = schedule[key]
        break
if fate in ("hang", "hang-progress"):
    if fate == "hang-progress":
        from elaunch import progress

        progress()
    while True:
        time.sleep(3600)
fate = int(fate)
if fate < 0:
    os.kill(os.getpid(), -fate)
if fate:
    print(f"rank {rank} exiting with {fate} on purpose", file=sys.stderr)
sys.exit(fate)
