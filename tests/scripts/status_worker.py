"""Worker for the ``elaunch status`` tests (no torch).

argv[1]: output dir. Writes started_<RANK>_<restart> (its pid), then, with
``--fail-first``, rank 1 exits 3 on restart 0 (one counted restart); otherwise it
waits in :func:`blocked_in_status_test` until <out>/go exists (at most 300 s) and exits 0.
"""
import os
import sys
import time

out = sys.argv[1]
restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
rank = os.environ["RANK"]
path = os.path.join(out, f"started_{rank}_{restart}")
with open(path + ".tmp", "w") as f:
    f.write(str(os.getpid()))
os.replace(path + ".tmp", path)
if "--fail-first" in sys.argv and restart == "0" and rank == "1":
    sys.exit(3)


def blocked_in_status_test(go: str) -> None:
    deadline = time.monotonic() + 300
    while not os.path.exists(go) and time.monotonic() < deadline:
        time.sleep(0.5)  # a stack dump finds every rank on this line


blocked_in_status_test(os.path.join(out, "go"))
