"""Std parsing, log-directory layout, the tee follower and tree selection (no workers)."""

from __future__ import annotations

import io
import os
import shutil

import pytest

from elaunch.procs import LogsSpec, RunLogDir, Std, line_prefix, std_for, to_map
from elaunch.procs import _proctree
from elaunch.procs.logs import log_dir_problem
from elaunch.procs import tee as tee_module
from elaunch.procs.tee import Tee
from tests.conftest import wait_for


@pytest.mark.parametrize(
    "text, expected",
    [
        ("0", Std.NONE),
        ("1", Std.OUT),
        ("2", Std.ERR),
        ("3", Std.ALL),
        (" 3 ", Std.ALL),
        ("0:1", {0: Std.OUT}),
        ("0:3,1:0,2:1,3:2", {0: Std.ALL, 1: Std.NONE, 2: Std.OUT, 3: Std.ERR}),
        ("12:2", {12: Std.ERR}),
    ],
)
def test_from_str(text, expected):
    assert Std.from_str(text) == expected


@pytest.mark.parametrize("text", ["4", "", "-1", "a", "0:4", "0:1,", "0:1;1:2", "0=1", "1:1,1:2"])
def test_from_str_rejects_and_names_value(text):
    with pytest.raises(ValueError) as err:
        Std.from_str(text)
    assert repr(text) in str(err.value)


def test_std_for_and_to_map():
    assert std_for(Std.ERR, 5) is Std.ERR
    assert std_for({1: Std.OUT}, 1) is Std.OUT
    assert std_for({1: Std.OUT}, 0) is Std.NONE
    assert to_map({1: Std.OUT}, 2) == {0: Std.NONE, 1: Std.OUT}
    assert to_map(Std.ALL, 2) == {0: Std.ALL, 1: Std.ALL}


def test_line_prefix_default_and_template():
    assert line_prefix(None, "default", 7, 0) == "[default0]:"
    assert line_prefix("[$role_name-$rank-$local_rank] ", "trainer", 7, 1) == "[trainer-7-1] "
    assert line_prefix("$unknown:", "r", 0, 0) == "$unknown:"


def test_layout(tmp_path):
    # torch's exact layout: only redirected/tee'd streams get files
    spec = LogsSpec(log_dir=str(tmp_path / "base"), redirects={0: Std.OUT}, tee={1: Std.ERR}, capture_stderr=False)
    run = RunLogDir(spec, "job1")
    assert os.path.dirname(run.root) == str(tmp_path / "base")
    assert os.path.basename(run.root).startswith("job1_")
    logs = run.attempt(0, 3)
    a0 = os.path.join(run.root, "attempt_0")
    assert logs.dir == a0
    assert sorted(os.listdir(a0)) == ["0", "1", "2"]
    assert logs.stdout == {0: os.path.join(a0, "0", "stdout.log"), 1: None, 2: None}
    assert logs.stderr == {0: None, 1: os.path.join(a0, "1", "stderr.log"), 2: None}
    assert logs.tee_stdout == {}
    assert logs.tee_stderr == {1: os.path.join(a0, "1", "stderr.log")}
    assert logs.error_file == {lr: os.path.join(a0, str(lr), "error.json") for lr in range(3)}
    assert run.attempt(1, 1).error_file[0] == os.path.join(run.root, "attempt_1", "0", "error.json")


def test_local_ranks_filter(tmp_path):
    spec = LogsSpec(log_dir=str(tmp_path), tee=Std.OUT, local_ranks_filter=frozenset({1}), capture_stderr=False)
    logs = RunLogDir(spec, "j").attempt(0, 2)
    assert set(logs.tee_stdout) == {1}  # rank 0 still writes its file, but is not shown
    assert logs.stdout[0].endswith(os.path.join("0", "stdout.log"))
    assert logs.stderr == {0: os.devnull, 1: None}  # hidden console stream -> /dev/null


def test_stderr_is_captured_for_the_failure_summary_by_default(tmp_path):
    spec = LogsSpec(log_dir=str(tmp_path), tee={0: Std.ERR}, local_ranks_filter=frozenset({0, 1}))
    logs = RunLogDir(spec, "j").attempt(0, 3)
    a0 = os.path.join(logs.dir)
    assert logs.stderr == {lr: os.path.join(a0, str(lr), "stderr.log") for lr in range(3)}
    # shown ranks still reach the console: rank 0 tee'd with its prefix, rank 1 copied plainly
    assert logs.tee_stderr == {0: logs.stderr[0], 1: logs.stderr[1]}
    assert logs.unprefixed == {1}
    # stdout is untouched: still the console (or /dev/null when filtered out)
    assert logs.stdout == {0: None, 1: None, 2: os.devnull}


def test_temporary_log_dir_is_removed_on_request_but_a_given_one_is_kept(tmp_path):
    temp = RunLogDir(LogsSpec(), "j")
    temp.attempt(0, 1)
    assert os.path.isdir(temp.root)
    temp.remove_if_temporary()
    assert not os.path.exists(os.path.dirname(temp.root))
    given = RunLogDir(LogsSpec(log_dir=str(tmp_path)), "j")
    given.remove_if_temporary()
    assert os.path.isdir(given.root)


def test_never_overwrites_user_dirs(tmp_path):
    base = tmp_path / "logs"
    base.mkdir()
    mine = base / "job_keep"
    mine.mkdir()
    (mine / "f").write_text("user data")
    roots = {RunLogDir(LogsSpec(log_dir=str(base)), "job").root for _ in range(3)}
    assert len(roots) == 3 and str(mine) not in roots
    assert (mine / "f").read_text() == "user data"
    assert sorted(os.listdir(mine)) == ["f"]


def test_log_dir_is_a_file(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(NotADirectoryError, match=str(f)):
        RunLogDir(LogsSpec(log_dir=str(f)), "j")


def test_default_log_dir_is_temp(tmp_path, monkeypatch):
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    run = RunLogDir(LogsSpec(), "j")
    assert os.path.basename(os.path.dirname(run.root)).startswith("torchelastic_")


@pytest.mark.parametrize("kw", [{"redirects": Std.ALL}, {"tee": Std.ALL}, {"redirects": {0: Std.OUT}, "tee": {1: Std.ERR}},
                                {"redirects": Std.ALL, "local_ranks_filter": frozenset({0})}])
def test_devnull_log_dir_keeps_every_stream_on_the_console_as_torch(kw):
    # torch's DefaultLogsSpecs.reify with a /dev/null log dir: stdouts/stderrs all "" (the
    # console), tee of /dev/null (nothing, so no prefix), local_ranks_filter not applied
    run = RunLogDir(LogsSpec(log_dir=os.devnull, **kw), "j")
    logs = run.attempt(0, 2)
    assert run.root == logs.dir == os.devnull
    assert logs.stdout == {0: None, 1: None}
    assert logs.stderr == {0: None, 1: None}
    assert logs.tee_stdout == logs.tee_stderr == {} and logs.unprefixed == set()
    assert logs.error_file == {0: "", 1: ""}


@pytest.mark.parametrize("kw", [{"redirects": Std.OUT}, {"tee": Std.ERR}, {"redirects": {1: Std.ERR}}])
def test_temporary_log_dir_holding_redirected_output_is_kept(kw):
    run = RunLogDir(LogsSpec(**kw), "j")
    try:
        run.attempt(0, 2)
        run.remove_if_temporary()
        assert os.path.isdir(run.root)  # the redirected files are the program's only copy, as torchrun keeps them
    finally:
        shutil.rmtree(os.path.dirname(run.root), ignore_errors=True)


def test_log_dir_problem(tmp_path):
    assert log_dir_problem(None) is None and log_dir_problem(os.devnull) is None
    made = tmp_path / "a" / "b"
    assert log_dir_problem(str(made)) is None
    assert not (tmp_path / "a").exists()  # made by the run only: a launch failing another check leaves nothing
    assert list(tmp_path.iterdir()) == []  # the probe is gone
    f = tmp_path / "file"
    f.write_text("x")
    assert log_dir_problem(str(f)) == "exists and is not a directory"
    assert log_dir_problem(str(f / "sub")) == "cannot create it (Not a directory)"
    assert log_dir_problem("/proc/elaunch_no_such_dir").startswith("cannot create it (")
    assert log_dir_problem("/proc").startswith("cannot create a directory in it (")


def test_bad_attempt_args(tmp_path):
    run = RunLogDir(LogsSpec(log_dir=str(tmp_path)), "j")
    with pytest.raises(ValueError, match="local_world_size=0"):
        run.attempt(0, 0)


def test_tee_prefixes_lines_and_flushes_partial_line(tmp_path):
    path = tmp_path / "out.log"
    dst = io.StringIO()
    tee = Tee([(str(path), dst, "[default0]:")], interval=0.01).start()
    with open(path, "w") as f:
        f.write("one\ntwo\nthr")
    tee.stop()
    assert dst.getvalue() == "[default0]:one\n[default0]:two\n[default0]:thr\n"


@pytest.mark.parametrize("use_inotify", [True, False], ids=["inotify", "poll"])
def test_tee_copies_lines_while_running_and_a_late_file(tmp_path, use_inotify):
    """Lines reach the console while the file is still written (not only at stop), also from a file made later."""
    early, late = tmp_path / "early.log", tmp_path / "late.log"
    early.write_text("before\n")  # written before the follower started
    dst = io.StringIO()
    tee = Tee([(str(early), dst, "a:"), (str(late), dst, "b:")], interval=0.01, use_inotify=use_inotify,
              inotify_after=0).start()
    try:
        if use_inotify:
            assert tee_module.inotify_lib() is not None, "inotify_simple is a dependency: pip install -e ."
        assert tee.mode == ("inotify" if use_inotify else "poll")
        wait_for(lambda: dst.getvalue() == "a:before\n", 10, what="the line written before start")
        with open(early, "a") as f:
            f.write("one\ntw")
            f.flush()
            wait_for(lambda: "a:one\n" in dst.getvalue(), 10, what="a line while the file is written")
            f.write("o\n")
            f.flush()
            wait_for(lambda: "a:two\n" in dst.getvalue(), 10, what="the rest of a split line")
        with open(late, "w") as f:
            f.write("new\n")
        wait_for(lambda: "b:new\n" in dst.getvalue(), 10, what="a line of a file created after start")
    finally:
        tee.stop()
    assert dst.getvalue() == "a:before\na:one\na:two\nb:new\n"


@pytest.mark.parametrize("use_inotify", [True, False], ids=["inotify", "poll"])
def test_tee_without_prefix_copies_partial_lines_as_read(tmp_path, use_inotify):
    """The unprefixed copy (captured stderr) forwards bytes as they come: a ``\\r`` progress bar moves,
    a UTF-8 character split across writes comes out whole, nothing is added at the end."""
    path = tmp_path / "stderr.log"
    dst = io.StringIO()
    tee = Tee([(str(path), dst, "")], interval=0.01, use_inotify=use_inotify, inotify_after=0).start()
    try:
        with open(path, "wb", buffering=0) as f:
            for i in range(3):
                f.write(f"\r{i}/3".encode())
                wait_for(lambda: dst.getvalue().endswith(f"\r{i}/3"), 10, what=f"progress update {i}")
            f.write("\r\u00e9".encode()[:2])  # "\r" and the first byte of a 2-byte character
            wait_for(lambda: dst.getvalue().endswith("\r2/3\r"), 10, what="the bytes before a split character")
            f.write("\u00e9".encode()[1:] + b"!")
            wait_for(lambda: dst.getvalue().endswith("\r\u00e9!"), 10, what="the completed character")
    finally:
        tee.stop()
    assert dst.getvalue() == "\r0/3\r1/3\r2/3\r\u00e9!"


def test_tee_watches_with_inotify_only_once_it_has_run_a_while(tmp_path):
    """A copy stopped within its first ``inotify_after`` seconds never makes an inotify instance (whose
    close waits for an RCU grace period at the job's end); one that runs longer moves to inotify, and
    copies every line before, during and after the move."""
    path = tmp_path / "out.log"
    dst = io.StringIO()
    short = Tee([(str(path), dst, "s:")], interval=0.01, inotify_after=60).start()
    path.write_text("one\n")
    wait_for(lambda: dst.getvalue() == "s:one\n", 10, what="a line while polling")
    short.stop()
    assert short.mode == "poll" and short._watcher is None
    assert tee_module.inotify_lib() is not None, "inotify_simple is a dependency: pip install -e ."

    dst = io.StringIO()
    tee = Tee([(str(path), dst, "l:")], interval=0.01, inotify_after=0.05).start()
    try:
        assert tee.mode == "poll"
        wait_for(lambda: tee.mode == "inotify", 10, what="the move to inotify")
        with open(path, "a") as f:
            f.write("two\n")
        wait_for(lambda: dst.getvalue() == "l:one\nl:two\n", 10, what="a line after the move")
    finally:
        tee.stop()
    assert tee._watcher is None and dst.getvalue() == "l:one\nl:two\n"


def test_tee_polls_when_the_directory_cannot_be_watched(tmp_path):
    dst = io.StringIO()
    tee = Tee([(str(tmp_path / "no-such-dir" / "out.log"), dst, "p:")]).start()
    assert tee.mode == "poll"
    tee.stop()
    assert dst.getvalue() == ""


def test_tee_missing_file_is_fine(tmp_path):
    dst = io.StringIO()
    tee = Tee([(str(tmp_path / "never"), dst, "p:")], interval=0.01).start()
    tee.stop()
    tee.stop()
    assert dst.getvalue() == ""


def _p(pid, ppid, pgid=None, sid=None, start=1, state="S"):
    return _proctree.Proc(pid, ppid, pgid or pid, sid or pid, start, state)


def test_tree_selection():
    table = {
        p.pid: p
        for p in [
            _p(1, 0),
            _p(100, 1, 100, 100),  # worker (session + group leader)
            _p(101, 100, 100, 100),  # its child in the group
            _p(102, 101, 102, 102),  # grandchild that did setsid, parent alive
            _p(103, 1, 100, 100),  # orphan still in the session
            _p(104, 1, 104, 104, start=7),  # orphan that did setsid: only known by snapshot
            _p(105, 104, 104, 104),  # and its child
            _p(200, 1, 200, 200),  # unrelated
        ]
    }
    assert set(_proctree.tree(table, roots=[100], groups=[100])) == {100, 101, 102, 103}
    assert set(_proctree.tree(table, roots=[100], groups=[100], known=[(104, 7)])) == {100, 101, 102, 103, 104, 105}
    assert set(_proctree.tree(table, known=[(104, 8)])) == set()  # pid reused: not ours


def test_proctree_reads_self():
    me = _proctree.read(os.getpid())
    assert me.pid == os.getpid() and me.ppid == os.getppid() and me.pgid == os.getpgid(0)
    assert os.getpid() in _proctree.scan()
    assert _proctree.read(2**22 + 12345) is None
