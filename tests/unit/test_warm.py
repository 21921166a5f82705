"""Warm start's pure parts: which argv can be warmed, the handoff encoding, the flags."""

from __future__ import annotations

import importlib.util
import logging
import os
import sys

import pytest

from elaunch.cli import parse_config
from elaunch.config import ConfigError
from elaunch.procs import warm


def _child():
    spec = importlib.util.spec_from_file_location("_warm_child_under_test", warm.CHILD)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize(
    "cmd,mode,target,args",
    [
        (["/usr/bin/python3", "-u", "train.py", "--lr", "1"], "script", "train.py", ("--lr", "1")),
        (["/usr/bin/python3", "-u", "-m", "pkg.train", "x"], "module", "pkg.train", ("x",)),
        (["/opt/venv/bin/python", "-u", "-m", "elaunch.runpath", "t.py"], "module", "elaunch.runpath", ("t.py",)),
        (["python3.11", "t.py"], "script", "t.py", ()),
    ],
)
def test_python_worker_argv_is_warmable(cmd, mode, target, args, tmp_path):
    t = warm.parse_worker_cmd(cmd, cwd=str(tmp_path))
    assert (t.python, t.mode, t.target, t.args) == (cmd[0], mode, target, args)
    assert t.path0 == str(tmp_path)


@pytest.mark.parametrize("cmd", [["./train.sh", "x"], ["/bin/echo"], ["python3", "-u", "-c", "pass"], ["python3", "-X", "dev", "t.py"]])
def test_other_argv_is_not_warmable(cmd):
    assert warm.parse_worker_cmd(cmd) is None


def test_script_symlink_resolves_like_cpython(tmp_path):
    (tmp_path / "real").mkdir()
    (tmp_path / "real" / "t.py").write_text("")
    (tmp_path / "t.py").symlink_to("real/t.py")
    assert warm.parse_worker_cmd(["python3", "t.py"], cwd=str(tmp_path)).path0 == str(tmp_path / "real")


def test_handoff_round_trips_through_the_child_decoder():
    t = warm.WarmTarget("python3", ("-u",), "script", "t.py", ("a b", "", "é"), "/x")
    env = {"RANK": "3", "EMPTY": "", "PATH": "/bin:/usr/bin", "UNI": "ü"}
    argv = ["python3", "-u", "t.py", "a b", "", "é"]
    mode, target, args, orig, got = _child()._decode(warm.encode_handoff(t, argv, env))
    assert (mode, target, args, orig) == ("script", "t.py", ["a b", "", "é"], argv)
    assert {os.fsdecode(k): os.fsdecode(v) for k, v in got.items()} == env


def test_spawn_env_leaves_out_round_variables():
    env = {"PATH": "/bin", "OMP_NUM_THREADS": "1", "LOCAL_RANK": "1", "RANK": "5", "MASTER_PORT": "1234"}
    assert warm.spawn_env(env) == {"PATH": "/bin", "OMP_NUM_THREADS": "1", "LOCAL_RANK": "1"}


def test_handoff_without_spare_starts_cold():
    pool = warm.WarmPool(("json",))
    assert pool.handoff(0, ["python3", "t.py"], {}) is None and pool.logs_for(1) is None
    pool.close()


@pytest.fixture
def script(tmp_path):
    p = tmp_path / "train.py"
    p.write_text("")
    return str(p)


def test_flag_defaults_and_env(script):
    assert parse_config([script], {}).warm_start_modules is None
    assert parse_config(["--warm-start", script], {}).warm_start_modules == ("torch", "torch._dynamo")
    assert parse_config([script], {"PET_WARM_START": "1"}).warm_start_modules == ("torch", "torch._dynamo")
    cfg = parse_config(["--warm-start", "--warm-start-modules=numpy,torch.distributed", script], {})
    assert cfg.warm_start_modules == ("numpy", "torch.distributed")


def test_bad_module_name_names_it(script):
    with pytest.raises(ConfigError, match="--warm-start-modules=torch,1bad: '1bad'"):
        parse_config(["--warm-start", "--warm-start-modules=torch,1bad", script], {})


def test_no_python_ignores_warm_start_with_a_log_line(caplog):
    with caplog.at_level(logging.WARNING):
        cfg = parse_config(["--warm-start", "--no-python", sys.executable], {"PATH": os.defpath})
    assert cfg.warm_start_modules is None
    assert "--warm-start does not apply" in caplog.text


def test_a_template_forks_only_once_its_importing_thread_is_gone():
    """The importing thread releases the imports' lock and then still runs its exit: the template
    waits for the kernel to drop the thread (a fork meanwhile could copy a lock it holds)."""
    import _thread
    import threading

    child = _child()
    released, leave = _thread.allocate_lock(), threading.Event()
    released.acquire()

    def importer():
        child._IMPORTER.append((_thread.get_ident(), _thread.get_native_id()))
        released.release()  # as _import_all's finally does
        leave.wait(30)  # ... and the thread has yet to end

    _thread.start_new_thread(importer, ())
    released.acquire()
    assert child._importer_gone(0.2) is False  # still there: no fork
    leave.set()
    assert child._importer_gone(10.0) is True


class _TemplatePeer:
    """The template's end of a real channel, played by the test: it reads requests and sends answers."""

    def __init__(self):
        import socket
        import subprocess

        from elaunch.procs.warm_template import Template

        self.agent_end, self.end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        # stands for the template process: a group leader, as popen_worker starts it (it is ended by group)
        self.proc = subprocess.Popen(["sleep", "60"], start_new_session=True)
        self.spares = []  # stand for the forked spares: the agent's children
        self.template = Template(self.proc, self.agent_end, ["python", "x.py"], {})

    def requests(self, n: int) -> list[int]:
        """Send ``n`` plain requests to the template; their tickets (the handoff pipes are closed)."""
        tickets = []
        for _ in range(n):
            wfd, ticket = self.template.request(None, None)
            os.close(wfd)
            tickets.append(ticket)
        return tickets

    def read_request(self) -> dict:
        import socket

        msg, fds, _flags, _addr = socket.recv_fds(self.end, 1 << 20, 4)
        for fd in fds:
            os.close(fd)
        fields = msg.split(b"\0")
        assert fields[0] == b"F"
        return dict(zip(fields[1::2], fields[2::2]))

    def fork(self) -> int:
        import subprocess

        spare = subprocess.Popen(["sleep", "60"], start_new_session=True)  # a forked spare leads its session
        self.spares.append(spare)
        self.end.send(b"%d" % spare.pid)
        return spare.pid

    def close(self):
        for p in [self.proc, *self.spares]:
            p.kill()
            p.wait()
        self.agent_end.close()
        self.end.close()


def test_a_node_template_answers_each_local_ranks_request_by_its_ticket():
    """One template serves every local rank: its answers come in the order of the requests, and each spare
    goes to the request it answers, whichever rank collects first. The template's "ready" alone is no
    answer (``answered`` read it as a failed fork, and ended the template, before). Each request carries
    the spare's own variables."""
    peer = _TemplatePeer()
    try:
        tmpl = peer.template
        wfd0, t0 = tmpl.request(None, None, env={"LOCAL_RANK": "0"})
        wfd1, t1 = tmpl.request(None, None, env={"LOCAL_RANK": "1"})
        os.close(wfd0)
        os.close(wfd1)
        assert [peer.read_request(), peer.read_request()] == [{b"LOCAL_RANK": b"0"}, {b"LOCAL_RANK": b"1"}]
        peer.end.send(b"R")  # imported; no fork yet
        assert not tmpl.answered(t1) and not tmpl.answered(t0)
        assert tmpl.usable() and tmpl.ready()
        pid0, pid1 = peer.fork(), peer.fork()
        assert tmpl.collect(t1, 5.0).pid == pid1  # rank 1 first: rank 0's answer is kept for it
        assert tmpl.answered(t0) and tmpl.collect(t0, 5.0).pid == pid0
        assert tmpl.usable()
    finally:
        peer.close()


def test_a_dropped_request_of_a_node_template_has_its_spare_reaped_and_a_refusal_answers_every_request():
    peer = _TemplatePeer()
    try:
        tmpl = peer.template
        tickets = peer.requests(3)
        tmpl.drop(tickets[0])  # its handoff pipe is closed: its spare goes once forked
        peer.end.send(b"R")
        dropped = peer.fork()
        kept = peer.fork()
        assert tmpl.collect(tickets[1], 5.0).pid == kept
        with pytest.raises(ProcessLookupError):  # killed and reaped
            os.kill(dropped, 0)
        peer.end.send(b"0")  # the last fork failed
        assert tmpl.collect(tickets[2], 5.0) is None and not tmpl.usable()
    finally:
        peer.close()


@pytest.mark.parametrize("end", ["refuses", "dies"])
def test_a_template_that_refuses_or_whose_channel_ends_answers_every_request_with_none(end):
    """``N`` (the template will not fork) or the channel's end (the template died) answers every waiting
    request at once with no spare, and the template is not used again; a ready check reads the same."""
    peer = _TemplatePeer()
    try:
        tmpl = peer.template
        tickets = peer.requests(2)
        if end == "refuses":
            peer.end.send(b"N")
        else:
            peer.end.close()
        assert not tmpl.ready() and not tmpl.usable()
        assert tmpl.answered(tickets[1])  # answered: with no spare, at once
        assert tmpl.collect(tickets[0], 5.0) is None and tmpl.collect(tickets[1], 5.0) is None
    finally:
        peer.close()
