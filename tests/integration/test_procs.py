"""WorkerProcesses with real processes and signals: exits, waiting, stopping trees, logs."""

from __future__ import annotations

import os
import signal
import sys
import time

import psutil
import pytest


from elaunch.procs import LogsSpec, RunLogDir, Std, WorkerProcesses, spawn, start_reaper
from tests.conftest import SCRIPTS, track_processes, wait_for

WORKER = str(SCRIPTS / "procs_worker.py")


@pytest.fixture
def launch(tmp_path):
    """``launch({lr: [worker args]}, spec=..., prefixes=...)`` -> WorkerProcesses; closed at teardown."""
    started = []

    def _launch(args: dict[int, list[str]], spec: LogsSpec | None = None, prefixes=None, reaper=None):
        spec = spec or LogsSpec(log_dir=str(tmp_path / "logs"))
        logs = RunLogDir(spec, "test").attempt(0, len(args))
        cmds = {lr: [sys.executable, WORKER, *a] for lr, a in args.items()}
        envs = {lr: dict(os.environ, LOCAL_RANK=str(lr)) for lr in args}
        procs = WorkerProcesses.start(cmds, envs, logs, spec, prefixes or {}, reaper=reaper)
        procs.logs = logs
        started.append(procs)
        return procs

    yield _launch
    for procs in started:
        procs.close()


def _all_exited(procs):
    codes = procs.poll()
    return codes if all(c is not None for c in codes.values()) else None


def _pids(path) -> list[int]:
    wait_for(lambda: os.path.exists(path), 20, what=f"pidfile {path}")
    pids = [int(x) for x in open(path).read().split()]
    track_processes(pids)  # orphans escape the descendant check: the shared fixture checks these too
    return pids


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_exit_codes_and_signals(launch):
    procs = launch({0: ["--exit", "0"], 1: ["--exit", "3"], 2: ["--kill", "9"], 3: ["--kill", "15"]})
    assert set(procs.pids) == {0, 1, 2, 3}
    codes = wait_for(lambda: procs.wait(30) and _all_exited(procs), 60, what="all workers to exit")
    assert codes == {0: 0, 1: 3, 2: -signal.SIGKILL, 3: -signal.SIGTERM}
    assert set(procs.exit_times()) == {0, 1, 2, 3}


@pytest.mark.parametrize("pidfd", [True, False], ids=["pidfd", "polling"])
def test_wait_wakes_on_exit(launch, tmp_path, monkeypatch, pidfd):
    if not pidfd:
        monkeypatch.delattr(os, "pidfd_open")
    go = tmp_path / "go"
    procs = launch({0: ["--until", str(go), "--exit", "4"], 1: ["--sleep", "300"]})
    assert procs.wait(0.05) is False  # nobody exited yet
    go.touch()
    assert procs.wait(30) is True
    assert procs.poll() == {0: 4, 1: None}
    assert procs.wait(0.1) is False  # rank 0's exit was reported; rank 1 still runs
    procs.signal(signal.SIGKILL)
    assert procs.wait(30) is True
    assert procs.poll() == {0: 4, 1: -signal.SIGKILL}
    assert procs.wait(30) is True  # nothing left to wait for: returns at once


def test_wakeup_interrupts_wait(launch):
    procs = launch({0: ["--sleep", "300"]})
    procs.wakeup()
    assert procs.wait(30) is False
    assert procs.poll() == {0: None}


def test_signal_handler_interrupts_wait(launch):
    procs = launch({0: ["--sleep", "300"]})

    class Interrupted(Exception):
        pass

    def handler(signum, frame):
        raise Interrupted

    old = signal.signal(signal.SIGALRM, handler)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.2)
        with pytest.raises(Interrupted):
            procs.wait(30)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def test_stop_sigterm_then_sigkill_after_grace(launch, tmp_path):
    pf = [tmp_path / "0.pid", tmp_path / "1.pid"]
    procs = launch(
        {
            0: ["--pidfile", str(pf[0]), "--sleep", "300"],
            1: ["--ignore-term", "--pidfile", str(pf[1]), "--sleep", "300"],
        }
    )
    for p in pf:
        _pids(p)
    procs.stop(signal.SIGTERM, grace=0.5)
    assert procs.poll() == {0: -signal.SIGTERM, 1: -signal.SIGKILL}
    procs.stop(signal.SIGTERM, grace=0.5)  # idempotent
    procs.close()
    procs.close()


def test_stop_kills_grandchildren_including_setsid(launch, tmp_path):
    pf = [tmp_path / "0.pid", tmp_path / "1.pid"]
    procs = launch(
        {
            0: ["--child", "plain", "--pidfile", str(pf[0]), "--sleep", "300"],
            1: ["--ignore-term", "--child", "setsid", "--pidfile", str(pf[1]), "--sleep", "300"],
        }
    )
    pids = _pids(pf[0]) + _pids(pf[1])
    assert len(pids) == 4 and not any(_gone(p) for p in pids)
    assert psutil.Process(pids[3]).as_dict(["pid"]) and os.getsid(pids[3]) == pids[3]  # really left
    procs.stop(signal.SIGTERM, grace=0.5)
    assert [p for p in pids if not _gone(p)] == []


def test_orphans_left_by_exited_workers_are_killed(launch, tmp_path):
    """A worker exits leaving children (one in the session, one setsid'd away): stop() finds both."""
    go = tmp_path / "go"
    pf = [tmp_path / "0.pid", tmp_path / "1.pid"]
    procs = launch(
        {
            0: ["--child", "plain", "--pidfile", str(pf[0]), "--until", str(go)],
            1: ["--child", "setsid", "--pidfile", str(pf[1]), "--until", str(go)],
        }
    )
    pids = _pids(pf[0]) + _pids(pf[1])
    assert procs.wait(1.5) is False  # the monitor loop: snapshots the trees meanwhile
    go.touch()
    wait_for(lambda: procs.wait(30) and _all_exited(procs), 30, what="workers to exit")
    grandchildren = [pids[1], pids[3]]
    assert not any(_gone(p) for p in grandchildren)  # orphaned, still running
    procs.stop()
    assert [p for p in grandchildren if not _gone(p)] == []


def test_start_failure_kills_started_workers(tmp_path):
    spec = LogsSpec(log_dir=str(tmp_path))
    logs = RunLogDir(spec, "t").attempt(0, 2)
    cmds = {0: [sys.executable, WORKER, "--sleep", "300"], 1: [str(tmp_path / "no-such-program")]}
    with pytest.raises(FileNotFoundError, match="no-such-program"):
        WorkerProcesses.start(cmds, {0: dict(os.environ), 1: dict(os.environ)}, logs, spec, {})
    # the no_leftover_processes fixture fails this test if rank 0 survived


def test_mismatched_ranks_rejected(tmp_path):
    spec = LogsSpec(log_dir=str(tmp_path))
    logs = RunLogDir(spec, "t").attempt(0, 1)
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        WorkerProcesses.start({0: ["true"], 1: ["true"]}, {0: {}}, logs, spec, {})


def test_full_env_is_used(launch, tmp_path):
    procs = launch({0: ["--env", "LOCAL_RANK"], 1: ["--env", "LOCAL_RANK"]}, LogsSpec(str(tmp_path), redirects=Std.OUT))
    assert wait_for(lambda: _all_exited(procs), 30) == {0: 0, 1: 0}
    assert open(procs.logs.stdout[1]).read() == "LOCAL_RANK=1\n"


def test_console_by_default(launch, capfd):
    procs = launch({0: ["--out", "plain-out", "--err", "plain-err"]})
    wait_for(lambda: _all_exited(procs), 30)
    procs.close()
    out, err = capfd.readouterr()
    assert out == "plain-out\n" and err == "plain-err\n"  # inherited, unprefixed, as torchrun


def test_redirects_to_files_only(launch, tmp_path, capfd):
    procs = launch({0: ["--out", "o0", "--err", "e0"]}, LogsSpec(str(tmp_path), redirects=Std.ALL))
    wait_for(lambda: _all_exited(procs), 30)
    procs.close()
    assert open(procs.logs.stdout[0]).read() == "o0\n"
    assert open(procs.logs.stderr[0]).read() == "e0\n"
    assert capfd.readouterr() == ("", "")


def test_tee_to_file_and_prefixed_console(launch, tmp_path, capfd):
    prefixes = {0: "[default0]:", 1: "[default1]:"}
    procs = launch(
        {0: ["--out", "a", "--out", "b", "--partial", "c"], 1: ["--err", "x"]},
        LogsSpec(str(tmp_path), tee=Std.ALL),
        prefixes,
    )
    wait_for(lambda: _all_exited(procs), 30)
    procs.close()
    assert open(procs.logs.stdout[0]).read() == "a\nb\nc"
    assert open(procs.logs.stderr[1]).read() == "x\n"
    out, err = capfd.readouterr()
    assert out == "[default0]:a\n[default0]:b\n[default0]:c\n"
    assert err == "[default1]:x\n"


def test_local_ranks_filter(launch, tmp_path, capfd):
    spec = LogsSpec(str(tmp_path), tee={0: Std.OUT, 1: Std.OUT}, local_ranks_filter=frozenset({1}))
    procs = launch(
        {0: ["--out", "o0", "--err", "e0"], 1: ["--out", "o1", "--err", "e1"]}, spec, {0: "[r0]:", 1: "[r1]:"}
    )
    wait_for(lambda: _all_exited(procs), 30)
    procs.close()
    out, err = capfd.readouterr()
    assert out == "[r1]:o1\n" and err == "e1\n"  # rank 0 hidden on the console ...
    assert open(procs.logs.stdout[0]).read() == "o0\n"  # ... but its tee'd file is written


def test_reaper_watch_forget(tmp_path, launch):
    reaper = start_reaper()
    try:
        procs = launch({0: ["--exit", "0"]}, reaper=reaper)
        wait_for(lambda: _all_exited(procs), 30)
        procs.close()
        assert reaper.alive()
    finally:
        reaper.close()
        spawn._prctl(spawn._PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0)  # pytest is no agent
    assert not reaper.alive()


def test_setsid_grandchild_of_a_worker_that_exits_at_once_is_stopped(launch, tmp_path):
    """The setsid orphan gap: the worker is gone before anyone looked at its tree.

    Its setsid'd child is in no group, session or tree of the worker; as the agent
    is a child subreaper it is re-parented to the agent, which finds it by the
    worker's env entries it carries.
    """
    pf = tmp_path / "p"
    reaper = start_reaper()
    try:
        procs = launch({0: ["--child", "setsid", "--pidfile", str(pf)]}, reaper=reaper)  # spawns, exits at once
        worker, grandchild = _pids(pf)
        try:
            wait_for(lambda: _all_exited(procs), 20, what="the worker's exit")
            assert _alive(grandchild) and os.getsid(grandchild) == grandchild  # it outlived its worker
            procs.stop(grace=5.0)
            assert not _alive(grandchild)
            assert not psutil.pid_exists(grandchild)  # reaped, not left a zombie of the agent
        finally:
            if _alive(grandchild):
                os.kill(grandchild, signal.SIGKILL)
    finally:
        reaper.close()
        spawn._prctl(spawn._PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0)  # pytest is no agent


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


class _Handled(Exception):
    pass


def test_a_signal_that_reaches_another_thread_ends_an_unlimited_wait(launch):
    """wait(None) sleeps until an event; a handled signal is one even when the kernel gave it to another thread.

    With a watchdog the agent is a child subreaper, so no snapshot of the trees
    wakes the wait. Once the main thread sleeps in the kernel (its wchan names
    epoll), the helper thread sends the signal to itself; should the wait go on,
    the helper ends it after 30 s by killing the worker: the wait must raise,
    not return.
    """
    import threading

    reaper = start_reaper()
    main = threading.get_native_id()
    asleep, killed, done = [], [], threading.Event()

    def helper(procs):
        deadline = time.monotonic() + 30
        while not asleep and time.monotonic() < deadline:
            with open(f"/proc/self/task/{main}/wchan") as f:
                if "epoll" in f.read():
                    asleep.append(True)
                    break
            time.sleep(0.01)
        signal.pthread_kill(threading.get_ident(), signal.SIGUSR1)
        if not done.wait(30):
            killed.append(True)
            procs.notify(signal.SIGKILL)

    def handler(signum, frame):
        raise _Handled()

    previous = signal.signal(signal.SIGUSR1, handler)
    try:
        procs = launch({0: ["--sleep", "300"]}, reaper=reaper)
        thread = threading.Thread(target=helper, args=(procs,))
        thread.start()
        try:
            with pytest.raises(_Handled):
                procs.wait(None)
        finally:
            done.set()
            thread.join()
        procs.close()
    finally:
        signal.signal(signal.SIGUSR1, previous)
        reaper.close()
        spawn._prctl(spawn._PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0)  # pytest is no agent
    assert asleep, "the main thread was never seen asleep in epoll_wait"
    assert not killed, "the wait ended only when the worker was killed"


def test_a_forked_worker_runs_nothing_before_before_run_returned(tmp_path):
    """fork_worker's child waits for ``before_run`` (the agent registers it with the watchdog there)."""
    from elaunch.procs.forked import fork_worker

    watched = tmp_path / "watched"
    seen: list[int] = []

    def before_run(pid: int) -> None:
        seen.append(pid)
        watched.write_text(str(pid))

    proc = fork_worker(lambda: 0 if watched.exists() else 3, dict(os.environ), os.devnull, os.devnull,
                       before_run=before_run)
    assert proc.wait(30) == 0
    assert seen == [proc.pid]


def test_a_forked_worker_whose_before_run_raised_never_runs(tmp_path):
    from elaunch.procs.forked import fork_worker

    ran = tmp_path / "ran"

    def refuse(pid: int) -> None:
        raise RuntimeError(f"cannot watch {pid}")

    with pytest.raises(RuntimeError, match="cannot watch"):
        fork_worker(lambda: ran.write_text("ran") and 0, dict(os.environ), os.devnull, os.devnull,
                    before_run=refuse)
    assert not ran.exists()


def test_a_signal_handled_as_the_fork_closes_its_descriptors_leaves_no_child(tmp_path, monkeypatch):
    """A handled signal's exception raised as fork_worker began closing its end of the pipes (a
    handler runs at a function's entry, so at ``_close_all``'s, outside its own deferral) left the
    forked worker running and untracked: a function worker outlived its agent's SIGTERM once in
    the suite (a forked process of the pytest run, left behind). The handler is run there, as the
    interpreter would; the child must be killed and reaped."""
    from elaunch.procs import forked
    from elaunch.procs.deferral import raise_or_defer

    real = forked._close_all
    started = tmp_path / "started"

    def a_handler_runs_first(fds):
        raise_or_defer(Handled("SIGTERM"))  # what the agent's handler does, here
        real(fds)

    monkeypatch.setattr(forked, "_close_all", a_handler_runs_first)
    children = set(psutil.Process().children())
    with pytest.raises(Handled):
        forked.fork_worker(lambda: started.write_text("x") and time.sleep(60) or 0, dict(os.environ),
                           os.devnull, os.devnull)
    assert {p for p in psutil.Process().children() if p.is_running() and p.status() != psutil.STATUS_ZOMBIE} \
        <= children, "the forked worker was left running"


class Handled(Exception):
    """What the pelting handler raises (deferred inside a start, see ``procs.deferral``)."""


def pelted_starts(start, times: int, period: float) -> int:
    """Call ``start()`` ``times`` times while a thread pelts this process with a handled SIGUSR1
    every ``period`` s; the handler raises :class:`Handled` once per start. Returns how many raised."""
    import threading

    from elaunch.procs.deferral import raise_or_defer

    starting = [False]  # the handler raises only during a start, once
    stop = threading.Event()

    def handler(signum, frame):
        if starting[0]:
            starting[0] = False
            raise_or_defer(Handled())

    def pelt():  # process-directed: the kernel hands it to a thread that does not block it
        while not stop.wait(period):
            os.kill(os.getpid(), signal.SIGUSR1)

    previous = signal.signal(signal.SIGUSR1, handler)
    pelter = threading.Thread(target=pelt, daemon=True)
    pelter.start()
    raised = 0
    try:
        for _ in range(times):
            starting[0] = True
            try:
                start()
                starting[0] = False
            except Handled:
                raised += 1
    finally:
        stop.set()
        pelter.join()
        signal.signal(signal.SIGUSR1, previous)
    return raised


def test_signals_pelting_worker_starts_are_never_lost_and_leave_logging_unlocked(monkeypatch):
    """A handled signal raised inside the interpreter's at-fork hooks (Popen runs them for its
    preexec_fn) was printed and dropped there: the signal was lost, and logging's module lock,
    which the hook was about to release, stayed held by the main thread for good (a CI run then
    hung in another thread's log call). The exception must come out of the start instead."""
    import logging

    from elaunch.procs.spawn import popen_worker

    dropped, procs = [], []
    hook = sys.unraisablehook
    monkeypatch.setattr(sys, "unraisablehook", lambda u: dropped.append(u) if isinstance(u.exc_value, Handled)
                        else hook(u))
    try:
        raised = pelted_starts(lambda: procs.append(popen_worker(["true"], dict(os.environ), os.devnull,
                                                                 os.devnull)), 150, 0.0005)
    finally:
        for p in procs:
            p.wait()
    assert (dropped, logging._lock._is_owned()) == ([], False)
    assert raised  # the signals did land during starts


def test_signals_pelting_forked_starts_leak_no_descriptor():
    """A handled signal's exception may end a forked start at any point: every descriptor the
    start opened (the log files, the handshake pipes) is closed, and no child is left behind."""
    from elaunch.procs.forked import fork_worker

    def open_fds() -> set[str]:
        return set(os.listdir("/proc/self/fd"))

    before, procs = open_fds(), []
    try:
        raised = pelted_starts(lambda: procs.append(fork_worker(lambda: 0, dict(os.environ), os.devnull,
                                                                os.devnull)), 300, 0.0002)
    finally:
        for p in procs:
            p.wait()
    assert raised  # the signals did land during starts
    leaked = {fd: os.readlink(f"/proc/self/fd/{fd}") for fd in open_fds() - before
              if os.path.exists(f"/proc/self/fd/{fd}")}
    assert leaked == {}, leaked


def test_a_released_worker_outlives_its_attempts_stop(launch):
    """WorkerProcesses.release (in-process restart's survivors): stop and close take only the other workers,
    and the released one, a child of this process with a worker's env entries, is not taken for an orphan."""
    procs = launch({0: ["--sleep", "60"], 1: ["--sleep", "60"]})
    kept = procs.release([1])
    try:
        assert set(kept) == {1} and set(procs.pids) == {0}
        procs.close()
        assert procs.poll() == {0: -signal.SIGKILL}
        assert kept[1].poll() is None
        with pytest.raises(ValueError, match=r"local ranks \[0\]"):
            procs.release([0])  # no longer running
    finally:
        kept[1].kill()
        kept[1].wait()


def test_a_stop_delivers_its_signal_once_to_each_process_of_a_tree(tmp_path):
    """One SIGTERM for the worker, its child in its group and a child that left with setsid, as under torchrun
    (one ``killpg`` per worker): a script that saves on the first SIGTERM and quits at once on a second one,
    or cleans up under ``except KeyboardInterrupt``, was cut short by the second that each process of a
    worker's group got (``killpg``, then ``kill`` of every member)."""
    count = str(SCRIPTS / "count_signals.py")
    files = {lr: tmp_path / f"rank{lr}" for lr in (0, 1)}
    spec = LogsSpec(log_dir=str(tmp_path / "logs"))
    logs = RunLogDir(spec, "test").attempt(0, 2)
    cmds = {0: [sys.executable, count, str(files[0]), "plain", "setsid"], 1: [sys.executable, count, str(files[1])]}
    envs = {lr: dict(os.environ, LOCAL_RANK=str(lr)) for lr in cmds}
    procs = WorkerProcesses.start(cmds, envs, logs, spec, {})
    try:
        for f in files.values():
            _pids(f"{f}.pids")
        procs.stop(signal.SIGTERM, grace=10.0)
        assert procs.poll() == {0: 0, 1: 0}  # each exited by itself, a second after its SIGTERM
    finally:
        procs.close()
    received = {name: open(tmp_path / name).read().split() for name in ("rank0", "rank0.0", "rank0.1", "rank1")}
    assert received == dict.fromkeys(received, ["TERM"])
