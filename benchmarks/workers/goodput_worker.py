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

It also appends ``<time> <phase>`` lines to ``COUNTER_DIR/phases-h<GOODPUT_HOST>-p<pid>``: the
process's creation (``created``), this script's start (``script``: a warm spare's handoff), and the
start and end of each ``train()`` call's slow parts (``init_pg``, ``data``, ``model``, ``restore``,
``ddp``; ``<name>.end`` at each end): with the steps file, where a restart's time goes. A few writes
per ``train()`` call.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import sys
import time
from pathlib import Path

SCRIPT_START = time.time()
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "ddp_digits.py"
#: this worker's test host (the benchmark sets GOODPUT_HOST), in its files' names
HOST = os.environ.get("GOODPUT_HOST", "0")


def phase_stamps(directory: str, example) -> None:
    """Wrap ``example``'s slow calls so that each appends ``<time> <phase>[.end]`` to this process's phases file."""
    import torch.distributed as dist

    fd = os.open(os.path.join(directory, f"phases-h{HOST}-p{os.getpid()}"),
                 os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def stamp(name: str, at: float | None = None) -> None:
        os.write(fd, f"{time.time() if at is None else at:.6f} {name}\n".encode())

    # the process's start in ticks since boot, on this clock (psutil's create_time rounds the boot time to a second)
    with open("/proc/self/stat") as f:
        ticks = int(f.read().rpartition(")")[2].split()[19])
    stamp("created", time.time() - time.clock_gettime(time.CLOCK_BOOTTIME) + ticks / os.sysconf("SC_CLK_TCK"))
    stamp("script", SCRIPT_START)

    def timed(name: str, fn):
        def call(*args, **kwargs):
            stamp(name)
            try:
                return fn(*args, **kwargs)
            finally:
                stamp(name + ".end")
        return call

    example.load_data = timed("data", example.load_data)
    example.make_model = timed("model", example.make_model)
    example.train = timed("train", example.train)
    example.dist = _Proxy(dist, init_process_group=timed("init_pg", dist.init_process_group))
    snapshots = example.snapshots
    example.snapshots = lambda: (lambda m: None if m is None else _Proxy(m, load=timed("restore", m.load)))(snapshots())
    ddp = example.DDP

    class DDP(ddp):
        @functools.wraps(ddp.__init__)  # the example reads DDP.__init__'s parameters (init_sync)
        def __init__(self, *args, **kwargs):
            stamp("ddp")
            super().__init__(*args, **kwargs)
            stamp("ddp.end")

    example.DDP = DDP


class _Proxy:
    """``target`` with some attributes replaced."""

    def __init__(self, target, **replaced):
        self.__dict__.update(replaced)
        self._target = target

    def __getattr__(self, name):
        return getattr(self._target, name)


def counter(directory: str):
    """Return (state, write): ``write()`` puts ``<start> <first step> <steps started>`` (state's) in this process's file."""
    name = (f"w-h{HOST}-r{os.environ.get('RANK', '0')}"
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
    phase_stamps(directory, example)
    real = example.progress_function()

    steps = os.open(os.path.join(directory, f"steps-h{HOST}-p{os.getpid()}"),
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
