"""``--node-check`` / ``PET_NODE_CHECK`` and the ``--rdzv-conf`` key ``node_check_slow_factor`` (issue 26)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from elaunch.cli import parse_config, run_argv
from elaunch.launch import rendezvous_parameters


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "train.py"
    path.write_text("print('hi')\n")
    return str(path)


def test_node_check_is_off_by_default_and_read_from_flag_and_pet_env(script):
    c = parse_config([script], {})
    assert (c.node_check, c.node_check_slow_factor) == (False, 2.0)
    assert parse_config(["--node-check", script], {}).node_check is True
    assert parse_config(["--node_check", script], {}).node_check is True
    assert parse_config([script], {"PET_NODE_CHECK": "1"}).node_check is True
    assert parse_config([script], {"PET_NODE_CHECK": "0"}).node_check is False


def test_slow_factor_from_rdzv_conf_and_kept_from_the_backend(script):
    c = parse_config(["--rdzv-backend=c10d", "--rdzv-endpoint=h:29400", "--nnodes=2",
                      "--rdzv-conf=node_check_slow_factor=3.5,join_timeout=5", script], {})
    assert c.node_check_slow_factor == 3.5
    assert c.rdzv_configs["node_check_slow_factor"] == "3.5"  # as given; the backend does not get it:
    assert rendezvous_parameters(c).config == {"join_timeout": "5"}


@pytest.mark.parametrize("value, reason", [
    ("1", "must be a number > 1 (times the median)"),
    ("0", "must be a number > 1 (times the median)"),
    ("-2", "must be a number > 1 (times the median)"),
    ("nan", "must be a number > 1 (times the median)"),
    ("twice", "expected a number > 1 (times the median)"),
])
def test_bad_slow_factor_is_one_line_and_exit_2(script, capsys, value, reason):
    argv = ["--rdzv-backend=c10d", "--rdzv-endpoint=h:29400", "--nnodes=2", "--node-check",
            f"--rdzv-conf=node_check_slow_factor={value}", script]
    assert run_argv(argv, {}) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"elaunch: error: --rdzv-conf node_check_slow_factor={value}: {reason}"]


def test_bad_node_check_values_exit_2_from_the_command(script):
    for argv, env, line in [
        (["--rdzv-conf=node_check_slow_factor=1.0"], {},
         "elaunch: error: --rdzv-conf node_check_slow_factor=1.0: must be a number > 1 (times the median)"),
        ([], {"PET_NODE_CHECK": "maybe"}, "elaunch: error: PET_NODE_CHECK=maybe"),
    ]:
        res = subprocess.run([sys.executable, "-m", "elaunch", "--standalone", *argv, script], capture_output=True,
                             text=True, timeout=60, env={"PATH": "/usr/bin:/bin", **env})
        assert res.returncode == 2, res
        assert len(res.stderr.strip().splitlines()) == 1 and res.stderr.startswith(line), res.stderr
