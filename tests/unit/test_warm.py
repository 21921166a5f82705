"""Warm start's pure parts: which argv can be warmed, the handoff encoding, the flags."""

from __future__ import annotations

import importlib.util
import logging
import os
import sys

import pytest

from elaunch.cli import parse_config
from elaunch.config import ConfigError
from elaunch.procs import warm


def _child():
    spec = importlib.util.spec_from_file_location("_warm_child_under_test", warm.CHILD)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize(
    "cmd,mode,target,args",
    [
        (["/usr/bin/python3", "-u", "train.py", "--lr", "1"], "script", "train.py", ("--lr", "1")),
        (["/usr/bin/python3", "-u", "-m", "pkg.train", "x"], "module", "pkg.train", ("x",)),
        (["/opt/venv/bin/python", "-u", "-m", "elaunch.runpath", "t.py"], "module", "elaunch.runpath", ("t.py",)),
        (["python3.11", "t.py"], "script", "t.py", ()),
    ],
)
def test_python_worker_argv_is_warmable(cmd, mode, target, args, tmp_path):
    t = warm.parse_worker_cmd(cmd, cwd=str(tmp_path))
    assert (t.python, t.mode, t.target, t.args) == (cmd[0], mode, target, args)
    assert t.path0 == str(tmp_path)


@pytest.mark.parametrize("cmd", [["./train.sh", "x"], ["/bin/echo"], ["python3", "-u", "-c", "pass"], ["python3", "-X", "dev", "t.py"]])
def test_other_argv_is_not_warmable(cmd):
    assert warm.parse_worker_cmd(cmd) is None


def test_script_symlink_resolves_like_cpython(tmp_path):
    (tmp_path / "real").mkdir()
    (tmp_path / "real" / "t.py").write_text("")
    (tmp_path / "t.py").symlink_to("real/t.py")
    assert warm.parse_worker_cmd(["python3", "t.py"], cwd=str(tmp_path)).path0 == str(tmp_path / "real")


def test_handoff_round_trips_through_the_child_decoder():
    t = warm.WarmTarget("python3", ("-u",), "script", "t.py", ("a b", "", "é"), "/x")
    env = {"RANK": "3", "EMPTY": "", "PATH": "/bin:/usr/bin", "UNI": "ü"}
    argv = ["python3", "-u", "t.py", "a b", "", "é"]
    mode, target, args, orig, got = _child()._decode(warm.encode_handoff(t, argv, env))
    assert (mode, target, args, orig) == ("script", "t.py", ["a b", "", "é"], argv)
    assert {os.fsdecode(k): os.fsdecode(v) for k, v in got.items()} == env


def test_spawn_env_leaves_out_round_variables():
    env = {"PATH": "/bin", "OMP_NUM_THREADS": "1", "LOCAL_RANK": "1", "RANK": "5", "MASTER_PORT": "1234"}
    assert warm.spawn_env(env) == {"PATH": "/bin", "OMP_NUM_THREADS": "1", "LOCAL_RANK": "1"}


def test_handoff_without_spare_starts_cold():
    pool = warm.WarmPool(("json",))
    assert pool.handoff(0, ["python3", "t.py"], {}) is None and pool.logs_for(1) is None
    pool.close()


@pytest.fixture
def script(tmp_path):
    p = tmp_path / "train.py"
    p.write_text("")
    return str(p)


def test_flag_defaults_and_env(script):
    assert parse_config([script], {}).warm_start_modules is None
    assert parse_config(["--warm-start", script], {}).warm_start_modules == ("torch", "torch._dynamo")
    assert parse_config([script], {"PET_WARM_START": "1"}).warm_start_modules == ("torch", "torch._dynamo")
    cfg = parse_config(["--warm-start", "--warm-start-modules=numpy,torch.distributed", script], {})
    assert cfg.warm_start_modules == ("numpy", "torch.distributed")


def test_bad_module_name_names_it(script):
    with pytest.raises(ConfigError, match="--warm-start-modules=torch,1bad: '1bad'"):
        parse_config(["--warm-start", "--warm-start-modules=torch,1bad", script], {})


def test_no_python_ignores_warm_start_with_a_log_line(caplog):
    with caplog.at_level(logging.WARNING):
        cfg = parse_config(["--warm-start", "--no-python", sys.executable], {"PATH": os.defpath})
    assert cfg.warm_start_modules is None
    assert "--warm-start does not apply" in caplog.text


def test_a_template_forks_only_once_its_importing_thread_is_gone():
    """The importing thread releases the imports' lock and then still runs its exit: the template
    waits for the kernel to drop the thread (a fork meanwhile could copy a lock it holds)."""
    import _thread
    import threading

    child = _child()
    released, leave = _thread.allocate_lock(), threading.Event()
    released.acquire()

    def importer():
        child._IMPORTER.append((_thread.get_ident(), _thread.get_native_id()))
        released.release()  # as _import_all's finally does
        leave.wait(30)  # ... and the thread has yet to end

    _thread.start_new_thread(importer, ())
    released.acquire()
    assert child._importer_gone(0.2) is False  # still there: no fork
    leave.set()
    assert child._importer_gone(10.0) is True
