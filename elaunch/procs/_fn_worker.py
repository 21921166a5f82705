"""Function workers: a Python callable run as one worker of ``elastic_launch``.

The worker side of :mod:`elaunch.launcher` for a function entrypoint, mirroring
what torch's ``MultiprocessContext`` does with ``torch.multiprocessing``: the
worker's environment is already set, the function is called under ``@record``
(an exception is written to ``TORCHELASTIC_ERROR_FILE`` in torch's format, then
the worker exits 1) and its return value is handed back to the launcher, here
as a pickle file per local rank instead of a multiprocessing queue.

Two ways in, one code path (:func:`run_function`):

* ``start_method="fork"``: the agent forks itself (:mod:`elaunch.procs.forked`)
  and the child calls :func:`run_function` with the function it already holds:
  nothing is pickled, so a function defined in a notebook or as a closure works.
* ``"spawn"``/``"forkserver"``: a fresh interpreter runs
  ``python -u -m elaunch.procs._fn_worker PAYLOAD RESULT`` (:func:`worker_cmd`).
  ``PAYLOAD`` (written by :func:`write_payload`) holds what
  ``multiprocessing``'s spawn start method sends: the caller's ``sys.path``,
  ``sys.argv``, working directory and main module (re-imported as
  ``__mp_main__``, so functions of the caller's ``__main__`` script unpickle,
  behind an ``if __name__ == "__main__":`` guard as with ``multiprocessing``),
  then the pickled ``(fn, args)``.

A worker that returned waits, as torch's ``_wrap`` waits on
``queue_finished_reading_event``, until every local sibling returned or died
(:mod:`elaunch.procs.return_barrier`): none exits while another is still inside
its last collective.

Return values must be picklable (as under torch). Stdlib only: no torch here,
the function's own module imports what it needs.
"""

from __future__ import annotations

import importlib
import os
import pickle
import sys
import traceback
from typing import Any, Callable

#: The worker argv's placeholder for its local rank (``elaunch.spec.LOCAL_RANK_MACRO``).
_LOCAL_RANK = "${local_rank}"


def result_path(directory: str, local_rank: int | str) -> str:
    """Return the file the worker of ``local_rank`` writes its pickled return value to."""
    return os.path.join(directory, f"result_{local_rank}.pkl")


def worker_cmd(payload: str, results_dir: str) -> tuple[str, ...]:
    """Return the argv of a spawned function worker (``${local_rank}`` substituted per worker)."""
    return (sys.executable, "-u", "-m", "elaunch.procs._fn_worker", payload,
            result_path(results_dir, _LOCAL_RANK))


def _preparation_data() -> dict[str, Any]:
    """What ``multiprocessing.spawn.prepare`` needs to make a fresh interpreter look like this one.

    The same keys ``multiprocessing.spawn.get_preparation_data`` fills, minus the
    start method and the authkey: reading the start method would fix this process's
    default ``multiprocessing`` context as a side effect.
    """
    from multiprocessing import process

    path = [process.ORIGINAL_DIR if p == "" else p for p in sys.path]
    data: dict[str, Any] = {"sys_path": path, "sys_argv": list(sys.argv), "dir": os.getcwd(),
                            "orig_dir": process.ORIGINAL_DIR}
    main = sys.modules.get("__main__")
    name = getattr(getattr(main, "__spec__", None), "name", None)
    if name is not None:  # python -m pkg.mod (prepare skips "*.__main__" itself)
        data["init_main_from_name"] = name
    elif getattr(main, "__file__", None):  # python script.py (not a notebook or the REPL)
        data["init_main_from_path"] = os.path.normpath(os.path.join(process.ORIGINAL_DIR or "", main.__file__))
    return data


def write_payload(path: str, fn: Callable[..., Any], args: tuple) -> None:
    """Write a spawned worker's payload: the preparation data, then the pickled ``(fn, args)``.

    Raises:
        pickle.PicklingError, AttributeError, TypeError: ``fn`` or ``args`` cannot be
            pickled (a lambda, a closure: use ``start_method="fork"``), as
            ``multiprocessing`` raises them under torch.
        OSError: the file cannot be written.
    """
    call = pickle.dumps((fn, tuple(args)), protocol=pickle.HIGHEST_PROTOCOL)
    with open(path, "wb") as f:
        pickle.dump(_preparation_data(), f, protocol=pickle.HIGHEST_PROTOCOL)
        pickle.dump(call, f, protocol=pickle.HIGHEST_PROTOCOL)


def _load_payload(path: str) -> tuple[Callable[..., Any], tuple]:
    import multiprocessing.spawn

    with open(path, "rb") as f:
        prep = pickle.load(f)
        call = pickle.load(f)
    multiprocessing.spawn.prepare(prep)
    return pickle.loads(call)


def read_result(path: str) -> Any:
    """Return the return value a worker wrote to ``path`` (in the launcher's process).

    Raises:
        FileNotFoundError: the worker wrote none.
        pickle.UnpicklingError, AttributeError, ImportError: the value cannot be rebuilt here.
    """
    # a spawned worker pickles classes of the caller's main module as "__mp_main__.X";
    # importing multiprocessing makes __mp_main__ an alias of __main__, as for its own results
    importlib.import_module("multiprocessing")
    with open(path, "rb") as f:
        return pickle.load(f)


def _write_atomic(path: str, value: Any) -> None:
    from elaunch.errors.record import write_atomic

    write_atomic(path, lambda f: pickle.dump(value, f, protocol=pickle.HIGHEST_PROTOCOL), binary=True,
                 prefix=".result-")


def _exit_code(exc: SystemExit) -> int:
    """The status the interpreter would exit with for ``exc`` (``sys.exit("text")`` prints it: 1)."""
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code
    print(exc.code, file=sys.stderr)
    return 1


def run_function(load: Callable[[], tuple[Callable[..., Any], tuple]], result: str) -> int:
    """Call the worker's function under ``@record``; write its return value to ``result``.

    Args:
        load: returns ``(fn, args)`` (unpickles them for a spawned worker); an
            error there is recorded like one of ``fn``.
        result: the pickle file for the return value. A file left there by an
            earlier attempt is removed first, so the launcher never reads a stale one.

    With more than one local worker (:data:`elaunch.procs.return_barrier.ENV` set),
    a worker whose status is 0 then waits until every local sibling returned or died.

    Returns:
        The worker's exit status: 0 after writing the result (``sys.exit(0)`` in
        ``fn`` counts as returning None, as torch's ``@record``), 1 when ``fn``
        raised or its return value cannot be pickled (recorded in the error file,
        traceback on stderr), the code of any other ``SystemExit``.

    Raises:
        KeyboardInterrupt: propagated (the caller dies of SIGINT like an interpreter).
    """
    from elaunch.procs import return_barrier

    held = return_barrier.claim()
    code = _call(load, result)
    if code == 0:
        return_barrier.arrive(held)
    return code


def _call(load: Callable[[], tuple[Callable[..., Any], tuple]], result: str) -> int:
    """:func:`run_function` without the wait: call, record, write the result; return the status."""
    from elaunch.errors import ErrorHandler, record

    try:
        os.unlink(result)
    except FileNotFoundError:
        pass
    try:
        fn, args = record(load)()
        value = record(fn)(*args)
    except SystemExit as exc:
        return _exit_code(exc)
    except Exception:
        traceback.print_exc()
        return 1
    try:
        _write_atomic(result, value)
    except Exception as exc:  # an unpicklable return value: torch's worker fails there too
        traceback.print_exc()
        ErrorHandler().record_exception(exc)
        return 1
    return 0


def main(argv: list[str]) -> int:
    """``python -m elaunch.procs._fn_worker PAYLOAD RESULT``: run a spawned function worker."""
    payload, result = argv
    return run_function(lambda: _load_payload(payload), result)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
