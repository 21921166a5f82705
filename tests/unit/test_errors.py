"""Unit tests of elaunch.errors: error files, root cause, the failure table, @record in-process."""

from __future__ import annotations

import json
import os
import re
import socket

import pytest

from elaunch.errors import (
    ChildFailedError,
    ErrorHandler,
    error_message,
    error_timestamp,
    error_traceback,
    format_failure_summary,
    read_error_file,
    record,
    root_cause,
    tail_file,
)
from elaunch.errors.summary import EXIT_ABORT_HINT
from elaunch.spec import ProcessFailure

T0 = 1_700_000_000.0


def torch_data(msg="ValueError: bad", ts=T0, tb="Traceback (most recent call last):\n  File \"t.py\", line 1\nValueError: bad\n"):
    return {"message": {"message": msg, "extraInfo": {"py_callstack": tb, "timestamp": str(int(ts))}}}


def failure(rank, exitcode=1, t=T0, data=None, stderr="", local_rank=None, host="node-a", error_file="", written=None):
    return ProcessFailure(
        local_rank=rank if local_rank is None else local_rank,
        global_rank=rank,
        pid=1000 + rank,
        exitcode=exitcode,
        timestamp=t,
        hostname=host,
        error_file=error_file,
        error_data=data,
        stderr_tail=stderr,
        error_time=written,
    )


# ---------------------------------------------------------------- read_error_file


def test_read_error_file_missing_none_and_empty(tmp_path):
    assert read_error_file(None) is None
    assert read_error_file("") is None
    assert read_error_file(str(tmp_path / "nope.json")) is None
    empty = tmp_path / "empty.json"
    empty.write_text("")
    assert read_error_file(str(empty)) is None
    blank = tmp_path / "blank.json"
    blank.write_text("  \n")
    assert read_error_file(str(blank)) is None


def test_read_error_file_torch_and_string_forms(tmp_path):
    p = tmp_path / "e.json"
    p.write_text(json.dumps(torch_data()))
    assert read_error_file(str(p)) == torch_data()
    p.write_text(json.dumps({"message": "RuntimeError: old", "timestamp": 1700000005}))
    data = read_error_file(str(p))
    assert error_message(data) == "RuntimeError: old"
    assert error_timestamp(data) == 1700000005.0
    assert error_traceback(data) == ""


@pytest.mark.parametrize(
    "content, why",
    [
        ('{"message": {"mess', "invalid JSON"),
        ("[1, 2]", "expected a JSON object, got list"),
        ('"just a string"', "expected a JSON object, got str"),
        (b"\xff\xfe\x00garbage", "invalid JSON"),
    ],
)
def test_read_error_file_unreadable_never_raises(tmp_path, content, why):
    p = tmp_path / "bad.json"
    if isinstance(content, bytes):
        p.write_bytes(content)
    else:
        p.write_text(content)
    data = read_error_file(str(p))
    assert data["unreadable"] is True
    assert str(p) in data["message"] and why in data["message"]
    assert error_timestamp(data) is None


def test_read_error_file_on_a_directory_reports_it(tmp_path):
    data = read_error_file(str(tmp_path))
    assert data["unreadable"] is True and str(tmp_path) in data["message"]


@pytest.mark.parametrize(
    "data, expected",
    [
        (torch_data(ts=T0), T0),
        ({"message": "x", "timestamp": "1700000001"}, 1700000001.0),
        ({"message": "x", "timestamp": 1700000001.5}, 1700000001.5),
        ({"message": "x"}, None),  # torch would use 0 here
        ({"message": {"message": "x", "extraInfo": {}}}, None),
        ({"message": {"message": "x", "extraInfo": {"timestamp": "soon"}}}, None),
        ({"message": {"message": "x", "extraInfo": {"timestamp": "0"}}}, None),
        ({"message": "x", "timestamp": True}, None),
        ({"message": "bad", "unreadable": True, "timestamp": 5}, None),
        ({}, None),
        (None, None),
    ],
)
def test_error_timestamp_table(data, expected):
    assert error_timestamp(data) == expected


# ---------------------------------------------------------------- root cause


@pytest.mark.parametrize(
    "failures, expected_rank",
    [
        # exit times only: earliest wins
        ({0: failure(0, t=T0 + 5), 1: failure(1, t=T0 + 1)}, 1),
        # error-file timestamp beats a later exit time of the same worker
        ({0: failure(0, t=T0 + 3), 1: failure(1, t=T0 + 9, data=torch_data(ts=T0 + 1))}, 1),
        # SIGKILLed worker (no file) exited before the one that recorded later
        ({0: failure(0, exitcode=-9, t=T0 + 1), 1: failure(1, t=T0 + 9, data=torch_data(ts=T0 + 4))}, 0),
        # tie → lowest global rank, whatever the dict order
        ({3: failure(3, t=T0), 2: failure(2, t=T0), 5: failure(5, t=T0)}, 2),
        # tie between file timestamp and exit time → lowest rank
        ({4: failure(4, t=T0 + 1, data=torch_data(ts=T0)), 7: failure(7, t=T0)}, 4),
        # both recorded in the same whole second: the files' mtimes decide, not the rank
        ({0: failure(0, t=T0 + 2, data=torch_data(ts=T0), written=T0 + 0.31),
          1: failure(1, t=T0 + 3, data=torch_data(ts=T0), written=T0 + 0.12)}, 1),
        # unreadable file falls back to the exit time
        ({0: failure(0, t=T0 + 2, data={"message": "x", "unreadable": True}), 1: failure(1, t=T0 + 3)}, 0),
        # string-form file without timestamp falls back to exit time (not 0)
        ({0: failure(0, t=T0 + 2, data={"message": "old"}), 1: failure(1, t=T0 + 1)}, 1),
    ],
)
def test_root_cause_table(failures, expected_rank):
    assert root_cause(failures).global_rank == expected_rank
    assert ChildFailedError("x", failures).get_first_failure()[0] == expected_rank


def test_root_cause_empty_raises():
    with pytest.raises(ValueError, match="empty"):
        root_cause({})
    with pytest.raises(ValueError, match="empty"):
        format_failure_summary({}, title="x FAILED")
    with pytest.raises(ValueError, match="empty"):
        ChildFailedError("train.py", {})


# ---------------------------------------------------------------- the table


def _sections(text):
    root = text.split("Root Cause (first observed failure):\n", 1)[1].split("\nOther Failures:\n", 1)[0]
    others = text.split("\nOther Failures:\n", 1)[1]
    return root, others


def test_summary_shape_and_root_cause_fields():
    failures = {
        0: failure(0, exitcode=-9, t=T0 + 10, stderr="loading\nkilled here"),
        1: failure(1, exitcode=1, t=T0 + 20, data=torch_data(ts=T0 + 2), error_file="/r/1/error.json", local_rank=1),
    }
    text = format_failure_summary(failures, title="train.py FAILED")
    lines = text.split("\n")
    assert set(lines[0]) == {"="} and lines[0] == lines[-1]
    assert lines[1] == "train.py FAILED"
    assert set(lines[2]) == {"-"}
    assert len(lines[0]) <= 60
    root, others = _sections(text)
    assert root.startswith("[0]:\n")
    assert "  host      : node-a" in root
    assert "  rank      : 1 (local_rank: 1)" in root
    assert "  exitcode  : 1 (pid: 1001)" in root
    assert "  error_file: /r/1/error.json" in root
    assert "  traceback : Traceback (most recent call last):\n    File \"t.py\", line 1\n  ValueError: bad" in root
    assert re.search(r"  time      : \d{4}-\d\d-\d\d_\d\d:\d\d:\d\d\n", root)
    # the other failure: signal name, pid, stderr tail labelled as such
    assert others.startswith("[1]:\n")
    assert "  exitcode  : -9 (pid: 1000) (SIGKILL)" in others
    assert "  traceback : Signal 9 (SIGKILL) received by PID 1000" in others
    assert "  stderr tail (last 2 lines of the worker's stderr):\n    loading\n    killed here" in others
    assert "  error_file: <N/A>" in others


def test_summary_no_error_file_shows_stderr_tail():
    f = failure(2, exitcode=2, stderr="usage: x\nerror: bad flag --foo", error_file="/r/2/error.json")
    text = format_failure_summary({2: f}, title="t FAILED")
    root, others = _sections(text)
    assert "  error_file: <N/A>" in root  # path given but never written: torch shows <N/A> too
    assert "no error file" in root and "@record" in root
    assert "stderr tail (last 2 lines" in root and "    error: bad flag --foo" in root
    assert "<NO_OTHER_FAILURES>" in others


def test_summary_names_the_gloo_exit_race_without_blaming_the_script():
    # issue 22 item 2: a worker that printed its last line and then died of SIGABRT in gloo's
    # teardown. Issue 35: scripts that do destroy their group die of it too, so the hint names the
    # known race and what makes it rarer, and does not claim the group was never destroyed
    abort = "Done\nterminate called without an active exception\n"
    text = format_failure_summary({0: failure(0, exitcode=-6, stderr=abort)}, title="t FAILED")
    assert "  exitcode  : -6 (pid: 1000) (SIGABRT)" in text
    (line,) = [ln for ln in text.splitlines() if ln.startswith("  hint      : ")]
    assert line == f"  hint      : {EXIT_ABORT_HINT}" and len(line) <= 125
    assert "race" in EXIT_ABORT_HINT and "destroy_process_group() makes it rarer" in EXIT_ABORT_HINT
    assert "never destroyed" not in EXIT_ABORT_HINT and "most likely" not in EXIT_ABORT_HINT
    for other in (failure(0, exitcode=-6, stderr="Done\n"), failure(0, exitcode=1, stderr=abort),
                  failure(0, exitcode=-9, stderr=abort)):  # another abort, an exit status, another signal
        assert "hint" not in format_failure_summary({0: other}, title="t FAILED")


def test_summary_without_anything_points_to_docs_like_torch():
    text = format_failure_summary({0: failure(0, exitcode=1)}, title="t FAILED")
    assert "traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html" in text
    assert "stderr tail" not in text


def test_summary_string_form_and_unreadable_file():
    failures = {
        0: failure(0, t=T0, data={"message": "RuntimeError: old style", "timestamp": int(T0)}),
        1: failure(1, t=T0 + 1, data=read_error_file(__file__), stderr="last words"),  # a .py file: not JSON
    }
    text = format_failure_summary(failures, title="t FAILED")
    root, others = _sections(text)
    assert "traceback : RuntimeError: old style" in root
    assert "unreadable error file" in others and "stderr tail (last 1 line of" in others
    assert "    last words" in others


def test_summary_orders_other_failures_by_time_and_uses_fqdn_without_host():
    failures = {r: failure(r, t=T0 + t, host="") for r, t in [(0, 5), (1, 3), (2, 1), (3, 4)]}
    text = format_failure_summary(failures, title="t FAILED")
    order = [int(m) for m in re.findall(r"  rank      : (\d+) ", text)]
    assert order == [2, 1, 3, 0]
    assert f"  host      : {socket.getfqdn()}" in text
    assert re.findall(r"^\[(\d+)\]:$", text, re.M) == ["0", "1", "2", "3"]


def test_child_failed_error_message_is_the_table():
    exc = ChildFailedError("train.py", {0: failure(0, exitcode=-15)})
    assert str(exc).startswith("\n=")
    assert "train.py FAILED" in str(exc) and "Signal 15 (SIGTERM) received by PID 1000" in str(exc)
    assert str(exc).strip() == exc.format_msg()


# ---------------------------------------------------------------- tail_file


def test_tail_file_basic(tmp_path):
    p = tmp_path / "err.log"
    p.write_text("".join(f"line {i}\n" for i in range(100)) + "\n\n")
    assert tail_file(str(p), lines=3) == "line 97\nline 98\nline 99"
    assert tail_file(str(p)).split("\n")[0] == "line 80"
    assert tail_file(None) == ""
    assert tail_file(str(tmp_path / "missing")) == ""
    (tmp_path / "empty").write_text("")
    assert tail_file(str(tmp_path / "empty")) == ""


def test_tail_file_window_drops_cut_line_keeps_whole_one(tmp_path):
    p = tmp_path / "err.log"
    p.write_bytes(b"x" * 1000 + b"\nabc\ndef\n")
    # window of 8 bytes "abc\ndef\n": starts right after a newline → "abc" kept
    assert tail_file(str(p), max_bytes=8) == "abc\ndef"
    # window of 7 bytes "bc\ndef\n": "bc" is a cut line → dropped
    assert tail_file(str(p), max_bytes=7) == "def"
    # a single cut line is better than nothing
    assert tail_file(str(p), max_bytes=3) == "ef"
    # file exactly max_bytes long: nothing cut
    q = tmp_path / "exact.log"
    q.write_bytes(b"ab\ncd\n")
    assert tail_file(str(q), max_bytes=6) == "ab\ncd"
    assert tail_file(str(q), max_bytes=5) == "cd"


def test_tail_file_bad_bytes_and_bad_args(tmp_path):
    p = tmp_path / "bin.log"
    p.write_bytes(b"ok\n\xff\xfe oops\n")
    assert tail_file(str(p)) == "ok\n\ufffd\ufffd oops"
    with pytest.raises(ValueError, match="lines=0"):
        tail_file(str(p), lines=0)
    with pytest.raises(ValueError, match="max_bytes=-1"):
        tail_file(str(p), max_bytes=-1)


# ---------------------------------------------------------------- @record in-process


class QuietHandler(ErrorHandler):
    """The default handler minus faulthandler (pytest's captured stderr has no fileno)."""

    def initialize(self) -> None:
        pass


def test_record_writes_torch_shape_atomically_and_reraises(tmp_path, monkeypatch):
    path = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))

    @record(error_handler=QuietHandler())
    def main(x):
        raise ValueError(f"bad value {x}")

    with pytest.raises(ValueError, match="bad value 7"):
        main(7)
    data = json.loads(path.read_text())
    assert set(data) == {"message"}
    assert set(data["message"]) == {"message", "extraInfo"}
    assert data["message"]["message"] == "ValueError: bad value 7"
    assert set(data["message"]["extraInfo"]) == {"py_callstack", "timestamp"}
    assert data["message"]["extraInfo"]["timestamp"].isdigit()
    assert "in main" in data["message"]["extraInfo"]["py_callstack"]
    assert os.listdir(tmp_path) == ["error.json"]  # no temporary file left


def test_record_success_and_exit0_write_nothing(tmp_path, monkeypatch):
    path = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))

    @record(error_handler=QuietHandler())
    def ok():
        return 5

    @record(error_handler=QuietHandler())
    def exit0():
        raise SystemExit(0)

    @record(error_handler=QuietHandler())
    def exit4():
        raise SystemExit(4)

    assert ok() == 5 and ok.__name__ == "ok"
    assert exit0() is None
    with pytest.raises(SystemExit) as info:
        exit4()
    assert info.value.code == 4
    assert not path.exists()


def test_record_without_env_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_ERROR_FILE", raising=False)
    monkeypatch.chdir(tmp_path)

    @record(error_handler=QuietHandler())
    def main():
        raise RuntimeError("x")

    with pytest.raises(RuntimeError):
        main()
    assert os.listdir(tmp_path) == []


def test_record_uses_given_handler():
    calls = []

    class Spy:
        def initialize(self):
            calls.append("init")

        def record_exception(self, exc):
            calls.append(("exc", str(exc)))

    @record(error_handler=Spy())
    def main():
        raise KeyError("k")

    with pytest.raises(KeyError):
        main()
    assert calls == ["init", ("exc", "'k'")]


def test_record_child_failed_copies_root_cause_file_with_exit_code(tmp_path, monkeypatch):
    child = tmp_path / "child.json"
    child.write_text(json.dumps(torch_data(ts=T0)))
    mine = tmp_path / "mine.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(mine))
    failures = {
        0: failure(0, exitcode=-9, t=T0 + 5),
        1: failure(1, exitcode=-11, t=T0 + 9, data=torch_data(ts=T0), error_file=str(child)),
    }

    @record(error_handler=QuietHandler())
    def launcher():
        raise ChildFailedError("train.py", failures)

    with pytest.raises(ChildFailedError):
        launcher()
    data = json.loads(mine.read_text())
    assert data["message"]["errorCode"] == -11
    assert data["message"]["message"] == "ValueError: bad"


def test_record_copies_the_root_cause_of_torchs_own_child_failed_error_and_takes_its_handler_by_position(
        tmp_path, monkeypatch):
    """torch's launcher called inside elaunch's ``@record`` (torch's ChildFailedError): the root cause's error
    file is copied, as torch's ``@record`` does, not the exception's traceback recorded; and ``record(fn,
    handler)`` takes the handler by position, as torch's ``record(fn, error_handler=None)``."""
    pytest.importorskip("torch")
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError as TorchChildFailedError
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure as TorchProcessFailure

    child = tmp_path / "child.json"
    child.write_text(json.dumps(torch_data(msg="RuntimeError: in the child", ts=T0)))
    mine = tmp_path / "mine.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(mine))

    def launcher():
        raise TorchChildFailedError("train.py", {3: TorchProcessFailure(0, 123, 7, str(child))})

    with pytest.raises(TorchChildFailedError):
        record(launcher, QuietHandler())()
    data = json.loads(mine.read_text())
    assert data["message"]["message"] == "RuntimeError: in the child" and data["message"]["errorCode"] == 7
