"""Bad input: ``python -m elaunch ...`` prints exactly one line naming the value, exits 2.

Table-driven; each case is a real subprocess (no torch is imported on these paths,
so each takes well under a second).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

SCRIPT = "{script}"  # replaced by an existing script file

CASES = [
    # (argv, extra env, text the error line must contain)
    (["--nnodes=4:1", SCRIPT], {}, "--nnodes=4:1: MIN (4) must be <= MAX (1)"),
    (["--nnodes", "a:b", SCRIPT], {}, "--nnodes=a:b"),
    (["--nnodes", "1:2:3", SCRIPT], {}, "--nnodes=1:2:3"),
    (["--nnodes", "0", SCRIPT], {}, "--nnodes=0"),
    (["--nnodes", "-2", SCRIPT], {}, "--nnodes=-2"),
    (["--nproc-per-node", "many", SCRIPT], {}, "--nproc-per-node=many"),
    (["--nproc_per_node", "-1", SCRIPT], {}, "--nproc-per-node=-1"),
    (["--nproc-per-node", "gpu", SCRIPT], {"CUDA_VISIBLE_DEVICES": ""}, "--nproc-per-node=gpu: no CUDA device"),
    (["--max-restarts", "x", SCRIPT], {}, "--max-restarts=x"),
    ([SCRIPT], {"ELAUNCH_JOB_SECRET": "tooshort"}, "ELAUNCH_JOB_SECRET: the secret is 8 bytes; at least 16"),
    ([SCRIPT], {"ELAUNCH_JOB_SECRET_FILE": "/nonexistent/secret"},
     "ELAUNCH_JOB_SECRET_FILE=/nonexistent/secret: cannot read it (No such file or directory)"),
    ([SCRIPT], {"ELAUNCH_JOB_SECRET": "x" * 20, "ELAUNCH_JOB_SECRET_FILE": "/etc/hostname"},
     "ELAUNCH_JOB_SECRET and ELAUNCH_JOB_SECRET_FILE are both set: set one"),
    (["--max-restarts", "-1", SCRIPT], {}, "--max-restarts=-1"),
    (["--monitor-interval", "0", SCRIPT], {}, "--monitor-interval=0"),
    (["--monitor-interval", "fast", SCRIPT], {}, "--monitor-interval=fast"),
    (["--event-log-handler", "logging", SCRIPT], {}, "--event-log-handler=logging: not a torch event handler"),
    (["--shutdown-timeout", "-5", SCRIPT], {}, "--shutdown-timeout=-5"),
    (["--shutdown-timeout", "later", SCRIPT], {}, "--shutdown-timeout=later"),
    (["--inprocess-timeout", "0", SCRIPT], {}, "--inprocess-timeout=0"),
    (["--rdzv-backend", "zookeeper", SCRIPT], {}, "--rdzv-backend=zookeeper: unknown rendezvous backend (known: static, c10d, etcd, etcd-v2, etcd-v3"),
    # torchrun.logs_specs / torchrun.handlers entry points (tests/plugins/elaunch_test_plugin)
    (["--logs-specs=nope", SCRIPT], {}, "--logs-specs=nope: no 'torchrun.logs_specs' entry point of that name "
                                        "(installed: default, elaunch-test-broken, elaunch-test-flat)"),
    (["--logs-specs=elaunch-test-broken", SCRIPT], {},
     "--logs-specs=elaunch-test-broken: the entry point elaunch_test_plugin.missing_module:Nothing failed to load: "
     "ModuleNotFoundError"),
    (["--rdzv-backend=elaunch-test-misnamed", "--rdzv-endpoint=127.0.0.1:0", SCRIPT], {},
     "--rdzv-backend=elaunch-test-misnamed: the handler's get_backend() is 'c10d', not 'elaunch-test-misnamed'"),
    (["--rdzv-backend", "c10d", "--rdzv-endpoint", "h:70000", SCRIPT], {}, "--rdzv-endpoint=h:70000"),
    (["--rdzv-backend", "c10d", "--rdzv-endpoint", "h:0", SCRIPT], {}, "--rdzv-endpoint=h:0"),
    (["--rdzv-backend", "c10d", "--rdzv-endpoint", "::1:29400", SCRIPT], {}, "--rdzv-endpoint=::1:29400"),
    (["--rdzv-conf", "join_timeout", SCRIPT], {}, "--rdzv-conf=join_timeout"),
    (["--rdzv-conf", "=5", SCRIPT], {}, "--rdzv-conf==5"),
    # values are checked by the backend, still before anything starts
    (["--nnodes=1:2", "--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:29411", "--rdzv-conf=join_timeout=abc", SCRIPT], {}, "join_timeout=abc"),
    (["--nnodes=1:2", "--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:29411", "--rdzv-conf=last_call_timeout=-3", SCRIPT], {}, "last_call_timeout=-3"),
    (["--nnodes=1:2", "--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:29411", "--rdzv-conf=is_host=maybe", SCRIPT], {}, "is_host=maybe"),
    (["--signals-to-handle", "SIGTERM,SIGNOPE", SCRIPT], {}, "SIGNOPE"),
    (["--hang-timeout", "-1", SCRIPT], {}, "--hang-timeout=-1: must be >= 0 seconds"),
    (["--hang_timeout", "a while", SCRIPT], {}, "--hang-timeout=a while: expected seconds"),
    ([SCRIPT], {"PET_HANG_TIMEOUT": "-2"}, "PET_HANG_TIMEOUT=-2"),
    (["--metrics-port", "http", SCRIPT], {}, "--metrics-port=http: expected an integer"),
    (["--metrics_port", "65536", SCRIPT], {}, "--metrics-port=65536: must be in 0-65535"),
    ([SCRIPT], {"PET_METRICS_PORT": "-1"}, "PET_METRICS_PORT=-1: must be in 0-65535"),
    (["--forward-signals", "SIGUSR1,SIGNOPE", SCRIPT], {}, "--forward-signals=SIGUSR1,SIGNOPE: unknown signal 'SIGNOPE'"),
    (["--forward-signals", "SIGKILL", SCRIPT], {}, "--forward-signals=SIGKILL: SIGKILL cannot be handled"),
    ([SCRIPT], {"PET_FORWARD_SIGNALS": "SIGSTOP"}, "PET_FORWARD_SIGNALS=SIGSTOP: SIGSTOP cannot be handled"),
    (["--forward-signals", "SIGUSR1", "--signals-to-handle", "SIGTERM,SIGUSR1", SCRIPT], {},
     "--forward-signals=SIGUSR1: SIGUSR1 is also in --signals-to-handle=SIGTERM,SIGUSR1"),
    (["--forward_signals", "SIGTERM", SCRIPT], {}, "SIGTERM is also in --signals-to-handle"),
    (["--no-python", "-m", "pkg.mod"], {}, "--no-python"),
    (["/definitely/not/here.py"], {}, "/definitely/not/here.py"),
    (["--no-python", "no-such-program-xyz"], {}, "no-such-program-xyz"),
    (["--redirects", "7", SCRIPT], {}, "--redirects=7"),
    (["-t", "0:9", SCRIPT], {}, "--tee=0:9"),
    (["--local-ranks-filter", "0,a", SCRIPT], {}, "--local-ranks-filter=0,a"),
    ([], {}, "missing the training script"),
    (["--nproc-per-node=2"], {}, "missing the training script"),
    (["--start-method", "thread", SCRIPT], {}, "--start-method=thread"),
    (["--nnodes", "2", "--node-rank", "2", SCRIPT], {}, "--node-rank=2"),
    (["--master-port", "0", "--nnodes", "2", SCRIPT], {}, "--master-port=0"),
    (["--numa-binding", "everywhere", SCRIPT], {}, "--numa-binding=everywhere"),
    (["--no-such-flag", SCRIPT], {}, "--no-such-flag"),
    ([SCRIPT], {"PET_NNODES": "3:2"}, "PET_NNODES=3:2"),
    ([SCRIPT], {"PET_STANDALONE": "yes"}, "PET_STANDALONE=yes"),
    ([SCRIPT], {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "soon"}, "TORCH_ELASTIC_SHUTDOWN_TIMEOUT=soon"),
    # found by a CLI audit (session 42): each was a traceback, a crash mid-run, or a job that could not run
    (["--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:29411", "--rdzv-conf=read_timeout=inf", SCRIPT], {},
     "--rdzv-conf read_timeout=inf: must be at most 1e+08 seconds"),
    (["--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:29411", "--rdzv-conf=read_timeout=1e12", SCRIPT], {},
     "--rdzv-conf read_timeout=1e12: must be at most"),
    (["--standalone", "--local-addr=bad!host", SCRIPT], {}, "--local-addr=bad!host: expected a host name or an IP"),
    (["--nnodes=1", "--master-addr=a b", SCRIPT], {}, "--master-addr=a b: expected a host name or an IP address"),
    (["--signals-to-handle=SIGTERM,SIGCHLD", SCRIPT], {}, "SIGCHLD is the agent's own"),
    (["{tmp}"], {}, "a directory without __main__.py (training script)"),
    (["--no-python", "{tmp}"], {}, "a directory (--no-python runs it as a program)"),
    (["--no-python", "{script}"], {}, "not executable (--no-python runs it as a program)"),
]


def _env(extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PET_", "TORCHELASTIC_", "TORCH_ELASTIC_"))}
    env.update(extra)
    return env


@pytest.mark.parametrize("argv, extra_env, needle", CASES, ids=[" ".join(c[0]) or "<none>" for c in CASES])
def test_bad_input_is_one_line_and_exit_2(tmp_path, argv, extra_env, needle):
    script = tmp_path / "train.py"
    script.write_text("raise SystemExit('must never run')\n")
    argv = [str(script) if a == SCRIPT else str(tmp_path) if a == "{tmp}" else a for a in argv]
    proc = subprocess.run([sys.executable, "-m", "elaunch", *argv], capture_output=True, text=True,
                          env=_env(extra_env), cwd=tmp_path, timeout=60)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2, proc.stderr
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("elaunch: error: ")
    assert needle in lines[0]
    assert "Traceback" not in proc.stderr and "Usage:" not in proc.stderr
    assert proc.stdout == ""


def test_a_directory_with_main_runs_as_the_script_and_short_options_take_an_equals_sign(tmp_path):
    """``python dir`` runs ``dir/__main__.py``, and torchrun's workers do (elaunch said "no such file"); ``-t=3``
    is ``-t 3`` to argparse (elaunch read the value as "=3")."""
    app = tmp_path / "app"
    app.mkdir()
    (app / "__main__.py").write_text("import os\nprint('main of app', os.environ['LOCAL_RANK'])\n")
    proc = subprocess.run([sys.executable, "-m", "elaunch", "--standalone", "--nproc-per-node=2", "-t=3", str(app)],
                          capture_output=True, text=True, env=_env({}), cwd=tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert sorted(line for line in proc.stdout.splitlines() if "main of app" in line) == [
        "[default0]:main of app 0", "[default1]:main of app 1"]


@pytest.mark.skipif(not shutil.which("setpriv") or os.geteuid() != 0, reason="needs root's setpriv to drop its file rights")
def test_an_unreadable_script_is_one_line_and_exit_2(tmp_path):
    """Every worker failed with 'Permission denied' (and restarted) before. Root reads any file, so the launcher
    runs without the capabilities that let it (setpriv)."""
    script = tmp_path / "unread.py"
    script.write_text("raise SystemExit('must never run')\n")
    script.chmod(0)
    proc = subprocess.run(["setpriv", "--bounding-set=-dac_override,-dac_read_search", "--inh-caps=-all",
                           sys.executable, "-m", "elaunch", "--standalone", "--max-restarts=2", str(script)],
                          capture_output=True, text=True, env=_env({}), cwd=tmp_path, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == f"elaunch: error: {script}: cannot be read (Permission denied) (training script)"
