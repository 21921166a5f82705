"""The straggler watch's ``--rdzv-conf`` keys (issue 26): read by the agent, kept from the backend, bad values exit 2."""

from __future__ import annotations

import subprocess
import sys

import pytest

from elaunch.features.stragglers import StragglerSettings
from elaunch.cli import parse_config, run_argv
from elaunch.launch import rendezvous_parameters


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "train.py"
    path.write_text("print('hi')\n")
    return str(path)


def test_defaults_and_keys_kept_from_the_backend(script):
    assert parse_config([script], {}).stragglers == StragglerSettings(10.0, 0.25, 2, False)
    c = parse_config(["--rdzv-backend=c10d", "--rdzv-endpoint=h:29400", "--nnodes=2",
                      "--rdzv-conf=straggler_window=2,straggler_factor=0.4,straggler_windows=3,straggler_exclude=1,"
                      "join_timeout=5", script], {})
    assert c.stragglers == StragglerSettings(2.0, 0.4, 3, True)
    assert rendezvous_parameters(c).config == {"join_timeout": "5"}  # no backend warns it ignores them


@pytest.mark.parametrize("key, value", [("straggler_window", "-3"), ("straggler_factor", "0"),
                                        ("straggler_windows", "two"), ("straggler_exclude", "2")])
def test_bad_values_are_one_line_and_exit_2(script, capsys, key, value):
    argv = ["--rdzv-backend=c10d", "--rdzv-endpoint=h:29400", "--nnodes=2", f"--rdzv-conf={key}={value}", script]
    assert run_argv(argv, {}) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"elaunch: error: --rdzv-conf {key}={value}: must be"), lines


def test_bad_value_from_the_command(script):
    res = subprocess.run([sys.executable, "-m", "elaunch", "--standalone", "--rdzv-conf=straggler_windows=0", script],
                         capture_output=True, text=True, timeout=60, env={"PATH": "/usr/bin:/bin"})
    assert res.returncode == 2, res
    assert res.stderr.strip() == ("elaunch: error: --rdzv-conf straggler_windows=0: must be an integer >= 1 "
                                  "(windows in a row)")
