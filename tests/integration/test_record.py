"""elaunch's @record against torch's, in real worker processes.

Each case runs tests/scripts/err_record.py once with torch's decorator and once
with ours, TORCHELASTIC_ERROR_FILE pointing into a tmp dir, and compares.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from elaunch.errors import (
    ChildFailedError,
    error_message,
    error_timestamp,
    error_traceback,
    format_failure_summary,
    read_error_file,
    root_cause,
    tail_file,
)
from elaunch.spec import ProcessFailure
from tests.conftest import SCRIPTS

SCRIPT = str(SCRIPTS / "err_record.py")


def run_worker(which: str, mode: str, error_file: str | None, tmp_path, timeout: float = 60.0):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC_", "PET_"))}
    if error_file:
        env["TORCHELASTIC_ERROR_FILE"] = error_file
    stderr_path = tmp_path / f"{which}-{mode}.stderr"
    with open(stderr_path, "wb") as err:
        proc = subprocess.run(
            [sys.executable, SCRIPT, which, mode], env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=err, timeout=timeout
        )
    return proc.returncode, proc.stdout.decode(), str(stderr_path)


def shape(obj):
    """The key structure of a JSON value, with leaf types."""
    if isinstance(obj, dict):
        return {k: shape(v) for k, v in obj.items()}
    return type(obj).__name__


def test_error_file_has_torch_shape(tmp_path):
    files = {}
    for which in ("torch", "elaunch"):
        path = str(tmp_path / f"{which}.json")
        before = int(time.time())
        rc, out, _ = run_worker(which, "raise", path, tmp_path)
        after = int(time.time())
        assert rc == 1, which
        assert "returned" not in out
        with open(path) as fp:
            files[which] = json.load(fp)
        ts = files[which]["message"]["extraInfo"]["timestamp"]
        assert ts.isdigit() and before <= int(ts) <= after, (which, ts)
    assert shape(files["elaunch"]) == shape(files["torch"])
    assert shape(files["elaunch"]) == {
        "message": {"message": "str", "extraInfo": {"py_callstack": "str", "timestamp": "str"}}
    }
    assert files["elaunch"]["message"]["message"] == files["torch"]["message"]["message"] == "ValueError: boom 42"
    for data in files.values():
        tb = data["message"]["extraInfo"]["py_callstack"]
        assert tb.startswith("Traceback (most recent call last):")
        assert tb.rstrip().endswith("ValueError: boom 42")
        assert "err_record.py" in tb


def test_read_error_file_reads_torch_written_file(tmp_path):
    path = str(tmp_path / "torch.json")
    before = int(time.time())
    assert run_worker("torch", "raise", path, tmp_path)[0] == 1
    data = read_error_file(path)
    assert error_message(data) == "ValueError: boom 42"
    assert "raise ValueError" in error_traceback(data)
    assert before <= error_timestamp(data) <= time.time()


def test_chained_exception_recorded_with_cause(tmp_path):
    path = str(tmp_path / "e.json")
    rc, _, _ = run_worker("elaunch", "chained", path, tmp_path)
    assert rc == 1
    data = read_error_file(path)
    assert error_message(data) == "KeyError: 'outer'"
    tb = error_traceback(data)
    assert "ValueError: inner cause" in tb and "direct cause" in tb


@pytest.mark.parametrize(
    "which, mode, expected_rc, returned",
    [
        ("torch", "exit0", 0, True),
        ("elaunch", "exit0", 0, True),
        ("torch", "exit3", 3, False),
        ("elaunch", "exit3", 3, False),
        ("elaunch", "ok", 0, True),
    ],
)
def test_exits_are_not_recorded(tmp_path, which, mode, expected_rc, returned):
    path = tmp_path / "e.json"
    rc, out, _ = run_worker(which, mode, str(path), tmp_path)
    assert rc == expected_rc
    assert ("returned" in out) is returned
    assert not path.exists()


def test_elaunch_record_does_not_import_torch(tmp_path):
    rc, out, _ = run_worker("elaunch", "ok", None, tmp_path)
    assert rc == 0 and "torch not imported" in out


def test_without_error_file_env_traceback_goes_to_stderr_only(tmp_path):
    rc, _, stderr_path = run_worker("elaunch", "raise", None, tmp_path)
    assert rc == 1
    assert sorted(os.listdir(tmp_path)) == ["elaunch-raise.stderr"]
    assert tail_file(stderr_path, lines=1) == "ValueError: boom 42"


def test_summary_from_real_failures(tmp_path):
    """A recorded exception, a SIGKILLed worker and a bare exit, summarised as the agent would."""
    recorded = str(tmp_path / "rank0.json")
    rc0, _, err0 = run_worker("elaunch", "raise", recorded, tmp_path)
    t0 = time.time()
    rc1, _, err1 = run_worker("elaunch", "exit3", str(tmp_path / "rank1.json"), tmp_path)
    t1 = time.time()
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    sleeper.send_signal(signal.SIGKILL)
    rc2 = sleeper.wait(timeout=30)
    assert (rc0, rc1, rc2) == (1, 3, -signal.SIGKILL)
    failures = {
        # rank 0 recorded first, but was noticed last: its file's timestamp makes it the root cause
        0: ProcessFailure(0, 0, 11, rc0, t1 + 100, "host-a", recorded, read_error_file(recorded), tail_file(err0)),
        1: ProcessFailure(1, 1, 12, rc1, t0 + 50, "host-a", str(tmp_path / "rank1.json"),
                          read_error_file(str(tmp_path / "rank1.json")), tail_file(err1)),
        2: ProcessFailure(0, 2, sleeper.pid, rc2, t1 + 60, "host-b"),
    }
    assert root_cause(failures).global_rank == 0
    text = format_failure_summary(failures, title="err_record.py FAILED")
    root, others = text.split("Other Failures:")
    assert "rank      : 0 (local_rank: 0)" in root and "host      : host-a" in root
    assert "ValueError: boom 42" in root and "Traceback (most recent call last):" in root
    assert f"exitcode  : -9 (pid: {sleeper.pid}) (SIGKILL)" in others
    assert f"Signal 9 (SIGKILL) received by PID {sleeper.pid}" in others
    assert "exitcode  : 3 (pid: 12)" in others and "no error file" in others
    assert "stderr tail (last 1 line of the worker's stderr):\n    giving up with status 3" in others
    assert str(ChildFailedError("err_record.py", failures)).strip() == text
