"""Worker for event-log tests and the timeline example: lives a while, fails or hangs on schedule.

argv[1]: JSON {"<restart>:<rank>": action}; action an exit code (after half the life),
"hang" (stops calling elaunch.progress() and sleeps), or -N (kill itself with signal N).
argv[2]: seconds each worker lives (default 1.0). Calls elaunch.progress() every 0.05 s.
SIGUSR1 (a notice forwarded by the agent) is noted on stderr; the worker goes on.
"""
import json
import os
import signal
import sys
import time

import elaunch

schedule = json.loads(sys.argv[1])
life = float(sys.argv[2]) if len(sys.argv) > 2 else 1.0
action = schedule.get(f"{os.environ['TORCHELASTIC_RESTART_COUNT']}:{os.environ['RANK']}", 0)
signal.signal(signal.SIGUSR1, lambda *_: print(f"rank {os.environ['RANK']}: notice SIGUSR1", file=sys.stderr))
end = time.monotonic() + (life / 2 if action else life)
while time.monotonic() < end:
    elaunch.progress()
    time.sleep(0.05)
if action == "hang":
    time.sleep(3600)
if isinstance(action, int) and action < 0:
    os.kill(os.getpid(), -action)
sys.exit(int(action))
