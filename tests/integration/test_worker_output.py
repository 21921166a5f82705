"""Where workers' output goes, end to end (``python -m elaunch --standalone``), where it used to differ from torchrun.

* ``--log-dir /dev/null`` keeps every stream on the console, whatever ``--redirects``/``--tee`` say
  (torch's ``DefaultLogsSpecs.reify``);
* without ``--log-dir``, a temporary log directory holding redirected output is kept after success;
* a bad ``--log-dir`` is one ``elaunch: error:`` line and exit status 2 before anything runs
  (a ValueError from the Python APIs);
* a worker's stderr, captured for the failure summary, reaches the console as it is written,
  partial lines included (a ``\\r`` progress bar moves).
"""

from __future__ import annotations

import glob
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from tests.conftest import wait_for
from tests.helpers import kill_tree, launcher_cmd, launcher_env, run

OUTPUT = """\
import os, sys
os.write(1, f"out {os.environ['LOCAL_RANK']}\\n".encode())  # one write each: the ranks share the console
os.write(2, f"err {os.environ['LOCAL_RANK']}\\n".encode())
"""


def _script(tmp_path: Path, text: str = OUTPUT) -> str:
    path = tmp_path / "train.py"
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize("flags", [["--redirects=3"], ["--tee=3"], ["--redirects=1", "--tee=2"],
                                   ["--redirects=3", "--local-ranks-filter=0"]],
                         ids=["redirects", "tee", "redirects+tee", "redirects+filter"])
def test_devnull_log_dir_keeps_every_stream_on_the_console(tmp_path, flags):
    # torch's DefaultLogsSpecs.reify with /dev/null: every stdout/stderr is "" (the console), the
    # tee'd file is /dev/null (so nothing prefixed), and local_ranks_filter is not applied
    proc = run("elaunch", "--standalone", "--nproc-per-node=2", "--monitor-interval=0.1", "--log-dir", os.devnull,
               *flags, _script(tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert sorted(proc.stdout.splitlines()) == ["out 0", "out 1"], proc.stdout
    assert {"err 0", "err 1"} <= set(proc.stderr.splitlines()), proc.stderr


@pytest.mark.parametrize("flags", [["--redirects=3"], ["--tee=1"]], ids=["redirects", "tee"])
def test_temporary_log_dir_holding_redirected_output_is_kept(tmp_path, flags):
    temp = tmp_path / "tmp"
    temp.mkdir()
    proc = run("elaunch", "--standalone", "--nproc-per-node=2", "--monitor-interval=0.1", *flags,
               _script(tmp_path), env=launcher_env(TMPDIR=str(temp), LOGLEVEL="INFO"))
    assert proc.returncode == 0, proc.stderr
    [root] = glob.glob(str(temp / "torchelastic_*" / "*"))  # <tmp>/torchelastic_<random>/<run_id>_<random>
    assert f"log directory set to: {root}" in proc.stderr  # torch's INFO line names it
    for lr in (0, 1):
        assert (Path(root) / "attempt_0" / str(lr) / "stdout.log").read_text() == f"out {lr}\n"


def test_temporary_log_dir_without_redirected_output_is_removed(tmp_path):
    temp = tmp_path / "tmp"
    temp.mkdir()
    proc = run("elaunch", "--standalone", "--nproc-per-node=2", "--monitor-interval=0.1", _script(tmp_path),
               env=launcher_env(TMPDIR=str(temp)))
    assert proc.returncode == 0, proc.stderr
    assert glob.glob(str(temp / "torchelastic_*")) == []  # only elaunch's own stderr capture was there


def _bad_log_dirs(tmp_path: Path) -> dict[str, tuple[str, str]]:
    """id -> (--log-dir, what the error line says about it)."""
    a_file = tmp_path / "a_file"
    a_file.write_text("mine\n")
    return {
        "file": (str(a_file), "exists and is not a directory"),
        "under-a-file": (str(a_file / "logs"), "cannot create it (Not a directory)"),
        "under-proc": ("/proc/elaunch_logs", "cannot create it ("),
        "proc": ("/proc", "cannot create a directory in it ("),
    }


@pytest.mark.parametrize("case", ["file", "under-a-file", "under-proc", "proc"])
def test_bad_log_dir_is_one_line_and_exit_2_before_anything_runs(tmp_path, case):
    log_dir, why = _bad_log_dirs(tmp_path)[case]
    ran = tmp_path / "ran"
    script = _script(tmp_path, f"open({str(ran)!r}, 'w').close()\n")
    proc = subprocess.run(launcher_cmd("elaunch", "--standalone", "--nproc-per-node=2", f"--log-dir={log_dir}",
                                       script), capture_output=True, text=True, env=launcher_env(), timeout=120)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]  # not even the OMP_NUM_THREADS warning
    assert proc.returncode == 2, proc.stderr
    assert len(lines) == 1 and lines[0].startswith(f"elaunch: error: --log-dir={log_dir}: {why}"), proc.stderr
    assert "Traceback" not in proc.stderr and not ran.exists()
    assert (tmp_path / "a_file").read_text() == "mine\n"  # nothing the user had is touched


def test_bad_log_dir_is_a_value_error_from_the_python_apis(tmp_path):
    pytest.importorskip("torch")
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs

    from elaunch.launcher.api import LaunchConfig, elastic_launch
    from elaunch.run import parse_args, run as run_args

    saved = dict(os.environ)
    try:
        for log_dir, why in _bad_log_dirs(tmp_path).values():
            with pytest.raises(ValueError, match=re.escape(f"--log-dir={log_dir}: {why}")):
                run_args(parse_args(["--standalone", f"--log-dir={log_dir}", _script(tmp_path)]))
        # torch's DefaultLogsSpecs accepts an existing directory it cannot write in; elaunch refuses it at once
        config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=1, rdzv_backend="c10d",
                              rdzv_endpoint="127.0.0.1:0", logs_specs=DefaultLogsSpecs(log_dir="/proc"))
        with pytest.raises(ValueError, match="--log-dir=/proc: cannot create a directory in it"):
            elastic_launch(config, sys.executable)("-c", "pass")
    finally:
        os.environ.clear()
        os.environ.update(saved)


PROGRESS = """\
import os, sys, time
for i in range(3):
    sys.stderr.write(f"\\rstep {i}/3")
    sys.stderr.flush()
    deadline = time.monotonic() + 60  # the test creates go<i> once it saw this update on the console
    while not os.path.exists(os.path.join(sys.argv[1], f"go{i}")):
        if time.monotonic() > deadline:
            sys.exit(3)
        time.sleep(0.01)
sys.stderr.write("\\rdone\\n")
"""


def test_captured_stderr_reaches_the_console_as_it_is_written(tmp_path):
    """A tqdm-like progress bar (``\\r`` updates, no newline): each update is on the agent's stderr
    before the worker writes the next one."""
    script = _script(tmp_path, PROGRESS)
    proc = subprocess.Popen(launcher_cmd("elaunch", "--standalone", "--nproc-per-node=1", "--monitor-interval=0.1",
                                         script, str(tmp_path)),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=launcher_env())
    seen = bytearray()

    def read() -> None:
        while chunk := os.read(proc.stderr.fileno(), 65536):
            seen.extend(chunk)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        for i in range(3):
            wait_for(lambda: f"\rstep {i}/3".encode() in seen, 60, what=f"progress update {i} on the console")
            (tmp_path / f"go{i}").touch()
        assert proc.wait(timeout=120) == 0, bytes(seen).decode(errors="replace")
    finally:
        kill_tree(proc.pid)
        reader.join(timeout=10)
        proc.stderr.close()
    out = bytes(seen).decode()
    assert "\rstep 0/3\rstep 1/3\rstep 2/3\rdone\n" in out, out
