"""A warm spare's main program: ``python -u <this file> <fd> <sys.path[0]> <modules> [<nice> [<lock fd>]]``.

Started by ``elaunch.procs.warm`` while a worker group runs. It puts the cold
worker's ``sys.path[0]`` in place, imports ``<modules>`` (comma-separated, e.g.
``torch``) in a thread of the lowest CPU priority (nice 19), and blocks reading pipe
``fd`` meanwhile. The spare starts as the group it serves next starts: importing torch
there at normal priority took seconds of CPU from the new group's own start (3 test
hosts on 2 cores: about 3 s of CPU per spare). At nice 19 the import runs on idle CPU
only; the main thread, which later runs the worker, keeps its priority (Linux nice is
per thread, and an unprivileged process could never raise it back). A thread's nice value
ranks it only within its autogroup (Linux's ``CONFIG_SCHED_AUTOGROUP``: one scheduling group per
session, and every spare leads its own), and each autogroup gets an equal share of the CPU: the
importing templates of a node took half of its 2 cores from the workers of the group that had just
started. So the importing process also lowers its session's autogroup to ``<nice>``
(``/proc/self/autogroup``) and raises it back to 0 once the imports end (:func:`_autogroup_nice`),
before it forks or runs a worker. The spares of a
node's first attempt start before any group runs and import at ``<nice>`` 0. A handoff waits for
the import to finish: by then the group the spare replaces has stopped. The agent writes one handoff and
closes the pipe; the handoff is NUL-separated, file-system-encoded strings:

    mode  target  N  arg_1 .. arg_N  M  orig_1 .. orig_M  key_1 value_1 ...

``mode`` is ``script`` (run the file ``target`` as ``python script.py`` does) or
``module`` (run ``target`` as ``python -m`` does, through runpy); the args are
the script's arguments, ``orig`` the cold worker's whole argv (``sys.orig_argv``)
and the pairs its complete environment, which replaces ``os.environ``. End of
file without a handoff means "not needed": the spare exits 0 silently.

A spare of function workers holds a barrier lock from its start (``<lock fd>``, or a
fourth descriptor with a template's request): the handoff's ``ELAUNCH_RETURN_BARRIER``
then names this spare's descriptor (``elaunch.procs.return_barrier``).

While it waits, a spare runs the hook the agent named in ``ELAUNCH_WARM_HOOK``
(``module:function``, called with a wait in seconds): the checkpoint keeper names the
mapping of the spare's snapshot slots (``elaunch.checkpoint.spare``).

Stdlib only and nothing beyond what the interpreter has loaded at start-up, so
the worker's ``sys.modules`` is the cold worker's plus ``<modules>``.
"""

import _thread
import os
import sys

#: default nice value of the importing thread: the lowest priority an unprivileged thread can take
IMPORT_NICE = 19
#: elaunch.procs.return_barrier.ENV (this file imports nothing of elaunch's): ``<fd>:<rank file>``
_BARRIER_ENV = b"ELAUNCH_RETURN_BARRIER"
#: elaunch.procs.warm.WARM_HOOK_ENV: ``module:function``, called with a wait in seconds while the spare waits
_HOOK_ENV = "ELAUNCH_WARM_HOOK"


def _read_all(fd):
    chunks = []
    while True:
        chunk = os.read(fd, 1 << 20)
        if not chunk:
            break
        chunks.append(chunk)
    os.close(fd)
    return b"".join(chunks)


def _decode(data):
    fields = data.split(b"\0")
    mode, target = os.fsdecode(fields[0]), os.fsdecode(fields[1])
    n = int(fields[2])
    args = [os.fsdecode(f) for f in fields[3 : 3 + n]]
    at = 3 + n
    m = int(fields[at])
    orig = [os.fsdecode(f) for f in fields[at + 1 : at + 1 + m]]
    pairs = fields[at + 1 + m :]
    env = dict(zip(pairs[0::2], pairs[1::2]))
    return mode, target, args, orig, env


def _hand_lock(env, lock):
    """Point the handoff's barrier variable at this spare's lock descriptor ``lock`` (None: it holds none).

    A lock the worker does not use is closed; a barrier variable without a lock is
    dropped (the worker then does not wait; the agent starts such workers cold).
    """
    value = env.get(_BARRIER_ENV)
    if value is not None and lock is not None:
        env[_BARRIER_ENV] = b"%d:%s" % (lock, value.partition(b":")[2])
    elif lock is not None:
        os.close(lock)
    elif value is not None:
        del env[_BARRIER_ENV]


def _run_script(path, args):
    """Run ``path`` in a fresh ``__main__``, as ``python path args`` does."""
    main = type(sys)("__main__")
    abspath = os.path.abspath(path)
    loader = sys.modules["_frozen_importlib_external"].SourceFileLoader("__main__", abspath)
    main.__dict__.update(
        __file__=abspath, __loader__=loader, __spec__=None, __package__=None, __cached__=None,
        __builtins__=sys.modules["builtins"], __annotations__={},
    )
    sys.argv = [path, *args]
    sys.modules["__main__"] = main
    with open(abspath, "rb") as f:
        source = f.read()
    code = compile(source, abspath, "exec", dont_inherit=True)
    exec(code, main.__dict__)


def _run_module(name, args):
    """Run module ``name`` as ``python -m name args`` does (runpy replaces sys.argv[0])."""
    import runpy

    sys.argv = ["-m", *args]
    runpy._run_module_as_main(name, True)


_IMPORTER = []  # the importing thread's (ident, native id): threading may keep an entry for it after it ended
#: Seconds the template waits for its importing thread to be gone (it released ``done`` and is exiting).
THREAD_EXIT_WAIT = 10.0


def _importer_gone(wait):
    """True once the importing thread no longer exists (the kernel's view), waiting up to ``wait`` seconds.

    It releases ``done`` and then still runs its exit (``pthread_exit`` unwinds it, taking
    the C library's and the unwinder's locks); a fork meanwhile could copy such a lock,
    held, into every spare.
    """
    import time

    deadline = time.monotonic() + wait
    while any(os.path.exists(f"/proc/self/task/{tid}") for _ident, tid in _IMPORTER):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.001)
    return True


#: Linux's nice value of this process's autogroup (its session's scheduling group), where the kernel has them.
AUTOGROUP = "/proc/self/autogroup"
#: Seconds the importing thread tries to lower its autogroup: an unprivileged process may change an autogroup's
#: nice value once per 0.1 s, machine-wide (EAGAIN otherwise), and a node starts a template per local rank at once.
AUTOGROUP_LOWER_WAIT = 2.0
#: Seconds it tries to raise it back to 0 before it releases the spare or the template (then the handoff tries again).
AUTOGROUP_RAISE_WAIT = 10.0
_lowered = False  # True while this process's autogroup is lowered


def _autogroup_nice(value, wait=0.0):
    """Set the nice value of this process's autogroup to ``value`` (>= 0), retrying for up to ``wait`` seconds
    while the kernel's rate limit refuses; return True once set.

    Only when this process leads its session (a spare or a template does, as every worker): the autogroup is
    then this process's alone (its children until they lead sessions of their own). False where there is no
    autogroup (a kernel without ``CONFIG_SCHED_AUTOGROUP``), it cannot be written, or the wait ran out. The
    value is raised back by the same call with 0, which Linux allows an unprivileged process (not below 0).
    """
    import time

    if os.getsid(0) != os.getpid():
        return False
    deadline = time.monotonic() + wait
    while True:
        try:
            fd = os.open(AUTOGROUP, os.O_WRONLY)
            try:
                os.write(fd, b"%d" % value)
            finally:
                os.close(fd)
            return True
        except BlockingIOError:  # EAGAIN: another process changed an autogroup less than 0.1 s ago
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.02)
        except OSError:
            return False


def _raise_autogroup(wait):
    """Raise this process's autogroup back to nice 0 if :func:`_import_all` lowered it; True once it is not lowered."""
    global _lowered
    if _lowered and _autogroup_nice(0, wait):
        _lowered = False
    return not _lowered


def _import_all(names, done, nice=IMPORT_NICE, premap=True):
    """Import ``names`` at nice ``nice`` (this thread, and this process's autogroup while it imports;
    0: left as is), then the spare's hook's module
    (:func:`_hook`; a template's spares inherit it, and what it imports, instead of each importing it
    as the group it serves next starts) and run the hook (``premap``: a spare, not a template), then
    raise the autogroup back and release ``done``."""
    global _lowered
    _IMPORTER.append((_thread.get_ident(), _thread.get_native_id()))
    try:
        try:
            if nice:
                os.setpriority(os.PRIO_PROCESS, _thread.get_native_id(), nice)  # Linux: a thread id
        except OSError:
            pass
        if nice > 0 and _autogroup_nice(nice, AUTOGROUP_LOWER_WAIT):
            _lowered = True
        for name in names:
            try:
                __import__(name)
            except Exception:  # noqa: BLE001 - the script meets the same error cold, if it needs the module
                pass
        hook = _hook()
        if premap and hook is not None:
            _run_hook(hook)
    finally:
        _raise_autogroup(AUTOGROUP_RAISE_WAIT)
        done.release()


def _hook():
    """The spare's hook that the agent named in ``ELAUNCH_WARM_HOOK`` (``module:function``), imported; or None.

    The warm pool knows no feature: the checkpoint keeper names its slot pre-mapping
    (``elaunch.checkpoint.spare:premap``). A hook that cannot be imported is no hook.
    """
    spec = os.environ.get(_HOOK_ENV, "")
    module, _, name = spec.partition(":")
    if not (module and name):
        return None
    try:
        import importlib

        return getattr(importlib.import_module(module), name)
    except Exception:  # noqa: BLE001 - the script meets the same error cold, if it needs the module
        return None


def _run_hook(hook, wait=0.0):
    try:
        hook(wait)
    except Exception:  # noqa: BLE001 - a hook only saves the worker time later
        pass


def _hook_later():
    """The hook in a thread of the lowest CPU priority (a forked spare, beside the group it serves next).

    The hook's module is looked up here, in the spare's main thread, before the script
    runs (the template imported it before the fork): a nice-19 thread that imports beside
    the script's main thread could hold a module's import lock while it waits for a CPU.
    """
    hook = _hook()
    if hook is None:
        return

    def run():
        try:
            os.setpriority(os.PRIO_PROCESS, _thread.get_native_id(), IMPORT_NICE)
        except OSError:
            pass
        _run_hook(hook, 60.0)  # a spare forked before the first saves of the workers it replaces

    _thread.start_new_thread(run, ())


def _serve_forks(sock_fd, done):
    """The template's loop (``--template``): fork one spare per request; return a spare's handoff fd.

    Waits for the imports (``done``), then says ``R`` on the socket (``N`` and returns
    None when another Python thread runs or CUDA was initialized: a fork is not safe then; native
    threads, such as OpenBLAS's pool, are left to their libraries' fork handlers). Each request is
    ``F`` and the spare's own variables (NUL-separated name, value pairs: its local rank's
    ``LOCAL_RANK``..., set in its environment once forked, for its hook; one template serves every
    local rank) with three descriptors (the spare's handoff pipe, its stdout and stderr) and
    optionally a fourth (a barrier lock the spare holds from then on);
    the template forks an intermediate child that forks the spare and exits at once,
    so that the spare is re-parented to the agent (a ``PR_SET_CHILD_SUBREAPER``), and
    answers the spare's pid (0: the fork failed), one packet each. In the spare this function returns
    ``(handoff fd, lock fd or None)``, after the spare waited to be the agent's child, took
    ``PR_SET_PDEATHSIG``, its own session and the streams. End of file: returns None.
    """
    import socket
    import threading

    sock = socket.socket(fileno=sock_fd)
    done.acquire()
    agent = os.getppid()
    torch = sys.modules.get("torch")
    cuda = getattr(torch, "cuda", None)
    importers = {ident for ident, _tid in _IMPORTER}
    others = [t for t in threading.enumerate() if t is not threading.main_thread() and t.ident not in importers]
    if not _importer_gone(THREAD_EXIT_WAIT) or others or (cuda is not None and cuda.is_initialized()):
        sock.sendall(b"N")
        return None
    sock.sendall(b"R")
    while True:
        try:
            msg, fds, _flags, _addr = socket.recv_fds(sock, 1 << 20, 4)
        except OSError:
            return None
        if not msg or len(fds) not in (3, 4):
            for fd in fds:
                os.close(fd)
            return None
        pid = _fork_spare(agent, sock, fds)
        if pid is None:  # this process is the spare
            fields = msg.split(b"\0")[1:]
            os.environb.update(zip(fields[0::2], fields[1::2]))
            _hook_later()  # with this spare's own variables
            return fds[0], (fds[3] if len(fds) > 3 else None)
        for fd in fds:
            os.close(fd)
        sock.sendall(b"%d" % pid)


def _fork_spare(agent, sock, fds):
    """Fork the spare through an intermediate child; return its pid (0: failed), or None in the spare.

    The spare writes its pid once it leads its own session (so a signal to its group
    reaches it from the first answer on); the intermediate exits at once, orphaning it.
    """
    r, w = os.pipe()
    try:
        middle = os.fork()
    except OSError:
        os.close(r)
        os.close(w)
        return 0
    if middle == 0:  # the intermediate child: fork the spare and exit at once, orphaning it
        try:
            os.close(r)
            this = os.getpid()
            spare = os.fork()
        except BaseException:  # noqa: BLE001 - never unwinds into the template's loop
            os._exit(1)
        if spare:
            os._exit(0)
        try:
            os.setsid()
            os.write(w, b"%d" % os.getpid())
            os.close(w)
            _become_spare(agent, this, sock, fds)
        except BaseException:  # noqa: BLE001
            os._exit(1)
        return None
    os.close(w)
    answer = _read_all(r)
    os.waitpid(middle, 0)
    return int(answer) if answer else 0


def _become_spare(agent, middle, sock, fds):
    """In the forked spare: wait to be the agent's child, then take ``PR_SET_PDEATHSIG`` and the streams."""
    import ctypes
    import time

    sock.close()
    while os.getppid() == middle:  # until the intermediate child exited and the agent adopted this one
        time.sleep(0.0005)
    ctypes.CDLL(None).prctl(1, 9, 0, 0, 0)  # PR_SET_PDEATHSIG, SIGKILL
    if os.getppid() != agent:
        os._exit(1)  # the agent died, or is not a subreaper: nothing could wait for this process
    for target, fd in ((1, fds[1]), (2, fds[2])):
        os.dup2(fd, target)
        os.close(fd)
    numpy_random = sys.modules.get("numpy.random")
    if numpy_random is not None:  # a cold worker's global RandomState is seeded afresh
        numpy_random.seed()


def main():
    template = sys.argv[1] == "--template"
    args = sys.argv[2:] if template else sys.argv[1:]
    fd, path0, modules = int(args[0]), args[1], args[2]
    nice = int(args[3]) if len(args) > 3 else IMPORT_NICE
    lock = int(args[4]) if len(args) > 4 else None
    if lock is not None:
        os.set_inheritable(lock, False)  # what the imports start does not hold it
    if not getattr(sys.flags, "safe_path", False):  # -P/PYTHONSAFEPATH: nothing was prepended
        sys.path[0] = path0  # what the cold worker has while it imports
    # threading first imported here, in the main thread: imported by the importing thread, it
    # would take that thread (gone once the imports end) for the main one
    __import__("threading")
    done = _thread.allocate_lock()
    done.acquire()
    _thread.start_new_thread(_import_all, ([n for n in modules.split(",") if n], done, nice, not template))
    if template:
        got = _serve_forks(fd, done)  # returns in a forked spare only
        if got is None:
            return 0
        fd, lock = got
        if lock is not None:
            os.set_inheritable(lock, False)
        data = _read_all(fd)
    else:
        data = _read_all(fd)
        done.acquire()  # the imports finished (an empty handoff too: no import left half-done at exit)
    if not data:
        return 0  # discarded by the agent
    _raise_autogroup(AUTOGROUP_RAISE_WAIT)  # a worker never runs lowered while the kernel lets it be raised
    mode, target, args, orig, env = _decode(data)
    _hand_lock(env, lock)
    os.environb.clear()
    os.environb.update(env)
    # the environment this worker starts with, for @restartable (elaunch.procs.launch_env; not imported here:
    # elaunch may not be importable where this bootstrap runs)
    sys._elaunch_launch_env = {os.fsdecode(name): os.fsdecode(value) for name, value in env.items()}
    sys.orig_argv = orig
    try:
        if mode == "module":
            _run_module(target, args)
        else:
            _run_script(target, args)
    except SystemExit:
        raise
    except BaseException as exc:  # as the interpreter reports an uncaught exception in __main__
        tb = exc.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
            tb = tb.tb_next  # hide this bootstrap's frames; runpy's stay, as with -m
        sys.excepthook(type(exc), exc.with_traceback(tb), tb)  # the hook prints exc.__traceback__
        if isinstance(exc, KeyboardInterrupt):
            import signal

            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
