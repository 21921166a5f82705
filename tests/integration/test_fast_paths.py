"""Fast paths: a light agent (no torch, no etcd clients) and the adaptive last call."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.helpers import SCRIPTS, launcher_env

#: Modules the agent must not load for the standalone/static backends.
FORBIDDEN = ("torch", "numpy", "etcd", "etcd3", "grpc", "urllib3", "requests", "psutil")

_PROBE = """
import json, sys
from elaunch.cli import run_argv
status = run_argv(sys.argv[1:])
loaded = sorted(m.split(".")[0] for m in sys.modules)
print(json.dumps({"status": status, "modules": loaded}))
"""


@pytest.mark.parametrize(
    "args",
    [
        ("--standalone", "--nproc-per-node=2"),
        ("--nnodes=1", "--nproc-per-node=1", "--rdzv-backend=static", "--master-addr=127.0.0.1"),
    ],
    ids=["standalone", "static"],
)
def test_agent_imports_no_heavy_modules(args, tmp_path):
    """A whole run (parse, rendezvous, workers, exit) leaves torch and the etcd clients unloaded."""
    from tests.helpers import free_port

    if "--rdzv-backend=static" in args:
        args = (*args, f"--master-port={free_port()}")
    r = subprocess.run(
        [sys.executable, "-c", _PROBE, *args, str(SCRIPTS / "env_dump.py"), str(tmp_path)],
        capture_output=True, text=True, env=launcher_env(), timeout=60,
    )
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout.strip().splitlines()[-1])
    assert doc["status"] == 0, r.stderr
    assert list(tmp_path.glob("env_*.json")), "the workers did not run"
    loaded = set(doc["modules"])
    assert not loaded & set(FORBIDDEN), sorted(loaded & set(FORBIDDEN))


def test_elastic_start_with_one_of_two_nodes_does_not_wait_for_the_fixed_last_call(tmp_path):
    """``--nnodes=1:2`` with one node: the adaptive last call completes the round (default conf).

    With torch's fixed 30 s last call the round would take 30 s; the agent logs (INFO)
    how long its rendezvous took, start-up excluded.
    """
    import re

    from tests.helpers import free_port, run

    port = free_port()
    r = run(
        "elaunch", "--nnodes=1:2", "--nproc-per-node=1", "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=settle", "--local-addr=127.0.0.1",
        str(SCRIPTS / "env_dump.py"), str(tmp_path), timeout=120, env=launcher_env(LOGLEVEL="INFO"),
    )
    assert r.returncode == 0, r.stderr
    took = re.search(r"joined round 0 of rendezvous 'settle' as rank 0 of 1 in ([\d.]+) s", r.stderr)
    assert took and float(took.group(1)) < 30, r.stderr
    env = json.loads((tmp_path / "env_0_0.json").read_text())["env"]
    assert (env["WORLD_SIZE"], env["GROUP_WORLD_SIZE"]) == ("1", "1")
