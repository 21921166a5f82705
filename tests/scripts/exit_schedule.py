"""Worker whose exit is scripted as data.

argv[1]: JSON {"<restart>:<rank>": exit_code, ...}; ranks not listed exit 0.
argv[2] (optional): a directory where each start appends "<restart> <rank>\n" to starts.log.
A code of -N means "kill myself with signal N".
"""
import json
import os
import sys

schedule = json.loads(sys.argv[1])
restart = os.environ["TORCHELASTIC_RESTART_COUNT"]
rank = os.environ["RANK"]
if len(sys.argv) > 2:
    with open(os.path.join(sys.argv[2], "starts.log"), "a") as f:
        f.write(f"{restart} {rank}\n")
code = int(schedule.get(f"{restart}:{rank}", 0))
if code < 0:
    os.kill(os.getpid(), -code)
if code:
    print(f"rank {rank} exiting with {code} on purpose", file=sys.stderr)
sys.exit(code)
