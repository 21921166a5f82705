"""elaunch.run beside torch.distributed.run on real jobs: a failing script, a signal.

Each case runs the same small driver program once with ``torch.distributed.run``
and once with ``elaunch.run`` (each in its own interpreter, one worker) and
compares what the Python API raised. The ``elaunch`` command's own outcome for an
unused ``--rdzv-conf`` key is checked last.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.conftest import wait_for
from tests.helpers import ELAUNCH_ADDED_ENV, free_port

pytest.importorskip("torch")

REPO = Path(__file__).resolve().parents[2]
MODULES = ["torch.distributed.run", "elaunch.run"]

# Runs module.main(argv) and reports what it raised as one JSON line on stdout.
DRIVER = textwrap.dedent("""
    import importlib, json, sys
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    module = importlib.import_module(sys.argv[1])
    try:
        module.main(sys.argv[2:])
        out = {"raised": None}
    except ChildFailedError as exc:
        rank, first = exc.get_first_failure()
        out = {"raised": "ChildFailedError", "ranks": sorted(exc.failures), "rank": rank,
               "exitcode": first.exitcode, "name": exc.name, "msg_has_name": exc.name in exc.format_msg()}
    except SignalException as exc:
        out = {"raised": "SignalException", "sigval": int(exc.sigval), "is_enum": type(exc.sigval).__name__}
    print("RESULT " + json.dumps(out), flush=True)
""")


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "TORCHELASTIC_"))}
    env["PYTHONPATH"] = str(REPO)
    return env


def _result(stdout: str) -> dict:
    lines = [line for line in stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, stdout
    return json.loads(lines[-1][len("RESULT "):])


@pytest.fixture
def driver(tmp_path):
    path = tmp_path / "driver.py"
    path.write_text(DRIVER)
    return str(path)


def test_failed_job_raises_child_failed_error(tmp_path, driver):
    script = tmp_path / "fail.py"
    script.write_text("import sys\nsys.exit(3)\n")
    results = {}
    for module in MODULES:
        proc = subprocess.run([sys.executable, driver, module, "--nproc-per-node=1", "--monitor-interval=0.1",
                               str(script)], capture_output=True, text=True, env=_env(), cwd=tmp_path, timeout=120)
        results[module] = _result(proc.stdout)
    theirs, ours = results["torch.distributed.run"], results["elaunch.run"]
    assert theirs == {"raised": "ChildFailedError", "ranks": [0], "rank": 0, "exitcode": 3,
                      "name": str(script), "msg_has_name": True}
    # torch names the entrypoint by its full path, elaunch by the script's name
    assert ours == dict(theirs, name="fail.py")


@pytest.mark.parametrize("module", MODULES)
def test_handled_signal_raises_signal_exception(tmp_path, driver, module):
    ready = tmp_path / "ready"
    script = tmp_path / "wait.py"
    script.write_text(f"import pathlib, time\npathlib.Path({str(ready)!r}).write_text('1')\ntime.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, driver, module, "--nproc-per-node=1", str(script)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(), cwd=tmp_path)
    try:
        wait_for(ready.exists, 60, what="the worker to start")
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert _result(out) == {"raised": "SignalException", "sigval": int(signal.SIGTERM), "is_enum": "Signals"}


def test_command_ignores_an_unused_rdzv_conf_key_with_one_warning(tmp_path):
    script = tmp_path / "ok.py"
    script.write_text("print('WORKER OK')\n")
    proc = subprocess.run([sys.executable, "-m", "elaunch", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}",
                           "--rdzv-conf=timeout=5',join_timeout=30", str(script)],
                          capture_output=True, text=True, env=_env(), cwd=tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "WORKER OK" in proc.stdout
    warnings = [line for line in proc.stderr.splitlines() if "--rdzv-conf" in line]
    assert len(warnings) == 1 and warnings[0].endswith("the c10d rendezvous does not use timeout; ignored")


#: Variables whose values differ between any two launches (ports, ids, file paths).
PER_LAUNCH = {"MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_ERROR_FILE"}


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["standalone", "static", "c10d"])
def test_main_gives_the_workers_torchs_environment(tmp_path, driver, backend):
    # main(argv) of each module on one node of 2 workers: the same variables, the same values
    # (TORCHELASTIC_USE_AGENT_STORE included), but for each launch's own port, id and files
    from tests.helpers import SCRIPTS, load_envs

    envs = {}
    for module in MODULES:
        out = tmp_path / module
        out.mkdir()
        port = free_port()
        args = {"standalone": ["--standalone"],
                "static": ["--rdzv-backend=static", "--node-rank=0", "--master-addr=127.0.0.1",
                           f"--master-port={port}"],
                "c10d": ["--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=env"]}[backend]
        r = subprocess.run([sys.executable, driver, module, "--nnodes=1", "--nproc-per-node=2", *args,
                            str(SCRIPTS / "env_dump.py"), str(out)],
                           capture_output=True, text=True, timeout=120, env=_env())
        assert _result(r.stdout) == {"raised": None}, r.stderr[-3000:]
        envs[module] = load_envs(out)
    theirs, ours = envs["torch.distributed.run"], envs["elaunch.run"]
    assert sorted(ours) == sorted(theirs)
    for name in theirs:
        keys = set(theirs[name]) | set(ours[name])
        differ = {k: (ours[name].get(k), theirs[name].get(k)) for k in keys
                  if ours[name].get(k) != theirs[name].get(k) and k not in PER_LAUNCH | ELAUNCH_ADDED_ENV}
        # torchrun's standalone and c10d agents name the store by the host's FQDN, elaunch's by address
        differ.pop("MASTER_ADDR", None)
        assert not differ, (name, differ)
        assert ours[name]["TORCHELASTIC_USE_AGENT_STORE"] == "True"
