"""The click command: flag spellings, PET_* fallbacks, pass-through, help, entry points."""

from __future__ import annotations

import subprocess
import sys

import click
import pytest

from elaunch.cli import main, parse_config, run_argv
from elaunch.config import ConfigError
from elaunch.procs.std import Std


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "train.py"
    path.write_text("import sys\nprint('ARGV', sys.argv[1:], __name__)\n")
    return str(path)


@pytest.mark.parametrize(
    "flag, value, field, expected",
    [
        ("--nnodes", "1:3", "max_nodes", 3),
        ("--nproc-per-node", "3", "nproc_per_node", 3),
        ("--nproc_per_node", "3", "nproc_per_node", 3),
        ("--max-restarts", "4", "max_restarts", 4),
        ("--max_restarts", "4", "max_restarts", 4),
        ("--monitor-interval", "0.5", "monitor_interval", 0.5),
        ("--monitor_interval", "0.5", "monitor_interval", 0.5),
        ("--start-method", "fork", "start_method", "fork"),
        ("--start_method", "fork", "start_method", "fork"),
        ("--role", "trainer", "role", "trainer"),
        ("--log-dir", "/tmp/x", "log_dir", "/tmp/x"),
        ("--log_dir", "/tmp/x", "log_dir", "/tmp/x"),
        ("-r", "3", "redirects", Std.ALL),
        ("--redirects", "0:1", "redirects", {0: Std.OUT}),
        ("-t", "2", "tee", Std.ERR),
        ("--tee", "2", "tee", Std.ERR),
        ("--local-ranks-filter", "0,1", "local_ranks_filter", frozenset({0, 1})),
        ("--local_ranks_filter", "1", "local_ranks_filter", frozenset({1})),
        ("--duplicate-stdout-filters", "a,b", "duplicate_stdout_filters", ("a", "b")),
        ("--duplicate_stderr_filters", "x", "duplicate_stderr_filters", ("x",)),
        ("--event-log-handler", "console", "event_log_handler", "console"),
        ("--event_log_handler", "console", "event_log_handler", "console"),
        ("--local-addr", "10.0.0.1", "local_addr", "10.0.0.1"),
        ("--local_addr", "10.0.0.1", "local_addr", "10.0.0.1"),
        ("--logs-specs", "default", "logs_specs", "default"),  # torch registers "default"
        ("--logs_specs", "default", "logs_specs", "default"),
        ("--numa-binding", "socket", "numa_binding", "socket"),
        ("--numa_binding", "node", "numa_binding", "node"),
        ("--signals-to-handle", "SIGUSR1", "signals_to_handle", ("SIGUSR1",)),
        ("--signals_to_handle", "SIGTERM,SIGUSR2", "signals_to_handle", ("SIGTERM", "SIGUSR2")),
        ("--forward-signals", "SIGUSR2,winch", "forward_signals", ("SIGUSR2", "SIGWINCH")),
        ("--forward_signals", "SIGUSR1", "forward_signals", ("SIGUSR1",)),
        ("--forward-signals", "none", "forward_signals", ()),
        ("--forward-signals", "", "forward_signals", ()),
        ("--hang-timeout", "2.5", "hang_timeout", 2.5),
        ("--hang_timeout", "0", "hang_timeout", 0.0),
        ("--metrics-port", "0", "metrics_port", 0),
        ("--metrics_port", "9400", "metrics_port", 9400),
        ("--shutdown-timeout", "5", "shutdown_timeout", 5.0),
        ("--shutdown_timeout", "0", "shutdown_timeout", 0.0),
        ("--rdzv-conf", "a=1", "rdzv_configs", {"a": "1"}),
    ],
)
def test_flag_spellings(script, flag, value, field, expected):
    for argv in ([flag, value, script], [f"{flag}={value}", script] if flag.startswith("--") else [flag + value, script]):
        assert getattr(parse_config(argv, {}), field) == expected


@pytest.mark.parametrize(
    "flag, field",
    [("--virtual-local-rank", "virtual_local_rank"), ("--virtual_local_rank", "virtual_local_rank"),
     ("--standalone", "standalone")],
)
def test_bool_flags(script, flag, field):
    assert getattr(parse_config([flag, script], {}), field) is True
    assert getattr(parse_config([script], {}), field) is False


def test_rdzv_flags_both_spellings(script):
    for sep in ("-", "_"):
        c = parse_config([f"--rdzv{sep}backend", "c10d", f"--rdzv{sep}endpoint", "h:29400",
                          f"--rdzv{sep}id", "job", f"--rdzv{sep}conf", "join_timeout=5", script], {})
        assert (c.rdzv_backend, c.rdzv_endpoint, c.run_id, c.rdzv_configs) == (
            "c10d", "h:29400", "job", {"join_timeout": "5"})


def test_static_flags_both_spellings(script):
    for sep in ("-", "_"):
        c = parse_config(["--nnodes", "2", f"--node{sep}rank", "1", f"--master{sep}addr", "n0",
                          f"--master{sep}port", "1234", script], {})
        assert (c.rdzv_backend, c.rdzv_configs["rank"], c.rdzv_endpoint) == ("static", "1", "n0:1234")


def test_module_no_python_run_path(script):
    assert parse_config(["-m", "pkg.mod", "x"], {}).cmd[-3:] == ("-m", "pkg.mod", "x")
    assert parse_config(["--module", "pkg.mod"], {}).cmd[-2:] == ("-m", "pkg.mod")
    env = {"PATH": "/usr/bin:/bin"}
    for flag in ("--no-python", "--no_python"):
        assert parse_config([flag, "ls", "-l"], env).cmd == ("ls", "-l")
    for flag in ("--run-path", "--run_path"):
        assert parse_config([flag, script, "a"], {}).cmd[2:] == ("-m", "elaunch.runpath", script, "a")


def test_script_args_pass_through_untouched(script):
    argv = [script, "--nnodes", "9", "-m", "--help", "--", "x", "--version"]
    c = parse_config(["--nproc-per-node=1", *argv], {})
    assert c.cmd == (sys.executable, "-u", *argv)
    assert c.max_nodes == 1


def test_pet_env_fallback_and_command_line_wins(script):
    env = {"PET_NPROC_PER_NODE": "3", "PET_MAX_RESTARTS": "2", "PET_RDZV_CONF": "k=v",
           "PET_SIGNALS_TO_HANDLE": "SIGUSR1", "PET_REDIRECTS": "1", "PET_ROLE": "r",
           "PET_MONITOR_INTERVAL": "1.5", "PET_LOG_DIR": "/tmp/l"}
    c = parse_config([script], env)
    assert (c.nproc_per_node, c.max_restarts, c.rdzv_configs, c.signals_to_handle, c.redirects,
            c.role, c.monitor_interval, c.log_dir) == (3, 2, {"k": "v"}, ("SIGUSR1",), Std.OUT, "r", 1.5, "/tmp/l")
    c = parse_config(["--nproc-per-node", "2", "--max_restarts", "0", script], env)
    assert (c.nproc_per_node, c.max_restarts) == (2, 0)


def test_forward_signals_and_hang_timeout_defaults_and_env(script):
    c = parse_config([script], {})
    assert (c.forward_signals, c.hang_timeout) == (("SIGUSR1", "SIGUSR2"), 0.0)
    c = parse_config([script], {"PET_FORWARD_SIGNALS": "SIGUSR2", "PET_HANG_TIMEOUT": "30"})
    assert (c.forward_signals, c.hang_timeout) == (("SIGUSR2",), 30.0)
    assert parse_config([script], {"PET_FORWARD_SIGNALS": "none"}).forward_signals == ()
    assert parse_config([script], {"PET_FORWARD_SIGNALS": ""}).forward_signals == ("SIGUSR1", "SIGUSR2")  # unset
    c = parse_config(["--forward-signals=SIGUSR1", "--hang-timeout=1", script],
                     {"PET_FORWARD_SIGNALS": "SIGUSR2", "PET_HANG_TIMEOUT": "30"})
    assert (c.forward_signals, c.hang_timeout) == (("SIGUSR1",), 1.0)



def test_metrics_port_is_off_by_default_and_read_from_pet_env(script):
    assert parse_config([script], {}).metrics_port is None
    assert parse_config([script], {"PET_METRICS_PORT": ""}).metrics_port is None  # empty: unset
    assert parse_config([script], {"PET_METRICS_PORT": "0"}).metrics_port == 0
    assert parse_config(["--metrics-port=9401", script], {"PET_METRICS_PORT": "0"}).metrics_port == 9401

def test_default_forward_signals_yield_to_signals_to_handle(script):
    # torchrun users' --signals-to-handle SIGUSR1 keeps its meaning (stop); only the default yields
    c = parse_config(["--signals-to-handle=SIGUSR1,SIGTERM", script], {})
    assert (c.signals_to_handle, c.forward_signals) == (("SIGUSR1", "SIGTERM"), ("SIGUSR2",))
    c = parse_config([script], {"PET_SIGNALS_TO_HANDLE": "SIGUSR2"})
    assert (c.signals_to_handle, c.forward_signals) == (("SIGUSR2",), ("SIGUSR1",))


@pytest.mark.parametrize(
    "argv, env, message",
    [
        (["--forward-signals=SIGUSR1", "--signals-to-handle=SIGUSR1"], {},
         "--forward-signals=SIGUSR1: SIGUSR1 is also in --signals-to-handle=SIGUSR1"),
        (["--forward-signals=SIGUSR2,SIGTERM"], {}, "SIGTERM is also in --signals-to-handle=SIGTERM,"),
        ([], {"PET_FORWARD_SIGNALS": "SIGINT"}, "SIGINT is also in --signals-to-handle"),
        (["--forward-signals=SIGKILL"], {}, "--forward-signals=SIGKILL: SIGKILL cannot be handled"),
        (["--forward-signals=SIGUSR1,SIGFOO"], {}, "--forward-signals=SIGUSR1,SIGFOO: unknown signal 'SIGFOO'"),
        ([], {"PET_FORWARD_SIGNALS": "STOP"}, "PET_FORWARD_SIGNALS=STOP: SIGSTOP cannot be handled"),
        (["--hang-timeout=-1"], {}, "--hang-timeout=-1: must be >= 0 seconds"),
        (["--hang-timeout=soon"], {}, "--hang-timeout=soon: expected seconds"),
        ([], {"PET_HANG_TIMEOUT": "inf"}, "PET_HANG_TIMEOUT=inf: must be >= 0 seconds"),
    ],
)
def test_forward_signals_and_hang_timeout_reject(script, argv, env, message):
    with pytest.raises(ConfigError) as info:
        parse_config([*argv, script], env)
    assert message in str(info.value)


def test_pet_flags_follow_check_env(script):
    assert parse_config([script], {"PET_STANDALONE": "1"}).standalone is True
    assert parse_config([script], {"PET_STANDALONE": "0"}).standalone is False
    assert parse_config(["--standalone", script], {"PET_STANDALONE": "0"}).standalone is True
    assert parse_config(["pkg.mod"], {"PET_MODULE": "1"}).cmd[-2:] == ("-m", "pkg.mod")
    assert parse_config([script], {"PET_VIRTUAL_LOCAL_RANK": "1"}).virtual_local_rank is True


def test_env_errors_name_the_variable(script):
    with pytest.raises(ConfigError, match="PET_NNODES=4:1: MIN"):
        parse_config([script], {"PET_NNODES": "4:1"})
    with pytest.raises(ConfigError, match="PET_STANDALONE=yes"):
        parse_config([script], {"PET_STANDALONE": "yes"})
    with pytest.raises(ConfigError, match="^--nnodes=4:1"):
        parse_config(["--nnodes=4:1", script], {"PET_NNODES": "2"})


def test_unknown_option_is_a_usage_error(script):
    with pytest.raises(click.UsageError):
        parse_config(["--nope", script], {})


def test_help_groups_and_version(capsys):
    with pytest.raises(click.exceptions.Exit) as info:
        parse_config(["--help"], {})
    assert info.value.exit_code == 0
    out = " ".join(capsys.readouterr().out.split())
    for text in ("Rendezvous:", "Worker launch:", "Logging and output:", "PET_NNODES", "default: 1:1",
                 "--nproc-per-node", "SECONDS", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT",
                 "PET_FORWARD_SIGNALS", "default: SIGUSR1,SIGUSR2", "PET_HANG_TIMEOUT", "elaunch.progress()"):
        assert text in out
    assert "--nproc_per_node" not in out  # aliases parse but do not clutter the help
    assert run_argv(["--version"], {}) == 0
    assert capsys.readouterr().out.strip() == "elaunch 0.1.0"


def test_run_argv_bad_input_is_one_line(capsys):
    assert run_argv(["--nnodes=4:1", "x.py"], {}) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["elaunch: error: --nnodes=4:1: MIN (4) must be <= MAX (1)"]


def test_run_main_raises_value_error_for_bad_input():
    from elaunch.run import main as run_main

    with pytest.raises(ValueError, match="--max-restarts=-3"):
        run_main(["--max-restarts=-3", "x.py"])


def test_click_command_entry_point_exits_2(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--rdzv-backend=zk", "x.py"])
    assert info.value.code == 2
    assert "zk" in capsys.readouterr().err


def test_runpath_module_runs_script_as_main(script):
    out = subprocess.run([sys.executable, "-m", "elaunch.runpath", script, "a", "--b"],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    assert "ARGV ['a', '--b'] __main__" in out
