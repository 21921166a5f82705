"""The restartable wrapper's end of a round, where it broke on a GPU at a process's second in-process restart.

Seen in py-spy stacks of survivors under nccl (docs/benchmarks.md, "On a GPU", session 35):
- the interrupt landed just after ``_leave`` took the lock, the lock stayed taken, and the next "abort"
  waited for it for ever in the control thread;
- the main thread sat in ``~ProcessGroupNCCL`` -> ``Watchdog::join`` under DDP's ``Reducer`` being freed,
  with the GIL held: the group's Python object, which torch frees without the GIL, had gone first.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading

import pytest

from elaunch.inprocess import worker
from elaunch.inprocess.channel import Channel
from elaunch.inprocess.wire import CONTROL_ENV
from tests.conftest import wait_for


class _LandsAfterAcquire:
    """A re-entrant lock whose next acquire, once armed, raises a real ``RoundAborted`` in the taking thread
    just after the lock was taken (``PyThreadState_SetAsyncExc``, landing at the interpreter's next check),
    as the control thread's interrupt did on the GPU."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self.armed = False

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        got = self._lock.acquire(blocking, timeout)
        if got and self.armed:
            self.armed = False
            worker._async_raise(threading.get_ident(), worker.RoundAborted)
        return got

    __enter__ = acquire

    def release(self) -> None:
        self._lock.release()

    def __exit__(self, *exc) -> None:
        self.release()

    def _is_owned(self) -> bool:
        return self._lock._is_owned()


@pytest.fixture
def control_with_lock():
    """A ``_Control`` over a dead socket pair whose lock is a :class:`_LandsAfterAcquire`; the wake signal's
    handler it installs in this (pytest's) process is put back afterwards."""
    before = signal.getsignal(worker.WAKE_SIGNAL)
    a, b = socket.socketpair()
    b.close()
    lock = _LandsAfterAcquire()
    control = worker._Control(a)
    control._lock = threading.Condition(lock)
    yield control, lock
    a.close()
    signal.signal(worker.WAKE_SIGNAL, before)


def test_an_interrupt_landing_just_after_the_lock_is_taken_does_not_keep_the_lock(control_with_lock):
    control, lock = control_with_lock
    control._state = worker.ABORTING  # the control thread interrupted this round and let go of the lock
    lock.armed = True
    try:
        assert control._leave() is True
    except worker.RoundAborted:  # tolerated only where it lands before the lock (then _round absorbs it)
        pytest.fail("the interrupt escaped _leave after the lock was taken")
    assert not lock.armed  # it did land
    assert control._state == worker.LEFT
    taken = []
    other = threading.Thread(target=lambda: taken.append(control._lock.acquire(timeout=5)))
    other.start()
    other.join(10)
    assert taken == [True], "the lock stayed with the thread that ran main(): the next abort would wait for ever"


@pytest.fixture
def channel():
    ch = Channel("test/teardown").open()
    yield ch
    ch.close()


def _ops_until(channel: Channel, op: str, timeout: float) -> list[str]:
    """The ops the channel heard from its workers, read until ``op`` is among them (AssertionError after ``timeout``)."""
    got: list[str] = []
    wait_for(lambda: got.extend(m["op"] for _, m, _ in channel.take()) or op in got, timeout,
             what=f"the worker's {op!r}")
    return got


@pytest.mark.parametrize("how", ["aborted", "raises"])
def test_the_rounds_process_group_is_let_go_after_ddp_and_the_cycle_collection(channel, tmp_path, how):
    """A real gloo group and DDP in main()'s frame; the round ends by the agent's abort or by main() raising.
    Torch frees a process group without the GIL only where its Python object is the last owner, and DDP
    lets go of its group's Python object before its ``Reducer`` (a C++ owner, freed with the GIL held).
    So the wrapper keeps the group from the abort on and lets it go only after DDP is gone and the
    round's reference cycles are collected: the group's Python object is freed last."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    seen = tmp_path / "seen"
    blocked = tmp_path / "blocked"
    script = textwrap.dedent(f"""
        import gc, json, time, weakref
        import torch, torch.distributed as dist
        # imported before any group exists: imported under DDP's first construction, it takes that round's
        # default group as its functions' default argument for good, so only a later round's group can end
        # (on the GPU, why a process's first restart passed and its second hung)
        import torch.distributed.nn.functional
        import elaunch
        from torch.nn.parallel import DistributedDataParallel as DDP

        from elaunch.inprocess import worker

        events = []

        class CountedGc:  # the wrapper's collections, marked in the order of events
            def __getattr__(self, name):
                return getattr(gc, name)

            def collect(self):
                n = gc.collect()
                events.append("collected")
                return n

        worker.gc = CountedGc()
        calls = []

        @elaunch.restartable
        def main():
            calls.append(1)
            if len(calls) == 2:
                return "second round"
            dist.init_process_group("gloo")
            model = DDP(torch.nn.Linear(4, 4))
            weakref.finalize(model, lambda: events.append("ddp"))
            weakref.finalize(dist.group.WORLD, lambda: events.append("group"))
            if {how!r} == "raises":
                raise RuntimeError("a collective failed")
            open({str(blocked)!r}, "w").close()
            time.sleep(60)  # the agent's abort lands here

        print(main(), flush=True)
        with open({str(seen)!r}, "w") as f:
            json.dump(events, f)
    """)
    env = {**os.environ, CONTROL_ENV: channel.address, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
           "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"}
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env)
    try:
        channel.expect([proc.pid])
        if how == "aborted":
            wait_for(blocked.exists, 60, what="main() in its first round")
            assert channel.send(proc.pid, {"op": "abort"})
        _ops_until(channel, "ready", 60)
        assert channel.send(proc.pid, {"op": "go", "env": env, "stdout": None, "stderr": None})
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
        assert out.strip() == "second round"
        events = json.loads(seen.read_text())
        assert events == ["ddp", "collected", "group"], events
    finally:
        proc.kill()
        proc.wait()


def test_what_the_script_set_in_its_environment_before_main_stays_across_rounds(channel, tmp_path):
    """A fresh worker's script would set its own variables again at the top (an ``NCCL_*`` read at the next
    ``init_process_group``, ``MASTER_PORT`` as tutorials set it): a survivor keeps them each round, also one
    the agent sets as well, and one the script removed stays removed; the agent's other variables follow
    "go" (a new one appears, one it no longer sends goes). Before, "go" dropped every variable it did not
    carry, the script's own ones too (seen on the GPU: the one-GPU aid's ``NCCL_HOSTID``)."""
    seen = tmp_path / "seen"
    script = textwrap.dedent(f"""
        import json, os
        import elaunch

        os.environ["SCRIPT_VAR"] = "mine"
        os.environ["OMP_NUM_THREADS"] = "7"
        del os.environ["DROPPED_BY_SCRIPT"]
        rounds = []

        @elaunch.restartable
        def main():
            rounds.append({{k: os.environ.get(k) for k in ("SCRIPT_VAR", "OMP_NUM_THREADS", "DROPPED_BY_SCRIPT",
                                                           "AGENT_OLD", "AGENT_NEW", "RANK")}})
            if len(rounds) == 1:
                raise RuntimeError("round 1 fails")
            with open({str(seen)!r}, "w") as f:
                json.dump(rounds, f)

        main()
    """)
    launch = {**os.environ, CONTROL_ENV: channel.address, "OMP_NUM_THREADS": "1", "DROPPED_BY_SCRIPT": "x",
              "AGENT_OLD": "old", "RANK": "0"}
    proc = subprocess.Popen([sys.executable, "-c", script], stderr=subprocess.PIPE, text=True, env=launch)
    try:
        channel.expect([proc.pid])
        _ops_until(channel, "ready", 30)
        go = {k: v for k, v in launch.items() if k != "AGENT_OLD"}
        go.update({"AGENT_NEW": "new", "RANK": "1"})
        assert channel.send(proc.pid, {"op": "go", "env": go, "stdout": None, "stderr": None})
        _, err = proc.communicate(timeout=30)
        assert proc.returncode == 0, err
        first, second = json.loads(seen.read_text())
        assert first == {"SCRIPT_VAR": "mine", "OMP_NUM_THREADS": "7", "DROPPED_BY_SCRIPT": None,
                         "AGENT_OLD": "old", "AGENT_NEW": None, "RANK": "0"}
        assert second == {"SCRIPT_VAR": "mine", "OMP_NUM_THREADS": "7", "DROPPED_BY_SCRIPT": None,
                          "AGENT_OLD": None, "AGENT_NEW": "new", "RANK": "1"}
    finally:
        proc.kill()
        proc.wait()


def test_launch_environ_prefers_what_a_forked_worker_was_given(monkeypatch):
    from elaunch.procs import launch_env

    assert launch_env.launch_environ().get("PATH") == os.environ.get("PATH")  # this process's exec environment
    monkeypatch.setattr(sys, launch_env.ATTR, {"A": "1"}, raising=False)  # what a forked worker's bootstrap records
    assert launch_env.launch_environ() == {"A": "1"}
    # the warm spare's bootstrap cannot import launch_env: it writes the same attribute by name
    import elaunch.procs._warm_child as warm_child

    assert f"sys.{launch_env.ATTR} = " in open(warm_child.__file__).read()


def test_a_process_near_its_descriptor_limit_leaves_for_a_fresh_one(channel, tmp_path):
    """A round that leaves descriptors behind (as failed NCCL set-ups did on the GPU, until "Too many open
    files") brings the process near its limit: instead of "ready" it ends with one line, and the agent
    replaces it with a fresh process, as it does a dead worker."""
    script = textwrap.dedent("""
        import os, resource
        import elaunch

        resource.setrlimit(resource.RLIMIT_NOFILE, (64, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
        leaked = []

        @elaunch.restartable
        def main():
            while len(os.listdir("/proc/self/fd")) < 56:
                leaked.append(os.open(os.devnull, os.O_RDONLY))  # a library's descriptors, never closed
            raise RuntimeError("the set-up failed")

        main()
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stderr=subprocess.PIPE, text=True,
                            env={**os.environ, CONTROL_ENV: channel.address})
    try:
        channel.expect([proc.pid])
        _, err = proc.communicate(timeout=30)
        assert proc.returncode == 1, err
        assert "descriptors open of a limit of 64 after the round" in err
        assert _ops_until(channel, "gone", 10) == ["hello", "raised", "gone"]  # never "ready": not kept
    finally:
        proc.kill()
        proc.wait()


def test_shutting_the_rounds_sockets_leaves_other_descriptors_alone_and_leaks_none():
    """Only the round's connected TCP sockets are shut; a file the round opened is not touched, and no
    descriptor is left behind (each socket is looked at through a dup, closed again; before, every new
    descriptor was dup'ed and the dup of a non-socket leaked, until "Too many open files")."""
    baseline = worker._socket_inodes()
    server = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(server.getsockname())
    peer, _ = server.accept()
    files = [os.open(os.devnull, os.O_RDONLY) for _ in range(5)]
    try:
        before = len(os.listdir("/proc/self/fd"))
        assert worker._shut_round_sockets(baseline) == 2  # the client's and the accepted end; not the listener
        assert len(os.listdir("/proc/self/fd")) == before
        assert client.recv(1) == b""  # shut
        assert all(os.fstat(fd) for fd in files)  # still open
    finally:
        for fd in files:
            os.close(fd)
        for s in (client, peer, server):
            s.close()
