"""Worker that writes its environment to <out_dir>/env_<RANK>_<restart>.json and exits.

With ``--wait-for PATH`` it then waits (up to 120 s) until PATH exists before exiting.
"""
import json
import os
import sys
import time

out = sys.argv[1]
name = f"env_{os.environ['RANK']}_{os.environ.get('TORCHELASTIC_RESTART_COUNT', 'x')}.json"
with open(os.path.join(out, name + ".tmp"), "w") as f:
    json.dump({"env": dict(os.environ), "argv": sys.argv}, f)
os.replace(os.path.join(out, name + ".tmp"), os.path.join(out, name))
if "--wait-for" in sys.argv:
    path = sys.argv[sys.argv.index("--wait-for") + 1]
    deadline = time.monotonic() + 120
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.05)
