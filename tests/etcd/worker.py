"""Worker for the etcd job tests (no torch).

argv[1]: output dir. Writes env_<RANK>_<restart>.json, then waits (up to 120 s) for
<out>/go_<restart>, then exits 0 -- or 1 when ``--fail-first`` is given and this is
restart 0 (every agent restarts: a new rendezvous round).
"""
import json
import os
import sys
import time

out = sys.argv[1]
restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
rank = os.environ["RANK"]
path = os.path.join(out, f"env_{rank}_{restart}.json")
with open(path + ".tmp", "w") as f:
    json.dump({"env": dict(os.environ), "pid": os.getpid()}, f)
os.replace(path + ".tmp", path)
deadline = time.monotonic() + 120
while not os.path.exists(os.path.join(out, f"go_{restart}")) and time.monotonic() < deadline:
    time.sleep(0.05)
sys.exit(1 if "--fail-first" in sys.argv and restart == "0" else 0)
