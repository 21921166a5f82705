"""The worker's side of in-process restart: ``@elaunch.restartable``.

::

    import elaunch

    @elaunch.restartable
    def main():
        dist.init_process_group("gloo")   # the round's rank, world size and store come from the environment
        snap = ckpt.load(into=state)      # survivors restore the step the job agreed on, from memory
        ...

    if __name__ == "__main__":
        main()

Under an elaunch agent that offers its control channel (``ELAUNCH_CONTROL``), the
wrapper connects to it and says "hello", then calls ``main()``. When the round ends
because of a fault elsewhere on the node or in the job, the agent sends "abort": the
wrapper's control thread tears the process group down (NCCL: torch's
``_abort_process_group``; every backend: the TCP connections this round opened are
shut, so a gloo collective blocked on a peer returns at once with an error) and raises
:class:`RoundAborted` in the thread running ``main()`` (``PyThreadState_SetAsyncExc``,
as nvidia-resiliency-ext's ``inprocess.Wrapper`` does; it lands when the blocked call
returns). A call that waits in a system call (``time.sleep``, a queue's ``get``, a lock,
a socket read) is woken at once: the control thread also sends :data:`WAKE_SIGNAL` to that
thread, whose do-nothing Python handler is where the pending exception lands (the wrapper
installs it only where the script left the signal's default, ignore). The wrapper destroys
what is left of the process group, tells the agent "ready" and waits for "go". When
``main()`` itself raises (an ``Exception``), the wrapper aborts NCCL's communicators and
shuts the round's connections at once (its peers' collectives fail now, not at their
timeout), prints its traceback to stderr as the interpreter would, and reports "raised";
the agent counts it like a worker failure. Either way the wrapper says "ready" once the round is
torn down (a process still tearing down is not handed the next round's rank), and "go" brings the next
round's full environment (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT``, a new
``TORCHELASTIC_RESTART_COUNT``, so a fresh store prefix, the checkpoint restore) and the
attempt's log files; the wrapper sets them and calls ``main()`` again. What the script itself set in
(or removed from) the environment before ``main()``'s first call, told from the environment the process
was started with, is set again on top, as the script would in a fresh worker (``NCCL_*`` read at the
next ``init_process_group``).

A replacement the agent starts before the next round forms (a warm spare handed the dead
worker's environment with :data:`~elaunch.inprocess.wire.PRESTART_ENV`, as soon as the death is
seen) runs the script up to the wrapper, says "hello" and waits for that round's "go" before
its first call, like a survivor: at "go" it is where a survivor is, instead of starting then.

``SystemExit`` and ``KeyboardInterrupt`` end the process as they would without the
wrapper (the agent then replaces the process). Without the channel (torchrun, no
launcher, an agent that does not offer it) ``main()`` is called once, plainly.

Stdlib at import; torch is touched only when a process group is torn down, and only if
the script imported ``torch.distributed``.
"""

from __future__ import annotations

import ctypes
import functools
import gc
import logging
import os
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any, TypeVar

from elaunch.inprocess.wire import CONTROL_ENV, PRESTART_ENV, BadMessage, LineReader, decode_agent, encode
from elaunch.procs.launch_env import launch_environ

log = logging.getLogger("elaunch.inprocess")

_F = TypeVar("_F", bound=Callable[..., Any])

# the wrapper's states (the control thread and the thread running main() share them under a lock)
RUNNING = "running"  # main() runs: an "abort" interrupts it
ABORTING = "aborting"  # the control thread interrupted main()
LEFT = "left"  # main() ended (returned, raised, interrupted): nothing interrupts it any more


#: Sent to the thread running ``main()`` with an "abort": it ends a system call's wait (EINTR), and
#: the interpreter's run of the handler raises the pending :class:`RoundAborted` there. SIGURG: its
#: default action is to ignore it, and training code does not use out-of-band socket data.
WAKE_SIGNAL = signal.SIGURG


class RoundAborted(BaseException):
    """Raised in ``main()``'s thread when the agent ends the round (a fault elsewhere).

    A ``BaseException``, so a script's ``except Exception`` does not swallow it.
    """


def restartable(fn: _F) -> _F:
    """Make ``fn`` (the script's ``main``) restartable in process under elaunch.

    Args:
        fn: the training entry point; it builds its process group and wrappers (DDP,
            FSDP, optimizers) itself, and restores its state with ``elaunch.checkpoint.load``.

    Returns:
        A function with ``fn``'s signature: under elaunch's control channel it calls ``fn``
        once per round until one call returns (its value is returned); elsewhere it is
        ``fn(*args, **kwargs)``.

    Raises:
        Whatever ``fn`` raises when no channel is offered; ``SystemExit`` and
        ``KeyboardInterrupt`` always; the last exception of ``fn`` when the agent went
        away while the wrapper waited for the next round.
    """

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        address = os.environ.get(CONTROL_ENV)
        prestarted = os.environ.pop(PRESTART_ENV, None) == "1"
        control = _Control.connect(address) if address else None
        if control is None:
            if prestarted:  # started for a round whose environment only the channel brings
                raise SystemExit(1)
            return fn(*args, **kwargs)
        try:
            return control.run(fn, args, kwargs, prestarted)
        finally:
            control.close()

    return wrapper  # type: ignore[return-value]


class _Control:
    """One worker's connection to its agent, its control thread, and the round loop."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._lock = threading.Condition()
        self._state = LEFT
        self._main_ident = threading.get_ident()
        self._go: dict | None = None
        self._closed = False
        self._baseline: set[str] = set()  # socket inodes that existed before this round's main()
        self._threads: set[int | None] = set()  # idents of the threads alive when this round's main() began
        self._env_keys = set(os.environ)  # the agent's variables: a new round replaces them
        # what the script set (or unset) itself before main()'s first call: a fresh worker's script would do it
        # again, so each round does (computed once: a value derived from the round's RANK is not derived again)
        launch = launch_environ()
        now = dict(os.environ)
        self._script_env = {} if launch is None else {k: v for k, v in now.items() if launch.get(k) != v}
        self._script_unset = set() if launch is None else set(launch) - set(now)
        _install_wake()
        self._thread = threading.Thread(target=self._listen, name="elaunch-restartable", daemon=True)

    @classmethod
    def connect(cls, address: str) -> "_Control | None":
        """Connect to the agent's channel and say hello; None (a warning) when it cannot be reached."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            sock.connect("\0" + address)
            sock.sendall(encode({"op": "hello"}))
        except OSError as exc:
            sock.close()
            print(f"elaunch.restartable: the agent's control channel is unreachable ({exc}); "
                  "running main() once", file=sys.stderr, flush=True)
            return None
        control = cls(sock)
        control._thread.start()
        return control

    # ------------------------------------------------------------ the thread running main()

    def run(self, fn: Callable, args: tuple, kwargs: dict, prestarted: bool = False) -> Any:
        """Call ``fn`` once per round until it returns; see the module docstring.

        ``prestarted``: this process was started before its round formed (:data:`PRESTART_ENV`): it waits
        for the round's "go" before the first call (``SystemExit(1)`` when the agent closes the channel
        instead: the round it was started for does not come).

        Everything alive before the first call (the imported modules: torch's tens of thousands
        of objects) is moved out of the garbage collector's sight (``gc.freeze``), and so is
        what outlives each round; the full collection between two rounds, which frees the last
        round's process group, DDP and tensors held in reference cycles, then scans only what
        the round made (a whole collection with torch imported takes 0.08 s; after a first round,
        which imports more of torch, this one took 0.07-0.11 s on 2 loaded cores). It runs while the
        agent prepares the next round, except after a round with NCCL groups: there it comes before
        "ready", as the groups are let go only after it (:func:`_keep_groups`).
        """
        gc.freeze()
        if prestarted:
            self._next_round(None)
        while True:
            outcome, value = self._round(fn, args, kwargs)
            if outcome == "returned":
                return value
            if outcome == "exit":
                raise value
            if outcome == "raised":
                _print_traceback(value)
                # reported before the peers' collectives fail: their own "raised" comes after this one
                self._send({"op": "raised", "error": f"{type(value).__name__}: {value}"})
                # NCCL's communicators aborted (a destroy may block or fail on a broken one), the round's
                # connections shut: the peers' collectives fail now, on every node
                _abort_collectives(self._baseline)
            _destroy_process_group()
            _leave_if_out_of_descriptors()
            _warn_of_threads(self._threads)
            groups = _ended_groups()
            nccl = any(has_nccl for _, has_nccl in groups)
            if nccl:
                # an NCCL group's destructor joins its watchdog thread: let the round go before "ready", so that
                # a destructor that never returns costs this process (killed at the agent's deadline), not the
                # next round, whose other ranks would wait for this one
                _let_go(value, groups)
            # only now, torn down: the agent keeps a process for the next round once it said "ready" (a raised
            # one whose abort never returns is late, killed and replaced, not handed a rank it cannot take)
            self._send({"op": "ready"})
            if not nccl:
                _let_go(value, groups)  # while the agent prepares the next round
            gc.freeze()  # what outlived it (modules main() imported) is not scanned again at the next restart
            self._next_round(value if outcome == "raised" else None)

    def _next_round(self, failed: BaseException | None) -> None:
        """Wait for "go" and become the next round's worker (:meth:`_apply`).

        Raises:
            ``failed`` (the last round's exception), or ``SystemExit(1)`` when there is none: the agent
            closed the channel instead, so this process's part is over.
        """
        go = self._wait_go()
        if go is None:
            if failed is not None:
                raise failed
            raise SystemExit(1)
        self._apply(go)

    def _round(self, fn: Callable, args: tuple, kwargs: dict) -> tuple[str, Any]:
        """Call ``fn`` once: ("returned", value), ("aborted", None), ("raised", exc) or ("exit", exc)."""
        self._baseline = _socket_inodes()
        self._threads = {t.ident for t in threading.enumerate()}
        with self._lock:
            # LEFT -> RUNNING: an "abort" may interrupt main() from now on
            self._state = RUNNING
        outcome: tuple[str, Any] | None = None
        try:
            try:
                outcome = ("returned", fn(*args, **kwargs))
            except RoundAborted:
                outcome = ("aborted", None)
            except (SystemExit, KeyboardInterrupt, GeneratorExit) as exc:
                outcome = ("exit", exc)
            except BaseException as exc:  # noqa: BLE001 - reported to the agent, the round restarts
                outcome = ("raised", exc)
            finally:
                aborting = self._leave()
        except RoundAborted:  # an interrupt that landed in the few lines above, before _leave absorbed it
            aborting = True
        if outcome is None or (aborting and outcome[0] in ("raised", "returned")):
            # an abort came first: whatever main() then raised (a closed socket) is the abort's doing
            outcome = ("aborted", None)
        return outcome

    def _leave(self) -> bool:
        """RUNNING/ABORTING -> LEFT: no interrupt is sent from now on; one sent and still pending lands
        here (:func:`_land_pending`) and is absorbed.

        The lock is taken by hand, not with ``with``: the interrupt can land just after the lock was
        taken and before a ``with`` block is entered (the control thread sends it, and
        :data:`WAKE_SIGNAL`, while it holds the lock, then lets go; this thread, waiting for the lock,
        may get the lock before it runs the signal's handler). The lock then stayed this thread's
        for good (it is re-entrant, so this thread never noticed), and the next round's "abort" waited
        for it for ever in the control thread: seen on a GPU at a process's second in-process
        restart, where NCCL's abort holds the lock long enough for main()'s failed collective to
        bring it here first. So whatever lands where, the lock is let go, and the state is LEFT.
        At most one interrupt is sent a round.

        Returns:
            True when the control thread had interrupted this round.
        """
        landed = False
        while True:
            try:
                self._lock.acquire()
                try:
                    aborting = self._state == ABORTING
                    self._state = LEFT
                    if aborting and not landed:
                        _land_pending()
                finally:
                    self._lock.release()
                return aborting or landed
            except RoundAborted:
                landed = True
                if self._lock._is_owned():  # it landed between the acquire and the try
                    self._lock.release()

    def _wait_go(self) -> dict | None:
        with self._lock:
            while self._go is None and not self._closed:
                self._lock.wait()
            go, self._go = self._go, None
        return go

    def _apply(self, go: dict) -> None:
        """Become a fresh worker of the next round: its environment, its log files, a new progress counter."""
        env = go["env"]
        for key in self._env_keys - set(env):
            os.environ.pop(key, None)
        os.environ.update(env)
        os.environ.update(self._script_env)
        for key in self._script_unset:
            os.environ.pop(key, None)
        self._env_keys = set(env)
        for stream, fd, path in ((sys.stdout, 1, go["stdout"]), (sys.stderr, 2, go["stderr"])):
            if path is None:
                continue
            try:
                stream.flush()
                new = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
                os.dup2(new, fd)
                os.close(new)
            except (OSError, ValueError) as exc:
                print(f"elaunch.restartable: cannot write to {path}: {exc}", file=sys.stderr, flush=True)
        progress = sys.modules.get("elaunch._worker_progress")
        if progress is not None:  # the agent zeroed the progress file: map it again at the next call
            progress._counter = None
            progress._initialised = False

    def _send(self, msg: dict) -> None:
        try:
            self._sock.sendall(encode(msg))
        except OSError:
            pass  # the agent is gone: _wait_go sees the closed channel

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._lock.notify_all()
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()

    # ------------------------------------------------------------ the control thread

    def _listen(self) -> None:
        reader = LineReader()
        try:
            while True:
                data = self._sock.recv(65536)
                if not data:
                    break
                for line in reader.feed(data):
                    if line.strip():
                        self._handle(decode_agent(line))
        except (OSError, BadMessage) as exc:
            if not self._closed:
                print(f"elaunch.restartable: control channel closed: {exc}", file=sys.stderr, flush=True)
        with self._lock:
            self._closed = True
            self._lock.notify_all()

    def _handle(self, msg: dict) -> None:
        if msg["op"] == "go":
            with self._lock:
                self._go = msg
                self._lock.notify_all()
            return
        with self._lock:
            if self._state != RUNNING:
                return  # main() already ended this round (it raised, or it was interrupted)
            # RUNNING -> ABORTING: the round is over
            self._state = ABORTING
            _abort_collectives(self._baseline)
            _async_raise(self._main_ident, RoundAborted)
            if signal.getsignal(WAKE_SIGNAL) is _wake:  # installed, and the script has not taken the signal over
                try:
                    signal.pthread_kill(self._main_ident, WAKE_SIGNAL)  # out of a blocking system call now
                except OSError:
                    pass


def _wake(signum: int, frame: Any) -> None:
    """:data:`WAKE_SIGNAL`'s handler: nothing; a pending :class:`RoundAborted` is raised as it runs."""


def _install_wake() -> None:
    """Handle :data:`WAKE_SIGNAL` with :func:`_wake` where its default (ignore) is in place. Not from a
    thread other than the main one (a signal handler can be set there only), nor where the script
    handles the signal itself: an abort then lands when the blocked call returns, as before."""
    try:
        if signal.getsignal(WAKE_SIGNAL) is signal.SIG_DFL:
            signal.signal(WAKE_SIGNAL, _wake)
    except (ValueError, OSError):
        pass


def _async_raise(ident: int, exc: type[BaseException]) -> None:
    """Raise ``exc`` in thread ``ident`` when it next checks for pending work (a call, a loop's jump back).

    Never used to clear a pending one (``exc`` NULL): CPython 3.11 then leaves the eval loop's
    async-exception flag set with no exception behind it, and a thread that runs under a profile or
    trace function (cProfile, a debugger, coverage) afterwards spins at its next call for ever.
    :func:`_land_pending` lets a pending one land instead.
    """
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(ident), ctypes.py_object(exc))


def _land_pending() -> None:
    """Nothing; an asynchronous exception still pending for the calling thread is raised here (a call
    and a loop's backward jump are where the interpreter checks for one)."""
    for _ in range(2):
        pass


def _socket_links() -> dict[int, str]:
    """This process's socket descriptors and their ``socket:[inode]`` links (``/proc/self/fd``); {} where
    that cannot be read."""
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return {}
    out = {}
    for name in names:
        try:
            link = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if link.startswith("socket:"):
            out[int(name)] = link
    return out


def _socket_inodes() -> set[str]:
    """The ``socket:[inode]`` links of this process's open descriptors."""
    return set(_socket_links().values())


def _shut_round_sockets(baseline: set[str]) -> int:
    """``shutdown(SHUT_RDWR)`` every connected TCP socket opened since ``baseline``; return how many.

    These are the round's process group connections (gloo's pairs, the store's client):
    a collective blocked on one of them returns at once with an error, on this rank
    and on its peers. Listening sockets are left alone (gloo aborts the process when
    its listener fails), as are sockets that existed before ``main()`` started.
    """
    shut = 0
    for fd, link in _socket_links().items():  # sockets only: the dup of anything else leaked where socket() failed
        if link in baseline:
            continue
        try:
            dup = os.dup(fd)
        except OSError:
            continue
        try:
            sock = socket.socket(fileno=dup)
        except OSError:
            os.close(dup)
            continue
        try:
            if (sock.family in (socket.AF_INET, socket.AF_INET6) and sock.type == socket.SOCK_STREAM
                    and not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)):
                sock.shutdown(socket.SHUT_RDWR)
                shut += 1
        except OSError:
            pass
        finally:
            sock.close()
    return shut


def _abort_collectives(baseline: set[str]) -> None:
    """End the round's collectives: NCCL's communicators aborted, TCP connections shut.

    From the control thread at an "abort" (main() still runs), or from main()'s thread after it
    raised; never from both for one round (the control thread acts only while main() runs).
    The round's process group objects are kept first (:func:`_keep_groups`).
    """
    _keep_groups()
    _abort_nccl()
    _shut_round_sockets(baseline)


#: The round's process group objects, kept from its abort until :func:`_let_go` (with whether each has an
#: NCCL backend). Appended to by the control thread or main()'s thread, emptied by main()'s thread.
_KEPT_GROUPS: list = []


def _keep_groups() -> None:
    """Keep a reference to every process group torch knows now (before an abort or destroy forgets them).

    Why: ``~ProcessGroupNCCL`` joins the group's watchdog thread. Torch runs it with the GIL released
    where the group's Python object is the last owner (its no-GIL holder), but DDP's ``Reducer`` (a
    plain pybind class) often was the last owner here, freed with main()'s frames: the destructor then
    joined the watchdog with the GIL held, and at a survivor's second in-process restart it never
    returned (seen on a GPU: main thread in ``~ProcessGroupNCCL`` -> ``Watchdog::join`` under
    ``Reducer``'s dealloc). Not at the first: DDP's first construction imports
    ``torch.distributed.nn.functional``, whose functions take the default group of that moment as
    their default argument, so the first round's group is never freed at all. Kept here, the groups
    outlive the round's other objects and are let go last, by :func:`_let_go`.
    """
    dist = sys.modules.get("torch.distributed")
    if dist is None:
        return
    try:
        groups = list(dist.distributed_c10d._world.pg_map)
    except Exception:  # noqa: BLE001 - not initialised, or torch's internals moved: nothing kept
        return
    for group in groups:
        if not any(group is kept for kept, _ in _KEPT_GROUPS):
            _KEPT_GROUPS.append((group, _has_nccl(group)))


def _has_nccl(group: Any) -> bool:
    try:
        import torch

        return type(group._get_backend(torch.device("cuda"))).__name__ == "ProcessGroupNCCL"
    except Exception:  # noqa: BLE001 - no CUDA backend in this group
        return False


def _ended_groups() -> list:
    """Take the kept groups (:data:`_KEPT_GROUPS`) out of the module's list, as ``[(group, has_nccl)]``."""
    groups = list(_KEPT_GROUPS)
    del _KEPT_GROUPS[:len(groups)]
    return groups


def _let_go(value: Any, groups: list) -> None:
    """Let the round go, its process groups last: the frames of ``value`` (the exception main() raised, if
    it did) cleared (main()'s locals: DDP, its ``Reducer``, tensors), the reference cycles collected, then
    ``groups`` emptied, so that each group's destructor runs from its Python object, without the GIL
    (:func:`_keep_groups`). Empties ``groups`` (the caller's list).
    """
    if isinstance(value, BaseException):
        traceback.clear_frames(value.__traceback__)
    gc.collect()
    groups.clear()


def _abort_nccl() -> None:
    """Abort the NCCL communicators of every process group (torch's ``_abort_process_group``).

    That also forgets the groups, the default one included, so the next round's
    ``init_process_group`` starts afresh. Nothing happens when torch.distributed was not
    imported, no group exists, or the default group's backend is not NCCL. A failure is printed
    (the sockets shut next still end a blocked collective), as is an abort that took over a second.
    """
    dist = sys.modules.get("torch.distributed")
    if dist is None:
        return
    try:
        if not (dist.is_initialized() and dist.get_backend() == "nccl"):
            return
        began = time.monotonic()
        dist.distributed_c10d._abort_process_group()
        took = time.monotonic() - began
        if took > 1.0:
            print(f"elaunch.restartable: NCCL abort took {took:.1f} s", file=sys.stderr, flush=True)
    except Exception as exc:  # noqa: BLE001 - the sockets below still end a blocked collective
        print(f"elaunch.restartable: NCCL abort failed: {exc}", file=sys.stderr, flush=True)


def _warn_of_threads(before: set[int | None]) -> None:
    """One line on stderr naming the non-daemon threads the ended round started that still run.

    They outlive the round (nothing stops a thread), and Python waits for every non-daemon thread
    before a process exits: a kept process whose rounds each left one would never end, and its job
    never finish. ``before``: the idents of the threads alive when the round began.
    """
    left = [t for t in threading.enumerate() if not t.daemon and t.ident not in before]
    if left:
        names = ", ".join(t.name for t in left[:5]) + (", ..." if len(left) > 5 else "")
        print(f"elaunch.restartable: {len(left)} non-daemon thread(s) main() started still run after its round "
              f"ended ({names}); this process cannot exit while they do: start them with daemon=True, or stop "
              f"them in a finally", file=sys.stderr, flush=True)


def _destroy_process_group() -> None:
    """Destroy what is left of this round's process groups, so the next round builds its own.

    After an abort (NCCL) nothing is left. A destroy that raises (a NCCL communicator broken by
    the fault fails its shutdown) leaves torch's registry of groups in place, and the next
    round's ``init_process_group`` would fail with "trying to initialize the default process
    group twice"; the groups are then aborted with torch's ``_abort_process_group``, which clears
    that registry too. With no group left, torch's count of groups made is reset as a destroy of
    the default group resets it: a round aborted inside ``init_process_group`` had counted one.
    """
    dist = sys.modules.get("torch.distributed")
    if dist is None:
        return
    for name, end in (("destroy_process_group", dist.destroy_process_group),
                      ("abort_process_group", dist.distributed_c10d._abort_process_group)):
        try:
            if not dist.is_initialized():
                break
            end()
        except Exception as exc:  # noqa: BLE001 - the next way of ending them, or the message below
            print(f"elaunch.restartable: {name}: {exc}", file=sys.stderr, flush=True)
    if dist.is_initialized():
        print("elaunch.restartable: the last round's process group could not be ended; the next "
              "init_process_group may fail", file=sys.stderr, flush=True)
        return
    # An init_process_group interrupted before its group formed has counted it all the same (torch names
    # groups by that count): left so, this process's next default group would be named otherwise than a
    # fresh replacement's, and the two would wait on different store keys until the timeout.
    world = getattr(dist.distributed_c10d, "_world", None)
    if world is not None and getattr(world, "group_count", 0):
        world.group_count = 0


#: Share of the soft ``RLIMIT_NOFILE`` limit a process may hold open at a round's end and still be kept.
DESCRIPTOR_SHARE = 0.75


def _leave_if_out_of_descriptors() -> None:
    """End this process (``SystemExit(1)``: the agent replaces it, fresh) when it holds more than
    :data:`DESCRIPTOR_SHARE` of its descriptor limit at a round's end.

    A library may leave descriptors behind at each failed round (seen on a GPU: every NCCL set-up
    that failed, "Duplicate GPU detected", left its sockets open, and after 11 such rounds a kept
    process's next one failed on "Too many open files"); a fresh process starts with none of them.
    """
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (ImportError, OSError, ValueError):
        return
    try:
        held = len(os.listdir("/proc/self/fd"))
    except OSError:  # EMFILE: not one left to list them with
        held = soft
    if soft != resource.RLIM_INFINITY and held > DESCRIPTOR_SHARE * soft:
        print(f"elaunch.restartable: {held} descriptors open of a limit of {soft} after the round (left by a "
              "library); leaving for a fresh process", file=sys.stderr, flush=True)
        raise SystemExit(1)


def _print_traceback(exc: BaseException) -> None:
    """Print ``exc``'s traceback to stderr, as the interpreter would on exit (the failure summary's stderr tail).

    No error file is written: a worker decorated with ``@record`` inside ``restartable`` writes
    it as today; otherwise the agent dates the failure by the "raised" message's arrival, as
    it dates an exit by when it saw it, so a peer whose collective broke later is not taken
    for the root cause.
    """
    traceback.print_exception(type(exc), exc, exc.__traceback__, file=sys.stderr)
    sys.stderr.flush()
