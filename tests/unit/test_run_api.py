"""elaunch.run beside torch.distributed.run: the same calls, the same outcomes.

Each test makes one call on both modules (torch's is the reference; it is
installed wherever elaunch runs torch jobs) and compares what comes back, or
which exception. Nothing here launches a job.
"""

from __future__ import annotations

import argparse
import os
import sys

import click
import pytest

torch_run = pytest.importorskip("torch.distributed.run")

import elaunch.run as elaunch_run  # noqa: E402
from elaunch.cli import main as command  # noqa: E402
from elaunch.spec import ProcessFailure, RunResult, WorkerState  # noqa: E402
from elaunch.errors.as_torch import child_failed_error  # noqa: E402


@pytest.fixture(autouse=True)
def _no_pet_env(monkeypatch):
    for name in list(os.environ):
        if name.startswith("PET_") or name in ("OMP_NUM_THREADS", "PYTHON_EXEC"):
            monkeypatch.delenv(name)


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "train.py"
    path.write_text(
        "import sys, os\n"
        "open(os.environ['ARGV_OUT'], 'w').write(repr((sys.argv, __name__)))\n"
    )
    return str(path)


def outcome(module, argv):
    """``("ok", namespace-dict)`` or ``("exit", code)`` for ``module.parse_args(argv)``."""
    try:
        return "ok", vars(module.parse_args(argv))
    except SystemExit as exc:
        return "exit", exc.code


def click_outcome(argv):
    """``("ok", params)`` or ``("error", message)`` for the ``elaunch`` command's parser."""
    try:
        with command.make_context("elaunch", list(argv), obj={}) as ctx:
            return "ok", dict(ctx.params)
    except click.UsageError as exc:
        return "error", exc.format_message()


# (spelling, dest it should set under torchrun when accepted)
SPELLINGS = [
    (["--redirect=3"], "redirects"),
    (["--redir", "3"], "redirects"),
    (["--red=3"], "redirects"),
    (["--r=3"], None),  # --rdzv-*, --role, --run-path, --redirects: ambiguous
    (["--te=1"], "tee"),
    (["--t=1"], "tee"),
    (["--nproc=2"], None),  # both spellings of --nproc-per-node match: ambiguous
    (["--nproc-per=2"], "nproc_per_node"),
    (["--nproc_per=2"], "nproc_per_node"),
    (["--nproc-per-node=2"], "nproc_per_node"),
    (["--nproc_per_node", "2"], "nproc_per_node"),
    (["--nn=2"], "nnodes"),
    (["--nnode", "1:2"], "nnodes"),
    (["--no"], None),
    (["--no-py"], "no_python"),
    (["--no_py"], "no_python"),
    (["--node-r=1"], "node_rank"),
    (["--stand"], "standalone"),
    (["--st"], None),
    (["--start-m=fork"], "start_method"),
    (["--rol=trainer"], "role"),
    (["--mod"], "module"),
    (["--max=1"], None),
    (["--max-r=1"], "max_restarts"),
    (["--max_res", "1"], "max_restarts"),
    (["--monitor=0.5"], None),
    (["--monitor-i=0.5"], "monitor_interval"),
    (["--rdzv-b=c10d"], "rdzv_backend"),
    (["--rdzv_e=host:1"], "rdzv_endpoint"),
    (["--rdzv-i=job"], "rdzv_id"),
    (["--rdzv-c=a=1"], "rdzv_conf"),
    (["--rdzv=c10d"], None),
    (["--run-p"], "run_path"),
    (["--ru"], None),
    (["--log-d=/tmp"], "log_dir"),
    (["--log=/tmp"], None),
    (["--logs-s=x"], "logs_specs"),
    (["--local-r=0"], "local_ranks_filter"),
    (["--local=0"], None),
    (["--local-a=h"], "local_addr"),
    (["--duplicate-stdout=a"], "duplicate_stdout_filters"),
    (["--dup=a"], None),
    (["--master-a=h"], "master_addr"),
    (["--master_p=1234"], "master_port"),
    (["--signals=SIGTERM"], None),
    (["--signals-to=SIGTERM"], "signals_to_handle"),
    (["--shutdown-t=5"], "shutdown_timeout"),
    (["--virtual"], None),
    (["--virtual-l"], "virtual_local_rank"),
    (["--numa-b=node"], "numa_binding"),
    (["--event-log=x"], "event_log_handler"),
    (["--event=x"], None),
    (["--bogus=1"], None),
    # short options: not abbreviations, but the same outcomes
    (["-r3"], "redirects"),
    (["-t", "1"], "tee"),
    (["-mr3"], "redirects"),
    (["-mod"], None),
    (["-nproc-per-node=2"], None),
    # elaunch's own flags: torchrun has no such option; elaunch takes them only in full
    (["--hang=1"], None),
    (["--warm"], None),
    (["--forward=SIGUSR1"], None),
    (["--ver"], None),
]


@pytest.mark.parametrize("spelling,dest", SPELLINGS, ids=lambda v: " ".join(v) if isinstance(v, list) else str(v))
def test_abbreviations_accepted_and_rejected_as_torchrun(spelling, dest, capsys):
    argv = [*spelling, "train.py", "--redirect=1"]  # after the script: the script's, untouched
    torch_kind, torch_value = outcome(torch_run, argv)
    ours_kind, ours_value = outcome(elaunch_run, argv)
    click_kind, click_value = click_outcome(argv)
    capsys.readouterr()
    assert (torch_kind == "ok") == (dest is not None), (torch_kind, torch_value)
    assert ours_kind == torch_kind
    assert (click_kind == "ok") == (torch_kind == "ok"), click_value
    if dest is None:
        assert (torch_value, ours_value) == (2, 2)
        return
    assert ours_value[dest] == torch_value[dest]
    assert ours_value["training_script_args"] == torch_value["training_script_args"] == ["--redirect=1"]
    param = next(p for p in command.params if p.name == dest)
    expected = torch_value[dest] if param.is_flag else param.type.convert(torch_value[dest], param, None)
    assert click_value[dest] == expected


def test_ambiguous_option_is_one_elaunch_error_line(capsys):
    from elaunch.cli import run_argv

    assert run_argv(["--nproc=2", "train.py"], {}) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "elaunch: error: ambiguous option: --nproc could match --nproc-per-node, --nproc_per_node"
    ]


def test_parse_args_has_torch_namespace_shape():
    ours = vars(elaunch_run.parse_args(["train.py", "a"]))
    theirs = vars(torch_run.parse_args(["train.py", "a"]))
    for name, value in theirs.items():
        assert name in ours
        if name == "shutdown_timeout":  # None by default in both; seconds are a float here
            assert ours[name] is value is None
            continue
        assert ours[name] == value and type(ours[name]) is type(value), name
    assert set(ours) - set(theirs) == {"warm_start", "warm_start_modules", "hang_timeout", "inprocess_timeout",
                                       "forward_signals",
                                       "checkpoint_replicas", "checkpoint_dir", "checkpoint_persist_interval",
                                       "checkpoint_timeout", "checkpoint_exchange_timeout", "node_check",
                                       "metrics_port"}


def test_parse_args_reads_pet_env_at_parser_build(monkeypatch):
    monkeypatch.setenv("PET_NNODES", "1:3")
    monkeypatch.setenv("PET_MAX_RESTARTS", "4")
    monkeypatch.setenv("PET_STANDALONE", "1")
    for module in (torch_run, elaunch_run):
        args = module.parse_args(["train.py"])
        assert (args.nnodes, args.max_restarts, args.standalone) == ("1:3", 4, True)
        assert module.parse_args(["--nnodes=2", "train.py"]).nnodes == "2"


@pytest.mark.parametrize("argv", [[], ["--nnodes"], ["--unknown", "train.py"], ["--start-method=thread", "train.py"],
                                  ["--max-restarts=x", "train.py"], ["--numa-binding=all", "train.py"]])
def test_parse_args_usage_errors_exit_2(argv, capsys):
    assert outcome(torch_run, argv) == outcome(elaunch_run, argv) == ("exit", 2)


def call(fn, *args):
    try:
        return "ok", fn(*args)
    except Exception as exc:  # noqa: BLE001 - the class is the outcome
        return type(exc), None


@pytest.mark.parametrize("text", ["1", "2:4", "4:1", "0", "1:2:3", "a", "1:b", ""])
def test_parse_min_max_nnodes(text):
    theirs = call(torch_run.parse_min_max_nnodes, text)
    ours = call(elaunch_run.parse_min_max_nnodes, text)
    if theirs[0] == "ok":
        assert ours == theirs
    else:
        assert issubclass(ours[0], theirs[0]), (ours, theirs)


@pytest.mark.parametrize("text", ["1", "4", "0", "cpu", "auto", "gpu", "xpu", "unknown", "2.5"])
def test_determine_local_world_size(text):
    theirs = call(torch_run.determine_local_world_size, text)
    ours = call(elaunch_run.determine_local_world_size, text)
    if theirs[0] == "ok":
        assert ours == theirs
    else:
        assert issubclass(ours[0], theirs[0]), (ours, theirs)


@pytest.mark.parametrize("ns", [
    argparse.Namespace(rdzv_backend="static", rdzv_endpoint="", master_addr="10.0.0.1", master_port=29501),
    argparse.Namespace(rdzv_backend="static", rdzv_endpoint="h:1", master_addr="10.0.0.1", master_port=29501),
    argparse.Namespace(rdzv_backend="c10d", rdzv_endpoint="", master_addr="10.0.0.1", master_port=None),
])
def test_get_rdzv_endpoint(ns):
    assert elaunch_run.get_rdzv_endpoint(ns) == torch_run.get_rdzv_endpoint(ns)


@pytest.mark.parametrize("ns", [argparse.Namespace(), argparse.Namespace(use_env=False), argparse.Namespace(use_env=True)])
def test_get_use_env(ns):
    assert elaunch_run.get_use_env(ns) == torch_run.get_use_env(ns)


def both_configs(argv):
    return [module.config_from_args(module.parse_args(argv)) for module in (torch_run, elaunch_run)]


@pytest.mark.parametrize("extra", [[], ["-m"], ["--run-path"]])
def test_config_from_args_cmd(script, extra):
    args = [*extra, script if extra != ["-m"] else "json.tool", "--x", "1"]
    (_, tcmd, targs), (_, ecmd, eargs) = both_configs(["--nnodes=2", "--master-port=29501", *args])
    assert eargs == targs
    if callable(tcmd):
        assert ecmd is elaunch_run.run_script_path
    else:
        assert ecmd == tcmd


def test_config_from_args_no_python_program():
    (_, tcmd, targs), (_, ecmd, eargs) = both_configs(["--no-python", "--nnodes=2", "--master-port=1", "true", "a"])
    assert (ecmd, eargs) == (tcmd, targs) == ("true", ["a"])


FIELDS = ("min_nodes", "max_nodes", "nproc_per_node", "run_id", "role", "rdzv_backend", "rdzv_endpoint",
          "max_restarts", "monitor_interval", "start_method", "local_addr", "event_log_handler",
          "virtual_local_rank", "log_line_prefix_template")


def test_config_from_args_launch_config_fields(script, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "2")  # torch's config_from_args would set it in os.environ
    argv = ["--nnodes=1:2", "--nproc-per-node=3", "--rdzv-backend=c10d", "--rdzv-endpoint=h:29400",
            "--rdzv-id=job", "--rdzv-conf=join_timeout=5", "--max-restarts=2", "--monitor-interval=0.5",
            "--role=trainer", "--local-addr=10.1.1.1", "--virtual-local-rank",
            "--duplicate-stdout-filters=a,b", script]
    (tconf, _, _), (econf, _, _) = both_configs(argv)
    for name in FIELDS:
        assert getattr(econf, name) == getattr(tconf, name), name
    # torch's LaunchConfig adds its default "timeout" (900 s) key; elaunch's backends own their defaults
    assert econf.rdzv_configs == {"join_timeout": "5"}
    assert tconf.rdzv_configs == {"join_timeout": "5", "timeout": 900}
    assert list(econf.duplicate_stdout_filters) == tconf.duplicate_stdout_filters == ["a", "b"]


def test_config_from_args_static_rank(script):
    (tconf, _, _), (econf, _, _) = both_configs(["--nnodes=2", "--node-rank=1", "--master-port=29501", script])
    assert (econf.rdzv_backend, econf.rdzv_endpoint) == (tconf.rdzv_backend, tconf.rdzv_endpoint)
    assert econf.rdzv_configs == {"rank": "1"} and tconf.rdzv_configs == {"rank": 1, "timeout": 900}


def test_config_from_args_takes_torchs_namespace(script):
    config, cmd, cmd_args = elaunch_run.config_from_args(torch_run.parse_args(["--nproc-per-node=2", script, "z"]))
    assert (config.nproc_per_node, cmd, cmd_args) == (2, sys.executable, ["-u", script, "z"])


@pytest.mark.parametrize("argv,env", [
    (["--no-python", "-m", "json.tool"], {}),
    (["json.tool"], {"PET_NO_PYTHON": "1", "PET_MODULE": "1"}),
    (["--nproc-per-node=unknown", "SCRIPT"], {}),
])
def test_bad_input_raises_value_error_from_main(argv, env, script, monkeypatch):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    argv = [script if a == "SCRIPT" else a for a in argv]
    for module in (torch_run, elaunch_run):
        with pytest.raises(ValueError):
            module.main(argv)


def test_run_script_path(script, tmp_path, monkeypatch):
    results = []
    for module in (torch_run, elaunch_run):
        out = tmp_path / f"{module.__name__}.out"
        monkeypatch.setenv("ARGV_OUT", str(out))
        monkeypatch.setattr(sys, "argv", list(sys.argv))
        module.run_script_path(script, "--a", "1")
        results.append(out.read_text())
    assert results[0] == results[1] == repr(([script, "--a", "1"], "__main__"))


def test_child_failed_error_is_torchs_with_elaunchs_root_cause(tmp_path):
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    failures = {
        0: ProcessFailure(local_rank=0, global_rank=0, pid=101, exitcode=-15, timestamp=1000.0, hostname="h"),
        1: ProcessFailure(local_rank=1, global_rank=1, pid=102, exitcode=3, timestamp=1001.0, hostname="h"),
    }
    result = RunResult(state=WorkerState.FAILED, failures=failures, root_rank=1)
    exc = child_failed_error("train.py", result)
    assert isinstance(exc, ChildFailedError)
    rank, first = exc.get_first_failure()
    assert (rank, first.exitcode, first.pid, first.local_rank) == (1, 3, 102, 1)
    assert exc.failures[0].signal_name() == "SIGTERM"
    assert exc.name == "train.py"
    assert "train.py FAILED" in exc.format_msg() and str(exc).strip() == exc.format_msg().strip()


def test_import_stays_light():
    import subprocess

    code = "import sys, elaunch.run; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, env=dict(os.environ, PYTHONPATH=os.getcwd()))
