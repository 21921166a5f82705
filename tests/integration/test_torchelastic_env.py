"""``TORCHELASTIC_*`` variables the launcher reads: the same effect as under torchrun, side by side.

The full list, with the ones that do not apply, is in docs/migrating-from-torchrun.md.
"""

from __future__ import annotations

import pytest

from tests.helpers import SCRIPTS, launcher_env, load_envs, run


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


@pytest.mark.parametrize("api", ["torch.distributed.run", "elaunch.run"])
def test_main_records_a_configuration_error_in_its_error_file(api, tmp_path, monkeypatch):
    import importlib

    mine = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(mine))
    with pytest.raises(ValueError):
        importlib.import_module(api).main(["--standalone", "--logs-specs=nope", str(SCRIPTS / "env_dump.py"), "x"])
    message = _message(mine)["message"]  # "<exception type>: <text>": torch's ValueError, elaunch's ConfigError(ValueError)
    assert message.split(":")[0] in ("ValueError", "ConfigError") and "nope" in message
