"""Per-call cost of ``elaunch.progress()``: ``python -m benchmarks.progress_cost``.

Prints nanoseconds per call with ``ELAUNCH_PROGRESS_FILE`` set (a real progress
file from :class:`elaunch.procs.progress_files.ProgressFiles`, so the stacks handler is
registered too), set and called with ``step=i``, and unset, next to an empty Python
function call for scale. Each
mode runs in a fresh child process (``progress()`` settles its mode on the first
call), best of ``--repeats`` loops of ``--calls`` calls.

Then, if ``strace`` is installed, the system calls that 100,000 calls make: each
mode's child runs under ``strace -c -f`` twice, making one call or 100,001 calls,
and the difference of the two totals is printed (the first call's set-up and the
interpreter's start-up cancel out). Without strace it says "strace not installed".
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time

STRACE_CALLS = 100_000


def _child(mode: str, calls: int, repeats: int) -> None:
    """Time ``calls`` calls; print the best ns/call. ``mode`` "empty" times a no-op function."""
    if mode == "empty":
        def fn(step=None) -> None:
            pass
    else:
        from elaunch import progress as fn
    fn()  # the first call settles the mode (maps the file) and is not timed
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter_ns()
        if mode == "step":  # progress(step=i): the step's store too (the loop's own cost is in every mode)
            for i in range(calls):
                fn(step=i)
        else:
            for _ in range(calls):
                fn()
        best = min(best, (time.perf_counter_ns() - t0) / calls)
    print(f"{best:.1f}")


def _just_call(calls: int) -> None:
    """Call ``progress()`` ``calls`` times (for strace); nothing else."""
    from elaunch import progress

    for _ in range(calls):
        progress()


def _child_env(mode: str, files) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ELAUNCH_")}
    if mode in ("set", "step"):
        env.update(files.env(0))
    return env


def _run(argv: list[str], env: dict[str, str]) -> str:
    out = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300, check=True)
    return out.stdout.strip()


def _strace_total(strace: str, argv: list[str], env: dict[str, str]) -> int:
    """Total system calls of ``argv`` and its children, from ``strace -c -f``."""
    with tempfile.NamedTemporaryFile("r", suffix=".strace") as report:
        subprocess.run([strace, "-c", "-f", "-o", report.name, *argv], env=env,
                       capture_output=True, timeout=300, check=True)
        for line in report.read().splitlines():
            fields = line.split()
            if fields and fields[-1] == "total":
                return int(fields[3])
    raise RuntimeError("strace -c printed no total line")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=1_000_000, help="calls per timed loop")
    parser.add_argument("--repeats", type=int, default=5, help="timed loops per mode (best is shown)")
    parser.add_argument("--child", choices=("set", "step", "unset", "empty"), help=argparse.SUPPRESS)
    parser.add_argument("--just-call", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.just_call is not None:
        _just_call(args.just_call)
        return 0
    if args.child:
        _child(args.child, args.calls, args.repeats)
        return 0

    from elaunch.procs.progress_files import ProgressFiles

    me = [sys.executable, "-m", "benchmarks.progress_cost"]
    with ProgressFiles([0]) as files:
        print(f"progress() cost, best of {args.repeats} x {args.calls:,} calls, one process per mode")
        for mode, label in (("set", "ELAUNCH_PROGRESS_FILE set"), ("step", "set, progress(step=i)"),
                            ("unset", "ELAUNCH_PROGRESS_FILE unset"), ("empty", "empty function (for scale)")):
            ns = _run([*me, "--child", mode, "--calls", str(args.calls), "--repeats", str(args.repeats)],
                      _child_env(mode, files))
            print(f"  {label:30s} {ns:>8s} ns/call")
        if files.read()[0] == 0:
            raise SystemExit("error: the 'set' child never counted into its progress file")

        strace = shutil.which("strace")
        if strace is None:
            print("strace not installed: no system call count")
            return 0
        print(f"system calls per {STRACE_CALLS:,} calls (strace -c -f, minus a 1-call run)")
        for mode, label in (("set", "ELAUNCH_PROGRESS_FILE set"), ("unset", "ELAUNCH_PROGRESS_FILE unset")):
            env = _child_env(mode, files)
            one = _strace_total(strace, [*me, "--just-call", "1"], env)
            many = _strace_total(strace, [*me, "--just-call", str(STRACE_CALLS + 1)], env)
            # +-1 or 2 is start-up noise (e.g. one more or fewer brk/mmap).
            print(f"  {label:30s} {many - one:>8d}  (totals {many} vs {one})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
