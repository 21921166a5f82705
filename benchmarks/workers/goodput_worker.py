"""examples/ddp_digits.py, unchanged, with a step counter the goodput benchmark can read.

``python goodput_worker.py COUNTER_DIR [ddp_digits args...]`` loads the example as a
module and runs its ``main`` with the remaining arguments. The only change is the
per-step hook: the example calls ``progress_function()()`` at the start of every step;
here that call also writes the number of steps this process has started into
``COUNTER_DIR/w-h<GOODPUT_HOST>-r<RANK>-n<WORLD_SIZE>-p<pid>`` (one ``pwrite`` of a
fixed-width line ``<start time> <first step's time> <count>``; the file outlives the process, so the
benchmark reads how far a killed worker got), appends ``<time> <step> <world size>`` (the step
number the example passes, steps since the run's start; ``WORLD_SIZE`` as the round set it) to
``COUNTER_DIR/steps-h<GOODPUT_HOST>-p<pid>`` (the benchmark's in-run estimate of each fault's cost,
``benchmarks.goodput_results.in_run``), and then calls the real ``elaunch.progress`` (hang
detection works as in the plain example).
"""

from __future__ import annotations

import importlib.util
import os
import sys
import time
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "ddp_digits.py"


def counter(directory: str):
    """Return (state, write): ``write()`` puts ``<start> <first step> <steps started>`` (state's) in this process's file."""
    name = (f"w-h{os.environ.get('GOODPUT_HOST', '0')}-r{os.environ.get('RANK', '0')}"
            f"-n{os.environ.get('WORLD_SIZE', '0')}-p{os.getpid()}")
    fd = os.open(os.path.join(directory, name), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    started = time.time()
    state = {"n": 0, "first": 0.0}

    def write() -> None:
        os.pwrite(fd, f"{started:20.6f} {state['first']:20.6f} {state['n']:12d}\n".encode(), 0)

    write()
    return state, write


def main() -> None:
    directory, argv = sys.argv[1], sys.argv[2:]
    spec = importlib.util.spec_from_file_location("ddp_digits", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    state, write = counter(directory)
    real = example.progress_function()

    steps = os.open(os.path.join(directory, f"steps-h{os.environ.get('GOODPUT_HOST', '0')}-p{os.getpid()}"),
                    os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def progress(*args, **kwargs) -> None:  # the example may pass step=...
        step = kwargs.get("step", args[0] if args else None)
        if step is not None:
            os.write(steps, f"{time.time():.6f} {int(step)} {os.environ.get('WORLD_SIZE', '0')}\n".encode())
        state["n"] += 1
        if state["n"] == 1:
            state["first"] = time.time()
        write()
        real(*args, **kwargs)

    example.progress_function = lambda: progress
    sys.argv = [str(EXAMPLE), *argv]
    example.main(argv)


if __name__ == "__main__":
    main()
