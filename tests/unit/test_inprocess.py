"""In-process restart: the decisions and the wire format as tables; the agent's channel against junk and forgeries."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
import threading

import pytest

from elaunch.inprocess import decide
from elaunch.inprocess.channel import Channel
from elaunch.inprocess.wire import MAX_LINE, BadMessage, LineReader, decode_agent, decode_worker, encode
from tests.conftest import wait_for


@pytest.mark.parametrize("local_ranks, opted, fixable, offered, expected", [
    ([0, 1, 2], [0, 1, 2], True, True, True),
    ([0, 1, 2], [0, 2], True, True, False),  # one worker did not opt in: it would run on in a round that is over
    ([0, 1, 2], [0, 1, 2], False, True, False),  # no restart fixes it: nothing to keep
    ([0, 1, 2], [0, 1, 2], True, False, False),  # channel not offered (function workers) or turned off
    ([], [], True, True, False),
])
def test_goes_in_process(local_ranks, opted, fixable, offered, expected):
    assert decide.goes_in_process(local_ranks, opted, fixable, offered) is expected


@pytest.mark.parametrize("codes, waiting, laggards, kept", [
    ({0: None, 1: -9, 2: None}, {0, 2}, [], [0, 2]),
    ({0: None, 1: -9, 2: None}, {2}, [0], [2]),
    ({0: None, 1: 1, 2: None}, {1}, [0, 2], []),  # a dead rank's stale "ready" keeps nothing
    ({0: 0, 1: None}, {1}, [], [1]),  # one that returned is replaced
])
def test_laggards_and_kept(codes, waiting, laggards, kept):
    assert decide.laggards(codes, waiting) == laggards
    assert decide.kept(codes, waiting) == kept


def test_with_raised_fails_the_raising_rank_with_exit_code_1():
    assert decide.with_raised({0: None, 1: None, 2: -9}, [1, 2]) == {0: None, 1: 1, 2: -9}


@pytest.mark.parametrize("line, expected", [
    (b'{"op":"hello"}', {"op": "hello"}),
    (b'{"op":"hello","pid":1,"rank":7}', {"op": "hello"}),  # claims are dropped: the kernel says who speaks
    (b'{"op":"raised","error":"RuntimeError: x"}', {"op": "raised", "error": "RuntimeError: x"}),
    (b'{"op":"ready"}', {"op": "ready"}),
])
def test_decode_worker(line, expected):
    assert decode_worker(line) == expected


@pytest.mark.parametrize("line", [b"", b"junk", b"[1]", b'{"op":"go","env":{}}', b'{"op":"raised","error":3}',
                                  b'{"op":"abort"}', b"\xff\xfe", b'{"op":null}'])
def test_decode_worker_refuses(line):
    with pytest.raises(BadMessage):
        decode_worker(line)


@pytest.mark.parametrize("line", [b'{"op":"go","env":{"A":1}}', b'{"op":"go","env":[]}',
                                  b'{"op":"go","env":{},"stdout":3}', b'{"op":"hello"}'])
def test_decode_agent_refuses(line):
    with pytest.raises(BadMessage):
        decode_agent(line)


def test_go_round_trips():
    go = {"op": "go", "env": {"RANK": "1"}, "stdout": "/x/out.log", "stderr": None}
    assert decode_agent(encode(go).rstrip(b"\n")) == go


def test_line_reader_limits_a_line():
    reader = LineReader(limit=8)
    assert reader.feed(b"abc\nde") == [b"abc"]
    with pytest.raises(BadMessage):
        reader.feed(b"x" * 9)


def _connect(channel: Channel) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect("\0" + channel.address)
    return sock


@pytest.fixture
def channel():
    ch = Channel("test/job id").open()
    yield ch
    ch.close()


def test_channel_reads_only_expected_workers_and_survives_junk(channel):
    """An attacker (another pid) writing forged messages is never read; junk, an endless line and a
    closed connection from a worker close that connection only; the thread lives on, and the
    worker's next connection is heard."""
    attacker = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import socket, sys
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect("\\0" + {channel.address!r})
        s.sendall(b'{{"op":"raised","error":"forged"}}\\n{{"op":"ready"}}\\n' * 100)
        sys.stdout.write("sent\\n"); sys.stdout.flush()
        sys.stdin.read()
    """)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert attacker.stdout.readline() == "sent\n"
        channel.expect([os.getpid()])  # this test process plays the worker
        junk = _connect(channel)
        junk.sendall(b"\x00\xffnot json\n")
        long = _connect(channel)
        long.settimeout(10)  # a channel that stopped reading fails the test here, not hangs it
        long.sendall(b"x" * (MAX_LINE + 10))
        _connect(channel).close()
        for sock in (junk, long):  # each closed by the channel
            sock.settimeout(10)
            assert sock.recv(1) == b""
        good = _connect(channel)
        good.sendall(b'{"op":"hello"}\n{"op":"raised","error":"RuntimeError: mine"}\n')
        got: list = []

        def heard():
            got.extend(channel.take())
            return len([m for _, m, _ in got if m["op"] != "gone"]) >= 2

        wait_for(heard, 10, what="the worker's messages")
        assert [(pid, msg) for pid, msg, _at in got if msg["op"] != "gone"] == [
            (os.getpid(), {"op": "hello"}), (os.getpid(), {"op": "raised", "error": "RuntimeError: mine"})]
        assert (os.getpid(), {"op": "gone"}) in [(pid, msg) for pid, msg, _at in got]  # the closed connection
        assert channel.check() is False  # the thread did not die
        assert channel.send(os.getpid(), {"op": "abort"})
        good.settimeout(10)
        assert good.recv(100) == b'{"op":"abort"}\n'
        assert not channel.send(attacker.pid, {"op": "abort"})  # nothing goes to a process that is not a worker
        assert channel.take() == []  # the attacker's lines were never read
    finally:
        attacker.kill()
        attacker.wait()


def test_a_ready_wakes_the_agent_as_a_raised_does(channel):
    """The agent waits for its interrupted workers' "ready" in ``WorkerProcesses.wait``: each "ready" (and
    "raised") wakes it at once; a "hello" does not. Before, only "raised" woke it, and the agent saw the
    last "ready" at its next 50 ms look (namespace hosts: 60 ms of the 0.13 s from a kill to "go")."""
    woke = threading.Event()
    channel.wake = woke.set
    channel.expect([os.getpid()])
    worker = _connect(channel)
    try:
        worker.sendall(b'{"op":"hello"}\n')
        wait_for(lambda: [m for _, m, _ in channel.take()] == [{"op": "hello"}], 10, what="the hello")
        # the channel's one thread wakes (or not) right after it queued the hello: once it has closed a
        # later connection's junk, that decision was made
        junk = _connect(channel)
        junk.settimeout(10)
        junk.sendall(b"\x00\xffnot json\n")
        assert junk.recv(1) == b""
        junk.close()
        assert not woke.is_set()
        for line in (b'{"op":"ready"}\n', b'{"op":"raised","error":"RuntimeError: x"}\n'):
            woke.clear()
            worker.sendall(line)
            assert woke.wait(10), line
    finally:
        worker.close()


def test_a_replacement_started_before_its_round_gets_a_queued_go_and_calls_main_only_then(channel, tmp_path):
    """A worker started with ``PRESTART_ENV`` (a warm spare handed a dead worker's environment before the next
    round formed) says hello and waits for "go" before main()'s first call. The agent's "go" may be due before
    the worker has connected at all: the channel keeps it (``send(queue=True)``) and sends it as the connection
    is accepted. main() sees the round's environment from "go" (and not the mark); the process ends 0."""
    from elaunch.inprocess.wire import CONTROL_ENV, PRESTART_ENV

    seen = tmp_path / "seen"
    worker = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import json, os, sys
        import elaunch

        @elaunch.restartable
        def main():
            with open({str(seen)!r}, "w") as f:
                json.dump({{"mark": os.environ.get("ROUND_MARK"), "prestarted": {PRESTART_ENV!r} in os.environ}}, f)

        sys.stdin.readline()  # the test queued the go: connect now
        main()
    """)], stdin=subprocess.PIPE, text=True,
        env={**os.environ, CONTROL_ENV: channel.address, PRESTART_ENV: "1"})
    try:
        channel.expect([worker.pid])
        env = {**os.environ, CONTROL_ENV: channel.address, "ROUND_MARK": "round 1"}
        assert not channel.send(worker.pid, {"op": "go", "env": env, "stdout": None, "stderr": None})  # not queued
        assert channel.send(worker.pid, {"op": "go", "env": env, "stdout": None, "stderr": None}, queue=True)
        assert not channel.send(os.getpid(), {"op": "go", "env": env}, queue=True)  # only an expected worker's
        worker.stdin.write("connect\n")
        worker.stdin.flush()
        assert worker.wait(30) == 0
        assert json.loads(seen.read_text()) == {"mark": "round 1", "prestarted": False}
        got: list = []
        wait_for(lambda: got.extend(m for _, m, _ in channel.take()) or {"op": "gone"} in got, 10,
                 what="the worker's messages to its connection's end")
        assert got == [{"op": "hello"}, {"op": "gone"}]  # no "ready": it had no round to end before it ran
    finally:
        worker.kill()
        worker.wait()


def test_channel_closes_unknown_peers_after_their_grace(channel, monkeypatch):
    monkeypatch.setattr("elaunch.inprocess.channel.PENDING_S", 0.2)
    sock = _connect(channel)
    sock.settimeout(10)
    assert sock.recv(1) == b""  # never expected: closed once its grace passed
    assert channel.private_fds()  # the listener: closed in forked workers


@pytest.mark.parametrize("exits, raised, expected_first", [
    ({1: 100.05}, {0: 100.0, 2: 100.01}, 1),  # peers' collectives broke on the killed rank's sockets
    ({}, {1: 100.0, 0: 100.002, 2: 100.003}, 1),  # the raising rank, then its peers
    ({2: 101.0}, {1: 100.0}, 1),  # a raise well before a death keeps its time
])
def test_failure_times_root(exits, raised, expected_first):
    times = decide.failure_times(exits, raised, settle=0.1)
    assert set(times) == set(exits) | set(raised)
    assert min(times, key=lambda lr: (times[lr], lr)) == expected_first


@pytest.mark.parametrize("codes, raised, expected", [
    ({0: None}, [0], False),  # one worker per node, it raised: no local death to wait for
    ({0: None, 1: None, 2: None}, [0, 2], True),  # rank 1 runs and did not raise: maybe killed, exit not seen yet
    ({0: None, 1: None, 2: None}, [0, 1, 2], False),  # every rank's collective broke on a peer elsewhere
    ({0: None, 1: -9}, [0], False),  # the death is already seen
    ({0: None, 1: None}, [], True),
])
def test_a_local_death_may_follow_a_raise_only_while_a_rank_runs_that_has_not_raised(codes, raised, expected):
    assert bool(decide.laggards(codes, raised)) is expected


class _FakeChannel:
    """The channel's interface, fed by the test: ``inbox`` as ``Channel.take`` returns it."""

    address = "fake"
    wake = None

    def __init__(self) -> None:
        self.inbox: list = []
        self.sent: list = []

    def take(self):
        out, self.inbox = self.inbox, []
        return out

    def expect(self, pids) -> None:
        self.expected = set(pids)

    def send(self, pid, msg) -> bool:
        self.sent.append((pid, msg))
        return True


class _FakeProcs:
    pids = {0: 100, 1: 101, 2: 102}
    started_at = float("inf")  # the fake clock's times count

    def wakeup(self) -> None:
        pass


def test_the_agent_side_dates_a_death_by_its_connection_and_ignores_strangers():
    from elaunch.inprocess.restarts import InProcess

    channel = _FakeChannel()
    inproc = InProcess(channel, None, grace=1.0, raised_alarm=lambda: "alarm")
    inproc.started(_FakeProcs(), [])
    assert channel.expected == {100, 101, 102} and inproc.env(0) == {"ELAUNCH_CONTROL": "fake"}
    channel.inbox += [(pid, {"op": "hello"}, 1.0) for pid in (100, 101, 102)]
    assert inproc.poll(None) is None and inproc.applies({0: None, 1: -9, 2: None}, True)
    channel.inbox += [(999, {"op": "raised", "error": "not a worker"}, 9.0),  # a pid that is none of ours
                      (101, {"op": "gone"}, 10.0), (100, {"op": "raised", "error": "E: closed"}, 10.01)]
    assert inproc.poll(None) == "alarm" and inproc.raised() == [0]
    deaths = inproc.death_times({1: 10.2})  # the exit seen after the peer's "raised"
    assert deaths == {1: 10.0}
    times = decide.failure_times(deaths, inproc.raised_times())
    assert min(times, key=lambda lr: (times[lr], lr)) == 1  # the killed rank is the root cause
    assert not inproc.applies({0: None, 1: -9, 2: None}, False)  # a failure no restart fixes
