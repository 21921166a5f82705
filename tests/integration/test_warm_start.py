"""--warm-start: restarted workers run in pre-started spares, indistinguishable from cold ones."""

from __future__ import annotations

import json
import os
import signal

import psutil
import pytest

from tests.conftest import wait_for
from tests.helpers import SCRIPTS, alive, kill_tree, launcher_env, run, start

WARM = ("--standalone", "--nproc-per-node=2", "--max-restarts=1", "--warm-start", "--warm-start-modules=json")
#: Values that differ between any two attempts, warm or cold.
PER_ATTEMPT = {"MASTER_PORT", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_ERROR_FILE"}


def _probes(out, rank):
    cold = json.loads((out / f"probe_{rank}_0.json").read_text())
    warm = json.loads((out / f"probe_{rank}_1.json").read_text())
    return cold, warm


def _assert_same(cold: dict, warm: dict) -> None:
    for key in set(cold) | set(warm):
        if key in ("env", "pid", "cmdline"):
            continue
        assert cold[key] == warm[key], (key, cold[key], warm[key])
    assert not any(a.endswith("_warm_child.py") for a in cold["cmdline"]), cold["cmdline"]
    assert any(a.endswith("_warm_child.py") for a in warm["cmdline"]), warm["cmdline"]  # really a spare
    ce, we = cold["env"], warm["env"]
    assert set(ce) == set(we), (set(ce) ^ set(we))
    differ = {k for k in ce if ce[k] != we[k]}
    assert differ <= PER_ATTEMPT, {k: (ce[k], we[k]) for k in differ}


def _warm_pids(agent_pid: int) -> set[int]:
    try:
        kids = psutil.Process(agent_pid).children()
    except psutil.Error:
        return set()
    out = set()
    for k in kids:
        try:
            if any(a.endswith("_warm_child.py") for a in k.cmdline()):
                out.add(k.pid)
        except psutil.Error:
            pass
    return out


def test_restarted_script_sees_what_a_cold_one_sees(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    r = run("elaunch", *WARM, str(SCRIPTS / "warm_probe.py"), str(out), "x y", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    for rank in (0, 1):
        cold, warm = _probes(out, rank)
        _assert_same(cold, warm)
        assert warm["env"]["TORCHELASTIC_RESTART_COUNT"] == "1"
        assert warm["argv"] == [str(SCRIPTS / "warm_probe.py"), str(out), "x y"]
        assert warm["path0"] == str(SCRIPTS) and warm["name"] == "__main__" and warm["main_is_me"]


def test_spares_import_at_the_lowest_priority_and_workers_run_at_the_agents(tmp_path):
    """A spare imports in a nice-19 thread (idle CPU only, beside the group it serves next); the worker it
    becomes runs its script at the agent's priority, as a cold worker does."""
    out, nice = tmp_path / "out", tmp_path / "nice"
    out.mkdir()
    nice.mkdir()
    env = {**launcher_env(), "WARM_NICE_OUT": str(nice)}
    r = run("elaunch", *WARM[:-1], "--warm-start-modules=json,warm_nice_probe", str(SCRIPTS / "warm_probe.py"),
            str(out), cwd=tmp_path, env=env)
    assert r.returncode == 0, r.stderr
    imports = {p.name: p.read_text() for p in nice.iterdir()}
    warm_pids = {str(json.loads((out / f"probe_{rank}_1.json").read_text())["pid"]) for rank in (0, 1)}
    assert warm_pids <= set(imports), (warm_pids, imports)  # the workers of attempt 1 were these spares
    assert {imports[p] for p in warm_pids} == {"19"}, imports
    for rank in (0, 1):
        cold, warm = _probes(out, rank)
        assert cold["nice"] == warm["nice"] == os.getpriority(os.PRIO_PROCESS, 0), (cold["nice"], warm["nice"])


def test_module_mode_relative_path_and_symlink(tmp_path):
    """-m runs with sys.path[0] = cwd; a relative, symlinked script resolves sys.path[0] like CPython."""
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "probe.py").write_text((SCRIPTS / "warm_probe.py").read_text())
    (tmp_path / "link.py").symlink_to(tmp_path / "pkg" / "probe.py")
    for name, args in (("module", ("-m", "pkg.probe")), ("symlink", ("link.py",))):
        out = tmp_path / name
        out.mkdir()
        r = run("elaunch", *WARM, *args, str(out), cwd=tmp_path)
        assert r.returncode == 0, r.stderr
        for rank in (0, 1):
            _assert_same(*_probes(out, rank))
    cold, _ = _probes(tmp_path / "module", 0)
    assert cold["path0"] == str(tmp_path) and cold["spec"] == "pkg.probe"
    cold, _ = _probes(tmp_path / "symlink", 0)
    assert cold["path0"] == str(tmp_path / "pkg") and cold["argv"][0] == "link.py"


def test_uncaught_exception_reads_as_in_a_cold_worker(tmp_path):
    out, logs = tmp_path / "out", tmp_path / "logs"
    out.mkdir()
    one = ("--standalone", "--nproc-per-node=1", "--max-restarts=1", "--warm-start", "--warm-start-modules=json")
    r = run("elaunch", *one, f"--log-dir={logs}", "--redirects=2", str(SCRIPTS / "warm_probe.py"), str(out),
            "--raise", cwd=tmp_path)
    assert r.returncode == 1
    (run_dir,) = logs.iterdir()
    for rank in (0,):
        cold = (run_dir / "attempt_0" / str(rank) / "stderr.log").read_text()
        warm = (run_dir / "attempt_1" / str(rank) / "stderr.log").read_text()
        assert "ValueError: probe failure on purpose" in warm
        assert warm == cold
    assert not (run_dir / "attempt_2").exists()  # no spares prepared once no restart is left
    assert json.loads((out / "probe_0_1.json").read_text())["pid"] != json.loads((out / "probe_0_0.json").read_text())["pid"]


@pytest.mark.parametrize("how", ["SIGKILL", "SIGTERM"])
def test_spares_die_with_the_agent(tmp_path, how):
    agent = start("elaunch", "--standalone", "--nproc-per-node=2", "--max-restarts=3", "--warm-start",
                  "--warm-start-modules=json", str(SCRIPTS / "sleeper.py"), str(tmp_path))
    try:
        spares = wait_for(lambda: _warm_pids(agent.pid) if len(_warm_pids(agent.pid)) == 2 else None, 30,
                          what="two warm spares")
        agent.send_signal(getattr(signal, how))
        wait_for(lambda: not any(alive(p) for p in spares), 15, what="spares gone")
        agent.wait(15)
    finally:
        kill_tree(agent.pid)
        agent.communicate()
