"""Worker side of progress reporting: ``elaunch.progress()``.

A training worker calls :func:`progress` once per step. The agent gives each worker
a small zero-filled file (``$ELAUNCH_PROGRESS_FILE``); this module maps it into memory
and bumps a native-endian ``uint64`` at offset 0 on every call. The agent maps the same
file and reads the counter without any system call on either side (see
:mod:`elaunch.procs.progress_files`).

The file's words (native-endian ``uint64``):

* offset 0: the call counter;
* offset 8: the exit mark (below);
* offset 16: the last ``step`` given, plus one (0: no call gave a step);
* offset 24: when the first call was made, microseconds since the epoch (0: not yet).
  Written once, before the counter first moves: the agent dates the node's
  ``training`` event from it, however seldom it looks.
* offset 32: the stamp request: the agent writes 1 to ask for a stamp; the next
  call answers it and writes 0.
* offset 40: the stamped call's step (the last step given, or the call counter
  when no call gave one).
* offset 48: the stamped call's time, nanoseconds since the epoch (``time.time_ns()``).

  The stamp is the straggler watch's input (:mod:`elaunch.agent.stragglers`): every
  agent asks at the same wall-clock instants, so the ranks stamp the same (or the
  next) step, and the watch compares when they did. A clock read costs more than the
  rest of a call (about 20 ns on bare metal, 200 ns in a VM whose TSC reads trap), so
  a call reads the clock only when asked, a few times a second, not once per step.
  The worker writes the step and the time before it clears the request, so an agent
  that sees the request cleared reads that call's pair (x86-64's stores are not
  reordered; elsewhere a rare stale pair is off by one step in one sample, which the
  watch's averages absorb).

Stdlib only, nothing imported at module level beyond ``os``: ``import elaunch`` stays
cheap and never imports torch. ``mmap``, ``atexit``, ``faulthandler`` and ``warnings``
are imported on the first call only.

Guarantees, deliberately weak where strength would cost per call:

* Thread safety: the increment is a read then a write of the mapped word. Threads
  racing on it may lose increments (the counter then grows by less than the number of
  calls). The agent only asks "did it change", so a lost increment is harmless.
* Fork: a child forked after the first call keeps the shared mapping, so its calls
  count for the parent's rank (e.g. a fork-started DataLoader worker that calls
  ``progress()``). It also inherits the stacks signal handler and file. Acceptable: a
  forked child is still part of that rank's work.
* Torn reads: the agent may read the word while a worker writes it; an aligned 8-byte
  store is a single instruction on x86-64 and aarch64, and even a torn value only
  reads as "changed".

Exit mark: the first call also registers an :mod:`atexit` handler that writes this
process's pid into the second word (offset 8) when its interpreter starts to exit
(the program returned, called ``sys.exit`` or died of an uncaught exception). From
then on the rank is on its way out, and the teardown that follows (module cleanup,
torch's and gloo's destructors: seconds on a loaded machine) is not a hang: the agent
stops judging the rank's quiet (see ``decide.hung_ranks``). Only the process that
made the first call marks: a forked child that exits does not.
"""

from __future__ import annotations

import os

#: Path of this worker's progress file (created and zero-filled by the agent).
PROGRESS_FILE_ENV = "ELAUNCH_PROGRESS_FILE"
#: Path of the file faulthandler appends this worker's Python stacks to.
STACKS_FILE_ENV = "ELAUNCH_STACKS_FILE"
#: Number of the signal that makes the worker dump its stacks into the stacks file.
STACKS_SIGNAL_ENV = "ELAUNCH_STACKS_SIGNAL"
#: Bytes of the progress file that this module maps: seven uint64 words (the counter,
#: the exit mark, the step + 1, the first call's time in microseconds, the stamp request,
#: the stamped step, the stamped time in nanoseconds; module docstring).
MAPPED_BYTES = 56
#: Word indexes in the mapped file.
COUNTER, EXIT_MARK, STEP, FIRST_CALL_US, STAMP_ASK, STAMP_STEP, STAMP_NS = 0, 1, 2, 3, 4, 5, 6
#: Prefix of the line written to the stacks file when the signal handler is registered:
#: ``elaunch-stacks pid=<pid> signal=<signum>``. The agent sends the signal only to a pid
#: named on such a line, since the default action of a real-time signal is to terminate.
STACKS_HEADER = "elaunch-stacks"

# Module state. ``_counter`` is the mapped file's four-word memoryview of format "Q" once set up.
_counter = None
_initialised = False
# Kept referenced for the process lifetime: faulthandler writes to this file's fd.
_stacks_file = None


def progress(step: int | None = None) -> None:
    """Record that this rank made progress (call once per training step).

    Args:
        step: the training step just done (an int >= 0, e.g. the optimizer step), or
            None. With a step the agent knows how far the rank got: after a restart
            its ``caught_up`` event marks when the node is back at the step it had
            reached before the failure (the goodput ledger's "restoring" time), and
            the ``worker_exited`` / ``restart`` events carry it. Without one
            (the torchrun-era call), only the call counts.

    The first call reads ``$ELAUNCH_PROGRESS_FILE``; when it is unset or empty,
    this and every later call is a no-op. Otherwise the first call maps the file,
    writes its time, and, when ``$ELAUNCH_STACKS_FILE`` and ``$ELAUNCH_STACKS_SIGNAL``
    are set, registers ``faulthandler`` on that signal so the agent can ask for this
    process's Python stacks without ptrace. Each later call increments the counter
    at offset 0 of the file, with a step stores it at offset 16, and, when the agent
    asked for a stamp (offset 32), stores the step and the call's time (offsets 40, 48).

    Cost: the first call a few system calls (open, fstat, mmap, close, and for the
    stacks file open, write, rt_sigaction); every later call none, about the cost of
    a global lookup, an integer add and a load, one more store with a step, and a clock
    read (vDSO, no system call) only for the few calls a second the agent asks to stamp
    (see ``python -m benchmarks.progress_cost``).

    The first call also registers the exit mark (module docstring): once this
    process exits, the agent no longer judges the rank's quiet as a hang.

    Raises:
        ValueError: ``step`` is negative or above 2**64 - 2; TypeError: it is not an
            integer (a Python or numpy int; a float is refused). Only when the file
            is mapped: without ``$ELAUNCH_PROGRESS_FILE`` the call checks nothing.

    Never raises otherwise: a file that cannot be opened or mapped (missing, shorter
    than 56 bytes, not writable) or a bad signal number issues one
    ``RuntimeWarning`` and disables that part.
    """
    counter = _counter
    if counter is not None:
        # Lost increments under thread races are acceptable (module docstring). No
        # wrap-around mask: 2**64 calls take millennia, and the mask costs ~10 ns.
        counter[0] += 1
        if step is not None:
            try:  # inline (no call): -1 for a negative step makes the store refuse it too
                counter[2] = step + 1 if step >= 0 else -1
            except (TypeError, ValueError):
                _bad_step(step)
        if counter[4]:  # STAMP_ASK (inline: no constant lookup)
            _stamp(counter)
    elif not _initialised:
        _initialise(step)


def _store_step(words: memoryview, step: int) -> None:
    """Write ``step + 1`` at offset 16 (0 stays "no step"); ValueError / TypeError for a bad step."""
    try:
        words[STEP] = step + 1 if step >= 0 else -1
    except (TypeError, ValueError):
        _bad_step(step)


def _stamp(words: memoryview) -> None:
    """Answer the agent's stamp request: the step (or the counter), the time, then clear the request."""
    from time import time_ns  # a few times a second: the import's dictionary lookups do not count

    words[STAMP_STEP] = words[STEP] - 1 if words[STEP] else words[COUNTER]
    words[STAMP_NS] = time_ns()
    words[STAMP_ASK] = 0


def _bad_step(step: object) -> None:
    raise (ValueError if hasattr(step, "__index__") else TypeError)(
        f"elaunch.progress(step={step!r}): step must be an integer from 0 to 2**64 - 2") from None


def _initialise(step: int | None) -> None:
    """First call: map the counter, register the stack dumper, date the first call. Idempotent."""
    global _counter, _initialised
    _initialised = True
    path = os.environ.get(PROGRESS_FILE_ENV)
    if not path:
        return
    try:
        _register_stacks(os.environ.get(STACKS_FILE_ENV), os.environ.get(STACKS_SIGNAL_ENV))
    except (OSError, ValueError, RuntimeError) as exc:
        _warn(f"elaunch.progress(): stack dumps disabled: {exc}")
    try:
        counter = _map_counter(path)
    except (OSError, ValueError) as exc:
        _warn(f"elaunch.progress(): progress reporting disabled: {PROGRESS_FILE_ENV}={path!r}: {exc}")
        return
    import atexit
    import time

    counter[FIRST_CALL_US] = int(time.time() * 1e6)
    counter[0] += 1  # this first call counts too
    _counter = counter
    atexit.register(_mark_exit, counter, os.getpid())
    if step is not None:
        _store_step(counter, step)  # a bad step raises, once the file is set up
    if counter[STAMP_ASK]:
        _stamp(counter)


def _mark_exit(words: memoryview, pid: int) -> None:
    """atexit: write ``pid`` as the exit mark, when this is the process that registered it."""
    if os.getpid() == pid:  # a forked child inherits the handler; its exit is not the rank's
        try:
            words[EXIT_MARK] = pid
        except ValueError:  # the mapping was released
            pass


def _map_counter(path: str) -> memoryview:
    """Map the first 56 bytes of ``path`` read-write, shared; return a ``"Q"`` view of 7 words.

    Raises:
        OSError: the file cannot be opened or mapped.
        ValueError: the file is shorter than 56 bytes.
    """
    import mmap

    fd = os.open(path, os.O_RDWR | getattr(os, "O_CLOEXEC", 0))
    try:
        size = os.fstat(fd).st_size
        if size < MAPPED_BYTES:
            raise ValueError(f"file is {size} bytes, needs at least {MAPPED_BYTES}")
        mapped = mmap.mmap(fd, MAPPED_BYTES, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)  # the mapping outlives the descriptor
    return memoryview(mapped).cast("Q")


def _register_stacks(path: str | None, signum: str | None) -> None:
    """Have ``signum`` make faulthandler append all threads' stacks to ``path``.

    Writes the ``elaunch-stacks pid=... signal=...`` line first, so the agent knows
    this pid handles the signal. Does nothing when either is unset.

    Raises:
        ValueError: ``signum`` is not an integer.
        OSError: the file cannot be opened or written.
        RuntimeError: faulthandler refuses the signal (e.g. SIGKILL).
    """
    global _stacks_file
    if not path or not signum:
        return
    import faulthandler

    number = int(signum)
    # Append mode: the agent finds a new dump past the size it saw before signalling.
    stacks = open(path, "a", encoding="utf-8")  # noqa: SIM115 - must stay open for faulthandler
    try:
        faulthandler.register(number, file=stacks, all_threads=True, chain=False)
        stacks.write(f"{STACKS_HEADER} pid={os.getpid()} signal={number}\n")
        stacks.flush()
    except BaseException:
        faulthandler.unregister(number)
        stacks.close()
        raise
    _stacks_file = stacks


def _warn(message: str) -> None:
    import warnings

    warnings.warn(message, RuntimeWarning, stacklevel=4)
