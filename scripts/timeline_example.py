"""Make docs/timeline-example.svg from a real c10d job with faults (three agents on this machine).

Run: ``PYTHONPATH=. python scripts/timeline_example.py [OUT]``. Two agents start a job
(``--nnodes=2:3``, two workers each, ``--max-restarts=3``, ``--hang-timeout=1.5``); in
round 0 rank 3 exits 7 (restart 1), a third agent joins while round 1 runs (a
membership change, not counted), agent a gets SIGUSR1 (a notice forwarded to its
workers), in round 2 rank 5 hangs (restart 2), round 3 succeeds. Then
``elaunch timeline`` draws the three event logs.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORKER = ROOT / "tests" / "scripts" / "event_demo.py"


def main() -> int:
    out = sys.argv[1] if len(sys.argv) > 1 else str(ROOT / "docs" / "timeline-example.svg")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    logs = Path(tempfile.mkdtemp(prefix="timeline_example_"))
    schedule = json.dumps({"0:3": 7, "1:5": "hang"})
    env = dict(os.environ, PYTHONPATH=str(ROOT))

    def agent(name: str) -> subprocess.Popen:
        return subprocess.Popen(
            [sys.executable, "-m", "elaunch", "--nnodes=2:3", "--nproc-per-node=2", "--rdzv-backend=c10d",
             f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=example", "--rdzv-conf=last_call_timeout=1",
             "--local-addr=127.0.0.1", "--max-restarts=3", "--hang-timeout=1.5", f"--log-dir={logs / name}",
             str(WORKER), schedule, "4"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    a, b = agent("a"), agent("b")

    def started(n: int) -> None:  # wait until agent a started its n-th group
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            text = "".join(f.read_text() for f in (logs / "a").rglob("events.jsonl"))
            if text.count('"kind": "workers_started"') >= n:
                return
            time.sleep(0.05)
        raise TimeoutError(f"agent a did not start group {n}")

    started(2)  # round 1 runs: the third agent joins it (its start-up takes a second or two)
    c = agent("c")
    started(3)  # round 2, three nodes: a notice to agent a
    time.sleep(0.5)
    a.send_signal(signal.SIGUSR1)
    codes = [p.wait(timeout=180) for p in (a, b, c)]
    print("agents exited", codes, "logs in", logs)
    return subprocess.call([sys.executable, "-m", "elaunch", "timeline", str(logs), "-o", out,
                            "--title", "a c10d job with a crash, a scale-up, a notice and a hang"], env=env)


if __name__ == "__main__":
    sys.exit(main())
