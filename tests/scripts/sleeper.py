"""Worker that records its pid (and a grandchild's) in <dir>, then sleeps.

argv[1]: directory. Flags: --ignore-term (ignore SIGTERM), --grandchild (spawn a
sleeping grandchild), --seconds N (default 600). On SIGTERM (unless ignored) it
writes term_<RANK> and exits 143.
"""
import os
import signal
import subprocess
import sys
import time

out = sys.argv[1]
rank = os.environ.get("RANK", "0")
if "--ignore-term" in sys.argv:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
else:
    def on_term(signum, frame):
        open(os.path.join(out, f"term_{rank}"), "w").close()
        sys.exit(143)
    signal.signal(signal.SIGTERM, on_term)
seconds = float(sys.argv[sys.argv.index("--seconds") + 1]) if "--seconds" in sys.argv else 600.0
pids = [os.getpid()]
child = None
if "--grandchild" in sys.argv:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    pids.append(child.pid)
with open(os.path.join(out, f"pids_{rank}.tmp"), "w") as f:
    f.write(" ".join(map(str, pids)))
os.replace(os.path.join(out, f"pids_{rank}.tmp"), os.path.join(out, f"pids_{rank}"))
time.sleep(seconds)
