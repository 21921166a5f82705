"""``TORCHELASTIC_*`` variables the launcher reads: the same effect as under torchrun, side by side.

The full list, with the ones that do not apply, is in docs/migrating-from-torchrun.md.
"""

from __future__ import annotations

import re
import signal
import subprocess

import pytest

from tests.conftest import wait_for
from tests.helpers import SCRIPTS, alive, kill_tree, launcher_env, load_envs, read_pids, run, start


@pytest.mark.slow
def test_the_log_line_prefix_template_shapes_teed_lines_as_under_torchrun(tmp_path):
    lines = {}
    for which in ("torchrun", "elaunch"):
        out = tmp_path / which
        out.mkdir()
        env = launcher_env(TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE="<$role_name|$rank|$local_rank> ")
        r = run(which, "--standalone", "--nproc-per-node=2", "--tee=1", str(SCRIPTS / "say.py"), str(out), env=env)
        assert r.returncode == 0, r.stderr
        lines[which] = sorted(line for line in r.stdout.splitlines() if line.startswith("<"))
    assert lines["elaunch"] == lines["torchrun"] == ["<default|0|0> out 0", "<default|1|1> out 1"]


@pytest.mark.slow
def test_workers_get_signals_to_handle_from_the_flag_not_the_callers_variable(tmp_path):
    # torchrun overwrites TORCHELASTIC_SIGNALS_TO_HANDLE with --signals-to-handle before
    # its process context reads it; the workers inherit the flag's value
    seen = {}
    for which in ("torchrun", "elaunch"):
        out = tmp_path / which
        out.mkdir()
        env = launcher_env(TORCHELASTIC_SIGNALS_TO_HANDLE="SIGUSR1")
        r = run(which, "--standalone", "--signals-to-handle=SIGTERM,SIGINT", str(SCRIPTS / "env_dump.py"), str(out),
                env=env)
        assert r.returncode == 0, r.stderr
        seen[which] = load_envs(out)["env_0_0"]["TORCHELASTIC_SIGNALS_TO_HANDLE"]
    assert seen["elaunch"] == seen["torchrun"] == "SIGTERM,SIGINT"


def _message(path):
    import json

    return json.loads(path.read_text())["message"]


@pytest.mark.slow
def test_a_launcher_with_an_error_file_hands_the_root_cause_up_as_torchrun(tmp_path):
    # torchrun's main is decorated with @record: run as another agent's worker, it
    # copies its root cause's error file (with the exit code) to its own
    got = {}
    for which in ("torchrun", "elaunch"):
        mine = tmp_path / f"{which}_error.json"
        r = run(which, "--standalone", "--nproc-per-node=1", str(SCRIPTS / "err_record.py"), "torch", "raise",
                env=launcher_env(TORCHELASTIC_ERROR_FILE=str(mine)))
        assert r.returncode == 1, r.stderr
        got[which] = _message(mine)
    assert got["elaunch"]["message"] == got["torchrun"]["message"] == "ValueError: boom 42"
    assert got["elaunch"]["errorCode"] == got["torchrun"]["errorCode"] == 1
    assert got["elaunch"]["extraInfo"]["py_callstack"] == got["torchrun"]["extraInfo"]["py_callstack"]


RAISE_ON_RANK_1 = """\
import os
if os.environ["RANK"] == "1":
    raise RuntimeError("boom from rank 1")
"""


@pytest.mark.slow
def test_a_run_path_worker_records_its_exception_in_its_error_file_as_under_torchrun(tmp_path):
    # torchrun runs run_script_path under torch's @record: the worker's error file holds the
    # exception, the summary shows it, and the launcher (@record'd main) copies it up
    script = tmp_path / "raise_on_1.py"
    script.write_text(RAISE_ON_RANK_1)
    got = {}
    for which in ("torchrun", "elaunch"):
        mine = tmp_path / f"{which}_error.json"
        r = run(which, "--standalone", "--nproc-per-node=2", "--run-path", str(script),
                env=launcher_env(TORCHELASTIC_ERROR_FILE=str(mine)))
        assert r.returncode == 1, r.stderr
        assert "error_file: <N/A>" not in r.stderr and "@record" not in r.stderr, r.stderr
        assert re.search(r"traceback : Traceback \(most recent call last\):", r.stderr), r.stderr
        assert mine.exists(), f"{which} wrote no error file of its own:\n{r.stderr}"
        got[which] = _message(mine)
    for message in got.values():
        assert message["message"] == "RuntimeError: boom from rank 1"
        assert message["errorCode"] == 1
        stack = message["extraInfo"]["py_callstack"]
        assert "raise_on_1.py" in stack and stack.rstrip().endswith("RuntimeError: boom from rank 1")


@pytest.mark.slow
def test_a_launcher_stopped_by_a_signal_records_it_in_its_error_file_as_torchrun(tmp_path):
    # torchrun's @record'd main writes the SignalException its handler raised to its own error file
    got = {}
    for which in ("torchrun", "elaunch"):
        out = tmp_path / which
        out.mkdir()
        mine = tmp_path / f"{which}_error.json"
        launcher = start(which, "--standalone", "--nproc-per-node=2", str(SCRIPTS / "sleeper.py"), str(out),
                         env=launcher_env(TORCHELASTIC_ERROR_FILE=str(mine)), stdout=subprocess.DEVNULL)
        try:
            files = [out / "pids_0", out / "pids_1"]
            wait_for(lambda: all(f.exists() for f in files), 60, what=f"{which}'s workers to start")
            pids = [pid for f in files for pid in read_pids(f)]
            launcher.send_signal(signal.SIGTERM)
            _, err = launcher.communicate(timeout=60)
            wait_for(lambda: not any(alive(p) for p in pids), 30, what=f"{which}'s workers to exit")
        finally:
            kill_tree(launcher.pid)
        # the status is elaunch's own (128 + signum); torchrun exits 1
        assert launcher.returncode == {"torchrun": 1, "elaunch": 128 + signal.SIGTERM}[which], err
        assert mine.exists(), f"{which} wrote no error file:\n{err}"
        got[which] = (launcher.pid, _message(mine))
    for pid, message in got.values():
        assert message["message"] == f"SignalException: Process {pid} got signal: 15"
        assert "errorCode" not in message
        stack = message["extraInfo"]["py_callstack"]
        assert stack.startswith("Traceback (most recent call last):")
        assert stack.rstrip().endswith(f"SignalException: Process {pid} got signal: 15")
        assert message["extraInfo"]["timestamp"].isdigit()


@pytest.mark.parametrize("api", ["torch.distributed.run", "elaunch.run"])
def test_main_records_a_configuration_error_in_its_error_file(api, tmp_path, monkeypatch):
    import importlib

    mine = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(mine))
    with pytest.raises(ValueError):
        importlib.import_module(api).main(["--standalone", "--logs-specs=nope", str(SCRIPTS / "env_dump.py"), "x"])
    message = _message(mine)["message"]  # "<exception type>: <text>": torch's ValueError, elaunch's ConfigError(ValueError)
    assert message.split(":")[0] in ("ValueError", "ConfigError") and "nope" in message


def _release(fifo) -> None:
    """Let a child blocked opening ``fifo`` go on (it then execs /bin/true and exits)."""
    import os

    try:
        fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
    except OSError:
        return  # no reader left (or no FIFO): nothing is blocked
    os.close(fd)


def _run_releasing(which: str, out, *args: str, env: dict, when: str | None):
    """Run a launcher; once ``when`` appears on its stderr, release the worker blocked on ``out/fifo``.

    Returns (exit code, stderr). torchrun takes no notice of a shutdown timeout here and waits 30 s
    for the stuck worker after its SIGTERM; released, the worker dies of it at once.
    """
    proc = start(which, *args, env=env, stdout=subprocess.DEVNULL)
    lines = []
    try:
        for line in proc.stderr:
            lines.append(line)
            if when is not None and when in line:
                _release(out / "fifo")
        proc.wait(timeout=60)
    finally:
        _release(out / "fifo")
        kill_tree(proc.pid)
    return proc.returncode, "".join(lines)


@pytest.mark.slow
def test_a_worker_stuck_in_uninterruptible_sleep_ends_the_job_without_restarts(tmp_path):
    # TORCHELASTIC_UNINTERRUPTIBLE_STATE_TIMEOUT=1: rank 1 stays in state D; both launchers stop
    # the group and restart nothing (torchrun then exits 0, as its UNHEALTHY is not "failed";
    # elaunch reports the stuck worker and exits 1)
    results = {}
    for which in ("torchrun", "elaunch"):
        out = tmp_path / which
        out.mkdir()
        env = launcher_env(TORCHELASTIC_UNINTERRUPTIBLE_STATE_TIMEOUT="1", TORCH_ELASTIC_SHUTDOWN_TIMEOUT="1")
        code, err = _run_releasing(which, out, "--standalone", "--nproc-per-node=2", "--max-restarts=2",
                                   "--monitor-interval=0.1", str(SCRIPTS / "d_state.py"), str(out), env=env,
                                   when="stuck in uninterruptible sleep (D-state)" if which == "torchrun" else None)
        results[which] = (code, err, sorted((out / "starts.log").read_text().split("\n")))
    (_, torch_err, torch_starts), (code, err, my_starts) = results["torchrun"], results["elaunch"]
    assert my_starts == torch_starts == ["", "0 0", "0 1"]  # one attempt each: no restart
    assert "stuck in uninterruptible sleep (D-state)" in torch_err, torch_err[-2000:]
    assert code == 1, err
    assert re.search(r"worker pid=\d+ \(local rank 1\) stuck in uninterruptible sleep \(D state\)", err), err
    root = err.split("Root Cause (first observed failure):", 1)[1]
    assert "rank      : 1 (local_rank: 1)" in root and "TORCHELASTIC_UNINTERRUPTIBLE_STATE_TIMEOUT=1 s" in root, root
