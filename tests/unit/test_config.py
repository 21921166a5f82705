"""LaunchConfig resolution (elaunch.config) and the pure value parsers (elaunch.config.values)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from elaunch import config as C
from elaunch.config import nproc
from elaunch.config import values as P
from elaunch.config import ConfigError, LaunchConfig, LaunchOptions, build_config
from elaunch.procs.std import Std


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "train.py"
    path.write_text("print('hi')\n")
    return str(path)


def cfg(script, environ=None, **options) -> LaunchConfig:
    return build_config(LaunchOptions(training_script=script, **options), environ or {})


# ---- defaults and rewriting, as torch.distributed.run.run / config_from_args ----

def test_defaults_become_standalone_for_single_node_static(script):
    c = cfg(script)
    assert (c.rdzv_backend, c.rdzv_endpoint) == ("standalone", "127.0.0.1:0")
    assert len(c.run_id) == 36 and c.run_id != cfg(script).run_id  # a fresh uuid4
    assert c.standalone is False
    assert (c.min_nodes, c.max_nodes, c.nproc_per_node, c.max_restarts) == (1, 1, 1, 0)
    assert c.cmd == (sys.executable, "-u", script)
    assert c.shutdown_timeout == 30.0 and c.signals_to_handle == C.DEFAULT_SIGNALS
    assert c.forward_signals == ("SIGUSR1", "SIGUSR2") and c.hang_timeout == 0.0 and c.inprocess_timeout == 10.0
    assert c.redirects == Std.NONE and c.tee == Std.NONE


def test_standalone_ignores_rdzv_flags(script, caplog):
    c = cfg(script, standalone=True, rdzv_backend="c10d", rdzv_endpoint="h:1", rdzv_id="x")
    assert (c.rdzv_backend, c.rdzv_endpoint, c.standalone) == ("standalone", "127.0.0.1:0", True)
    assert c.run_id != "x"
    assert "ignoring" in caplog.text


@pytest.mark.parametrize(
    "options, endpoint, addr, port",
    [
        ({"master_port": 1234}, "127.0.0.1:1234", "127.0.0.1", 1234),
        ({"nnodes": (2, 2), "master_addr": "node0"}, "node0:29500", "node0", 29500),
        ({"nnodes": (2, 2), "rdzv_endpoint": "h:7"}, "h:7", "h", 7),
        ({"nnodes": (2, 2), "master_addr": "::1"}, "[::1]:29500", "::1", 29500),
        ({"rdzv_endpoint": "[::1]:29400"}, "[::1]:29400", "::1", 29400),
    ],
)
def test_static_endpoint_and_master(script, options, endpoint, addr, port):
    from elaunch.launch import rendezvous_parameters
    from elaunch.rendezvous.registry import create_handler

    c = cfg(script, node_rank=0, **options)
    assert (c.rdzv_backend, c.rdzv_endpoint, c.rdzv_configs["rank"]) == ("static", endpoint, "0")
    handler = create_handler(rendezvous_parameters(c))  # the workers' store: MASTER_ADDR/PORT
    assert (handler.master_addr, handler.master_port) == (addr, port)


def test_static_rank_goes_to_rdzv_configs(script):
    c = cfg(script, nnodes=(3, 3), node_rank=2, rdzv_conf={"timeout": "5"})
    assert c.rdzv_configs == {"timeout": "5", "rank": "2"}


def test_dynamic_backend_keeps_endpoint_and_no_master(script):
    c = cfg(script, nnodes=(1, 4), rdzv_backend="c10d", rdzv_endpoint="host:29400", rdzv_id="job")
    assert (c.rdzv_backend, c.rdzv_endpoint, c.run_id) == ("c10d", "host:29400", "job")
    assert "rank" not in c.rdzv_configs


def test_etcd_endpoint_list_allowed(script):
    c = cfg(script, rdzv_backend="etcd-v3", rdzv_endpoint="http://a:2379,b:2379")
    assert c.rdzv_endpoint == "http://a:2379,b:2379"


@pytest.mark.parametrize(
    "options, needle",
    [
        ({"nnodes": (2, 2), "node_rank": 2}, "--node-rank=2"),
        ({"rdzv_backend": "zookeeper"}, "zookeeper"),
        ({"rdzv_backend": "c10d", "rdzv_endpoint": "a:1,b:2"}, "a:1,b:2"),
        ({"rdzv_backend": "c10d", "rdzv_endpoint": "h:0"}, "h:0"),
        ({"nnodes": (2, 2), "rdzv_endpoint": "h"}, "needs host:port"),
        ({"rdzv_backend": "etcd", "rdzv_endpoint": "a:1,,b:2"}, "empty endpoint"),
        ({"start_method": "thread"}, "thread"),
        ({"max_restarts": -1}, "-1"),
        ({"monitor_interval": 0}, "--monitor-interval=0"),
        ({"shutdown_timeout": -1}, "--shutdown-timeout=-1"),
        ({"inprocess_timeout": 0}, "--inprocess-timeout=0"),
        ({"hang_timeout": -0.5}, "--hang-timeout=-0.5: must be >= 0"),
        ({"hang_timeout": float("nan")}, "--hang-timeout=nan"),
        ({"forward_signals": ("SIGHUP",)}, "--forward-signals=SIGHUP: SIGHUP is also in --signals-to-handle"),
        ({"forward_signals": ("SIGUSR1",), "signals_to_handle": ("SIGUSR1",)}, "SIGUSR1 is also in"),
        ({"nproc_per_node": 0}, "--nproc-per-node=0"),
        ({"standalone": True, "nnodes": (1, 2)}, "--nnodes=1:2: --standalone"),
        ({"module": True, "no_python": True}, "--no-python"),
    ],
)
def test_invalid_combinations(script, options, needle):
    with pytest.raises(ConfigError) as info:
        cfg(script, **options)
    assert needle in str(info.value)


@pytest.mark.parametrize(
    "handle, forward, expected",
    [
        (None, None, (C.DEFAULT_SIGNALS, ("SIGUSR1", "SIGUSR2"))),
        (("SIGUSR1",), None, (("SIGUSR1",), ("SIGUSR2",))),  # the default yields to an explicit stop
        (("SIGUSR1", "SIGUSR2"), None, (("SIGUSR1", "SIGUSR2"), ())),
        (None, (), (C.DEFAULT_SIGNALS, ())),
        (("SIGTERM",), ("SIGUSR1", "SIGINT"), (("SIGTERM",), ("SIGUSR1", "SIGINT"))),
    ],
)
def test_signal_sets(script, handle, forward, expected):
    c = cfg(script, signals_to_handle=handle, forward_signals=forward, hang_timeout=12.5)
    assert (c.signals_to_handle, c.forward_signals) == expected
    assert c.hang_timeout == 12.5


def test_launch_config_resolves_its_own_signal_sets():
    """Made directly (not through build_config), a LaunchConfig still keeps stops and notices apart."""
    assert LaunchConfig().forward_signals == ("SIGUSR1", "SIGUSR2")
    assert LaunchConfig(signals_to_handle=("SIGTERM", "SIGUSR1")).forward_signals == ("SIGUSR2",)
    assert LaunchConfig(forward_signals=()).forward_signals == ()
    with pytest.raises(ConfigError, match="--forward-signals=SIGINT: SIGINT is also in --signals-to-handle"):
        LaunchConfig(forward_signals=("SIGINT",))


def test_missing_script_and_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="missing the training script"):
        build_config(LaunchOptions(), {})
    with pytest.raises(ConfigError, match="nope.py"):
        build_config(LaunchOptions(training_script=str(tmp_path / "nope.py")), {})


# ---- worker argv ----

def test_cmd_forms(script):
    env = {"PYTHON_EXEC": "/opt/py", "PATH": "/usr/bin:/bin"}
    assert cfg(script, env, training_script_args=("--a", "1")).cmd == ("/opt/py", "-u", script, "--a", "1")
    assert cfg("pkg.mod", env, module=True).cmd == ("/opt/py", "-u", "-m", "pkg.mod")
    assert cfg("ls", env, no_python=True, training_script_args=("-l",)).cmd == ("ls", "-l")
    assert cfg(script, env, run_path=True, no_python=True).cmd == (
        "/opt/py", "-u", "-m", "elaunch.runpath", script)


def test_no_python_program_must_exist(script):
    with pytest.raises(ConfigError, match="not-a-program-xyz"):
        cfg("not-a-program-xyz", {"PATH": "/usr/bin:/bin"}, no_python=True)
    with pytest.raises(ConfigError, match="/no/such/prog"):
        cfg("/no/such/prog", {}, no_python=True)
    with pytest.raises(ConfigError, match="not executable"):  # its Popen would fail on every worker
        cfg(script, {}, no_python=True)
    os.chmod(script, 0o755)
    assert cfg(script, {}, no_python=True).cmd == (script,)


def test_module_is_not_checked_on_disk():
    assert build_config(LaunchOptions(training_script="no.such.module", module=True), {}).cmd[-1] == "no.such.module"


# ---- environment-derived fields ----

def test_omp_num_threads(script):
    assert cfg(script, nproc_per_node=2).omp_num_threads == 1
    assert cfg(script, {"OMP_NUM_THREADS": "4"}, nproc_per_node=2).omp_num_threads is None
    assert cfg(script, nproc_per_node=1).omp_num_threads is None


def test_shutdown_timeout_flag_env_default(script):
    assert cfg(script, {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "7"}).shutdown_timeout == 7.0
    assert cfg(script, {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "7"}, shutdown_timeout=2.5).shutdown_timeout == 2.5
    with pytest.raises(ConfigError, match="TORCH_ELASTIC_SHUTDOWN_TIMEOUT=soon"):
        cfg(script, {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "soon"})


def test_an_option_row_reads_its_torch_fallback():
    row = C.OPTIONS["shutdown_timeout"]
    assert (row.env_fallback, row.default) == ("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", None)
    assert row.from_environ({}) == row.from_environ({"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": " "}) == 30.0
    assert row.from_environ({"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "0"}) == 0.0
    with pytest.raises(ConfigError, match="TORCH_ELASTIC_SHUTDOWN_TIMEOUT=-1: must be >= 0 seconds"):
        row.from_environ({"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "-1"})
    assert C.OPTIONS["hang_timeout"].from_environ({"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "5"}) is None  # none of its own


def test_log_line_prefix_template(script):
    env = {"TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE": "[${rank}]"}
    assert cfg(script, env).log_line_prefix_template == "[${rank}]"


# ---- nproc resolution: only the device count is faked ----

@pytest.mark.parametrize(
    "spec, counts, expected",
    [
        ("cpu", {"cpu": 3}, 3),
        ("gpu", {"gpu": 2}, 2),
        ("xpu", {"xpu": 4}, 4),
        ("auto", {"accelerator": 8, "cpu": 3}, 8),
        ("auto", {"accelerator": 0, "cpu": 3}, 3),
        (5, {}, 5),
    ],
)
def test_resolve_nproc(monkeypatch, spec, counts, expected):
    monkeypatch.setattr(nproc, "_device_count", lambda kind: counts[kind])
    assert C.resolve_nproc(spec) == expected


def test_resolve_nproc_gpu_without_devices(monkeypatch):
    monkeypatch.setattr(nproc, "_device_count", lambda kind: 0)
    with pytest.raises(ConfigError, match="--nproc-per-node=gpu: no CUDA"):
        C.resolve_nproc("gpu")


def test_cpu_count_is_real():
    assert nproc._device_count("cpu") >= 1


def test_importing_cli_and_config_does_not_import_torch():
    code = "import sys, elaunch.cli, elaunch.config, elaunch.run; assert 'torch' not in sys.modules, 'torch'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


# ---- pure parsers ----

@pytest.mark.parametrize(
    "fn, text, expected",
    [
        (P.parse_nnodes, "2", (2, 2)),
        (P.parse_nnodes, "1:4", (1, 4)),
        (P.parse_nproc, "auto", "auto"),
        (P.parse_nproc, "3", 3),
        (P.parse_kv_list, "a=1, b = x=y ", {"a": "1", "b": "x=y"}),
        (P.parse_kv_list, "", {}),
        (P.parse_rank_set, "0,2", frozenset({0, 2})),
        (P.parse_rank_set, "", None),
        (P.parse_comma_list, "a,,b,c", ("a,b", "c")),
        (P.parse_comma_list, "", ()),
        (P.parse_signals, "SIGUSR1,term,SIGUSR1", ("SIGUSR1", "SIGTERM")),
        (lambda t: P.parse_signals(t, "--forward-signals", allow_empty=True), "", ()),
        (lambda t: P.parse_signals(t, "--forward-signals", allow_empty=True), " None ", ()),
        (lambda t: P.parse_signals(t, "--forward-signals", allow_empty=True), "usr1,USR2", ("SIGUSR1", "SIGUSR2")),
        (lambda t: P.parse_std(t, "-r"), "0:1,1:2", {0: Std.OUT, 1: Std.ERR}),
        (lambda t: P.parse_std(t, "-r"), "3", Std.ALL),
        (lambda t: P.parse_seconds(t, "--x", True), "0", 0.0),
        (lambda t: P.parse_int(t, "--x", 1, 65535), "65535", 65535),
    ],
)
def test_parsers_accept(fn, text, expected):
    assert fn(text) == expected


@pytest.mark.parametrize(
    "fn, text, message",
    [
        (P.parse_nnodes, "4:1", "--nnodes=4:1: MIN (4) must be <= MAX (1)"),
        (P.parse_nnodes, "1:2:3", "--nnodes=1:2:3"),
        (P.parse_nnodes, "0", "--nnodes=0"),
        (P.parse_nnodes, "two", "--nnodes=two"),
        (P.parse_nproc, "0", "--nproc-per-node=0"),
        (P.parse_nproc, "tpu", "--nproc-per-node=tpu"),
        (P.parse_kv_list, "a", "entry 'a' is not key=value"),
        (P.parse_kv_list, "=1", "empty key"),
        (P.parse_kv_list, "a=", "no value"),
        (P.parse_rank_set, "0,x", "--local-ranks-filter=0,x"),
        (P.parse_signals, "SIGFOO", "SIGFOO"),
        (P.parse_signals, "SIGKILL", "cannot be handled"),
        (P.parse_signals, ",", "expected"),
        (P.parse_signals, "none", "unknown signal 'none'"),  # only --forward-signals may be empty
        (lambda t: P.parse_signals(t, "--forward-signals", True), "SIGSTOP", "--forward-signals=SIGSTOP: SIGSTOP"),
        (lambda t: P.parse_std(t, "--tee"), "4", "--tee=4"),
        (lambda t: P.parse_seconds(t, "--monitor-interval", False), "0", "--monitor-interval=0: must be > 0"),
        (lambda t: P.parse_seconds(t, "--x", True), "nan", "--x=nan"),
        (lambda t: P.parse_int(t, "--master-port", 1, 65535), "0", "--master-port=0: must be in 1-65535"),
    ],
)
def test_parsers_reject(fn, text, message):
    with pytest.raises(ConfigError) as info:
        fn(text)
    assert message in str(info.value)


def test_pet_flag_like_check_env():
    assert P.parse_pet_flag("1", "PET_X") is True
    assert P.parse_pet_flag("2", "PET_X") is True
    assert P.parse_pet_flag("0", "PET_X") is False
    with pytest.raises(ConfigError, match="PET_X=yes"):
        P.parse_pet_flag("yes", "PET_X")


# ---- LaunchOptions: typed, frozen, checked on construction ----

def test_options_parse_text_and_keep_typed_values():
    o = LaunchOptions(nnodes="1:4", nproc_per_node="2", rdzv_conf="a=1", max_restarts="3", forward_signals="")
    assert (o.nnodes, o.nproc_per_node, o.rdzv_conf, o.max_restarts, o.forward_signals) == ((1, 4), 2, {"a": "1"}, 3, ())
    assert LaunchOptions(nnodes=(2, 3)).nnodes == (2, 3)
    with pytest.raises(AttributeError):
        o.nnodes = (1, 1)  # type: ignore[misc]


def test_options_unset_values_take_defaults():
    import argparse

    o = LaunchOptions.from_namespace(argparse.Namespace(role="", rdzv_id=None, max_restarts=None, use_env=True))
    assert (o.role, o.rdzv_id, o.max_restarts, o.forward_signals) == ("default", "none", 0, None)
    assert o == LaunchOptions()


@pytest.mark.parametrize("options, message", [
    ({"nnodes": (4, 1)}, "--nnodes=4:1: MIN (4) must be <= MAX (1)"),
    ({"rdzv_backend": "standalone"}, "--rdzv-backend=standalone: unknown rendezvous backend"),
    ({"master_port": 0}, "--master-port=0: must be in 1-65535"),
    ({"local_ranks_filter": {-1}}, "--local-ranks-filter=-1"),
])
def test_options_reject_values_naming_the_flag(options, message):
    with pytest.raises(ConfigError) as info:
        LaunchOptions(**options)
    assert message in str(info.value)


@pytest.mark.parametrize("host", ["localhost", "node-01.cluster.local", "host.example.", "n_1", "10.0.0.1", "::1",
                                  "[::1]", "fe80::1%eth0", ""])
def test_a_host_name_or_address_is_taken_as_given(host):
    assert P.parse_host(host, "--local-addr") == host


@pytest.mark.parametrize("host", ["bad!host", "a b", " ", "-x", ".", "host..", "[::1", "h:1", "a/b"])
def test_anything_else_is_not_a_host(host):
    with pytest.raises(ConfigError, match=re.escape(f"--master-addr={host}: expected a host name or an IP address")):
        P.parse_host(host, "--master-addr")
