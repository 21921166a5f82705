"""Worker that prints ``out <RANK>`` to stdout and ``err <RANK>`` to stderr, then dumps its env like env_dump.py."""
import json
import os
import sys

rank = os.environ["RANK"]
print(f"out {rank}", flush=True)
print(f"err {rank}", file=sys.stderr, flush=True)
out = sys.argv[1]
name = f"env_{rank}_{os.environ.get('TORCHELASTIC_RESTART_COUNT', 'x')}.json"
with open(os.path.join(out, name + ".tmp"), "w") as f:
    json.dump({"env": dict(os.environ), "argv": sys.argv}, f)
os.replace(os.path.join(out, name + ".tmp"), os.path.join(out, name))
