"""A scriptable worker for the procs tests (faults as data, via argv).

Options (all optional, applied in this order):
  --out TEXT / --err TEXT   print TEXT to stdout / stderr (flushed)
  --partial TEXT            write TEXT to stdout without a newline
  --env NAME                print "NAME=<value>" to stdout
  --ignore-term             ignore SIGTERM
  --child plain|setsid|daemon
                            start a sleeping grandchild (setsid: in its own session;
                            daemon: in its own session through an intermediate child
                            that exits at once, so it never is this worker's child);
                            it ignores SIGTERM too when --ignore-term is given
  --pidfile PATH            write "<pid> [<grandchild pid>]" to PATH when set up
  --until PATH              then sleep until PATH exists
  --sleep SECONDS           then sleep
  --exit CODE               then exit with CODE (default 0)
  --kill SIGNUM             or kill itself with SIGNUM
"""

import os
import signal
import subprocess
import sys
import time


def main(argv):
    opts = {}
    flags = set()
    it = iter(argv)
    for a in it:
        if a in ("--ignore-term",):
            flags.add(a)
        else:
            opts.setdefault(a, []).append(next(it))
    for text in opts.get("--out", []):
        print(text, flush=True)
    for text in opts.get("--err", []):
        print(text, file=sys.stderr, flush=True)
    for text in opts.get("--partial", []):
        sys.stdout.write(text)
        sys.stdout.flush()
    for name in opts.get("--env", []):
        print(f"{name}={os.environ.get(name)}", flush=True)
    if "--ignore-term" in flags:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    pids = [os.getpid()]
    for mode in opts.get("--child", []):
        code = "import time\nwhile True: time.sleep(1)"
        if "--ignore-term" in flags:
            code = "import signal; signal.signal(signal.SIGTERM, signal.SIG_IGN)\n" + code
        if mode == "daemon":
            pids.append(_daemon(code))
            continue
        child = subprocess.Popen([sys.executable, "-c", code], start_new_session=(mode == "setsid"))
        pids.append(child.pid)
    if "--pidfile" in opts:
        path = opts["--pidfile"][0]
        with open(path + ".tmp", "w") as f:
            f.write(" ".join(map(str, pids)))
        os.replace(path + ".tmp", path)
    for path in opts.get("--until", []):
        while not os.path.exists(path):
            time.sleep(0.02)
    for s in opts.get("--sleep", []):
        time.sleep(float(s))
    if "--kill" in opts:
        os.kill(os.getpid(), int(opts["--kill"][0]))
        time.sleep(60)
    return int(opts.get("--exit", ["0"])[0])


def _daemon(code: str) -> int:
    """Double fork: the sleeper is orphaned microseconds after it is forked; return its pid."""
    r, w = os.pipe()
    mid = os.fork()
    if mid == 0:
        os.setsid()
        pid = os.fork()
        if pid == 0:
            os.execv(sys.executable, [sys.executable, "-c", code])
        os.write(w, str(pid).encode())
        os._exit(0)
    os.close(w)
    os.waitpid(mid, 0)
    with os.fdopen(r) as f:
        return int(f.read())


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
