"""--warm-start: restarted workers run in pre-started spares, indistinguishable from cold ones."""

from __future__ import annotations

import json
import os
import signal
import sys

import psutil
import pytest

from elaunch.procs import warm
from tests.conftest import wait_for
from tests.helpers import SCRIPTS, alive, free_port, kill_tree, launcher_env, run, start

WARM = ("--standalone", "--nproc-per-node=2", "--max-restarts=1", "--warm-start", "--warm-start-modules=json")
#: Values that differ between any two attempts, warm or cold.
PER_ATTEMPT = {"MASTER_PORT", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_ERROR_FILE"}
#: Values that differ between two runs of the same job.
PER_RUN = {"TORCHELASTIC_RUN_ID", "ELAUNCH_CHECKPOINT_SHM", "ELAUNCH_PROGRESS_FILE", "ELAUNCH_STACKS_FILE",
           "ELAUNCH_CONTROL"}


def _probe(out, rank, attempt):
    return json.loads((out / f"probe_{rank}_{attempt}.json").read_text())


def _warm_and_cold(where, target: tuple[str, ...], args: tuple[str, ...] = (), warm_args: tuple[str, ...] = WARM[-2:],
                   env=None, cwd=None) -> tuple:
    """Run the probe job (``target`` OUT ``args``) cold (no --warm-start) and warm, OUT under ``where``;
    return the two output directories."""
    outs = []
    for name, extra in (("cold", ()), ("warm", warm_args)):
        out = where / name
        out.mkdir()
        r = run("elaunch", *WARM[:-2], *extra, *target, str(out), *args, cwd=cwd or where, env=env)
        assert r.returncode == 0, r.stderr
        outs.append(out)
    return tuple(outs)


def _assert_same(cold: dict, warm: dict) -> None:
    """``warm`` (a spare's worker) saw what ``cold`` (a cold worker of another run) saw."""
    for key in set(cold) | set(warm):
        if key in ("env", "pid", "ppid", "sid", "cmdline", "argv", "orig_argv"):
            continue
        assert cold[key] == warm[key], (key, cold[key], warm[key])
    assert [a.replace("/cold", "/warm") for a in cold["argv"]] == warm["argv"]
    assert not any(a.endswith("_warm_child.py") for a in cold["cmdline"]), cold["cmdline"]
    assert any(a.endswith("_warm_child.py") for a in warm["cmdline"]), warm["cmdline"]  # really a spare
    ce, we = cold["env"], warm["env"]
    assert set(ce) == set(we), (set(ce) ^ set(we))
    differ = {k for k in ce if ce[k] != we[k]}
    assert differ <= PER_ATTEMPT | PER_RUN, {k: (ce[k], we[k]) for k in differ}


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


def test_first_and_restarted_scripts_see_what_a_cold_one_sees(tmp_path):
    """Both attempts run in spares (the first attempt's started before the round formed)."""
    cold_out, out = _warm_and_cold(tmp_path, (str(SCRIPTS / "warm_probe.py"),), ("x y",))
    for rank in (0, 1):
        for attempt in (0, 1):
            cold, warm = _probe(cold_out, rank, attempt), _probe(out, rank, attempt)
            _assert_same(cold, warm)
            assert warm["env"]["TORCHELASTIC_RESTART_COUNT"] == str(attempt)
            assert warm["argv"] == [str(SCRIPTS / "warm_probe.py"), str(out), "x y"]
            assert warm["path0"] == str(SCRIPTS) and warm["name"] == "__main__" and warm["main_is_me"]


def test_the_nodes_one_template_imports_once_before_any_group_and_workers_run_at_the_agents_priority(tmp_path):
    """The node's template starts before the first round (no group runs yet) and imports at the agent's
    priority, once for every local rank; every attempt's workers are its forks and run their scripts at the
    agent's priority, in autogroups at 0, as cold workers do. (A template started beside a running group
    imports at nice 19: the autogroup test below.)"""
    nice = tmp_path / "nice"
    nice.mkdir()
    env = {**launcher_env(), "WARM_NICE_OUT": str(nice)}
    cold_out, out = _warm_and_cold(tmp_path, (str(SCRIPTS / "warm_probe.py"),),
                                   warm_args=("--warm-start", "--warm-start-modules=json,warm_nice_probe"), env=env)
    imports = {p.name: p.read_text().split() for p in nice.iterdir()}  # pid: [thread's nice, autogroup's]
    agent_nice = os.getpriority(os.PRIO_PROCESS, 0)
    group = "0" if os.path.exists("/proc/self/autogroup") else "-"  # a new session's autogroup starts at 0
    assert list(imports.values()) == [[str(agent_nice), group]], imports  # one import for the node's 2 ranks
    for rank in (0, 1):
        for attempt in (0, 1):
            probe = _probe(out, rank, attempt)
            assert _forked(probe) and str(probe["pid"]) not in imports
            assert probe["nice"] == _probe(cold_out, rank, attempt)["nice"] == agent_nice
            assert probe["autogroup"] == _probe(cold_out, rank, attempt)["autogroup"] == (None if group == "-" else "0")


def test_module_mode_relative_path_and_symlink(tmp_path):
    """-m runs with sys.path[0] = cwd; a relative, symlinked script resolves sys.path[0] like CPython."""
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "probe.py").write_text((SCRIPTS / "warm_probe.py").read_text())
    (tmp_path / "link.py").symlink_to(tmp_path / "pkg" / "probe.py")
    for name, args in (("module", ("-m", "pkg.probe")), ("symlink", ("link.py",))):
        (tmp_path / name).mkdir()
        cold_out, out = _warm_and_cold(tmp_path / name, args, cwd=tmp_path)
        for rank in (0, 1):
            for attempt in (0, 1):
                _assert_same(_probe(cold_out, rank, attempt), _probe(out, rank, attempt))
    cold = _probe(tmp_path / "module" / "cold", 0, 0)
    assert cold["path0"] == str(tmp_path) and cold["spec"] == "pkg.probe"
    cold = _probe(tmp_path / "symlink" / "cold", 0, 0)
    assert cold["path0"] == str(tmp_path / "pkg") and cold["argv"][0] == "link.py"


def test_uncaught_exception_reads_as_in_a_cold_worker(tmp_path):
    one = ("--standalone", "--nproc-per-node=1", "--max-restarts=1", "--redirects=2")
    runs = {}
    for name, extra in (("cold", ()), ("warm", ("--warm-start", "--warm-start-modules=json"))):
        out, logs = tmp_path / name, tmp_path / f"{name}-logs"
        out.mkdir()
        r = run("elaunch", *one, *extra, f"--log-dir={logs}", str(SCRIPTS / "warm_probe.py"), str(out), "--raise",
                cwd=tmp_path)
        assert r.returncode == 1
        (runs[name],) = logs.iterdir()
    cold = (runs["cold"] / "attempt_0" / "0" / "stderr.log").read_text()
    assert "ValueError: probe failure on purpose" in cold
    for attempt in (0, 1):
        warm = (runs["warm"] / f"attempt_{attempt}" / "0" / "stderr.log").read_text()
        assert warm == cold.replace("/cold", "/warm")
    assert not (runs["warm"] / "attempt_2").exists()  # no spares prepared once no restart is left
    warm_out = tmp_path / "warm"
    assert _probe(warm_out, 0, 1)["pid"] != _probe(warm_out, 0, 0)["pid"]
    assert any(a.endswith("_warm_child.py") for a in _probe(warm_out, 0, 0)["cmdline"])  # a spare's, too


@pytest.mark.parametrize("how", ["SIGKILL", "SIGTERM"])
def test_spares_die_with_the_agent(tmp_path, how):
    # The node's template and the first attempt's two spares it forks start before the rendezvous, which waits
    # here for a second node that never comes: they stay a template and two idle spares until the signal.
    agent = start("elaunch", "--nnodes=2", "--nproc-per-node=2", "--max-restarts=3", "--rdzv-backend=c10d",
                  f"--rdzv-endpoint=127.0.0.1:{free_port()}", "--rdzv-id=spares-die", "--local-addr=127.0.0.1",
                  "--warm-start", "--warm-start-modules=json", str(SCRIPTS / "sleeper.py"), str(tmp_path))
    try:
        spares = wait_for(lambda: (lambda pids: pids if len(pids) == 3 else None)(_warm_pids(agent.pid)), 60,
                          what="the template and two warm spares")
        assert not list(tmp_path.glob("pids_*")), "no round can have formed: no worker ran"
        agent.send_signal(getattr(signal, how))
        wait_for(lambda: not any(alive(p) for p in spares), 15, what="spares gone")
        agent.wait(15)
    finally:
        kill_tree(agent.pid)
        agent.communicate()


def _forked(probe: dict) -> bool:
    """True when the probe ran in a spare forked from a warm template (not an interpreter of its own)."""
    return "--template" in probe["cmdline"]


def test_every_spare_is_forked_from_the_nodes_template_and_sees_what_a_cold_one_sees(tmp_path):
    """Every spare of every local rank and attempt is forked from the node's one template (one import per
    node and run, not per rank or attempt): the agent's own child in its own session, at the agent's
    priority, with numpy's global generator seeded afresh, and a script that sees what a cold worker sees."""
    nice = tmp_path / "nice"
    nice.mkdir()
    env = {**launcher_env(), "WARM_NICE_OUT": str(nice), "PROBE_FAILS": "3", "PROBE_NUMPY": "1",
           "WARM_NICE_NUMPY": "1"}  # the template draws from numpy's generator as it imports
    runs = {"cold": ((), env), "warm": (("--warm-start", "--warm-start-modules=json,numpy,warm_nice_probe"), env)}
    for name, (flags, run_env) in runs.items():
        (tmp_path / name).mkdir()
        r = run("elaunch", *WARM[:-3], "--max-restarts=3", *flags, str(SCRIPTS / "warm_probe.py"),
                str(tmp_path / name), "x y", cwd=tmp_path, env=run_env)
        assert r.returncode == 0, r.stderr
    cold_out, out = tmp_path / "cold", tmp_path / "warm"
    agent_nice = os.getpriority(os.PRIO_PROCESS, 0)
    assert len(list(nice.iterdir())) == 1  # one import, by the template
    for rank in (0, 1):
        probes = [_probe(out, rank, attempt) for attempt in range(4)]
        assert [_forked(p) for p in probes] == [True, True, True, True], [p["cmdline"] for p in probes]
        for attempt in range(4):
            cold, warm = _probe(cold_out, rank, attempt), probes[attempt]
            _assert_same({**cold, "np": 0}, {**warm, "np": 0})
            assert warm["main_thread"]
            assert warm["ppid"] == _probe(out, 0, 0)["ppid"]  # the agent's child, as an exec'd spare is
            assert warm["sid"] == warm["pid"] and warm["nice"] == agent_nice
            assert str(warm["pid"]) not in {p.name for p in nice.iterdir()}  # it imported nothing itself
        assert probes[2]["np"] != probes[3]["np"]  # two forks of one template draw differently
    assert _probe(out, 0, 0)["np"] != _probe(out, 1, 0)["np"]  # so do two local ranks' forks
    assert _probe(out, 0, 3)["np"] != _probe(out, 1, 3)["np"]


def test_forked_spares_and_templates_die_with_the_agent(tmp_path):
    nice = tmp_path / "nice"
    nice.mkdir()
    env = {**launcher_env(), "WARM_NICE_OUT": str(nice), "PROBE_FAILS": "2",
           "PROBE_SLEEP": "1"}
    agent = start("elaunch", *WARM[:-3], "--max-restarts=4", "--warm-start",
                  "--warm-start-modules=json,warm_nice_probe", str(SCRIPTS / "warm_probe.py"), str(tmp_path), env=env)
    try:
        wait_for(lambda: all((tmp_path / f"probe_{r}_2.json").exists() for r in (0, 1)), 60,
                 what="the third attempt running")

        workers = {_probe(tmp_path, rank, 2)["pid"] for rank in (0, 1)}  # forked too, but running

        def forked_spares():
            kids = _warm_pids(agent.pid) - {int(p.name) for p in nice.iterdir()} - workers
            forked = {k for k in kids if "--template" in psutil.Process(k).cmdline()}
            return forked if len(forked) == 2 else None

        spares = wait_for(forked_spares, 30, what="the fourth attempt's forked spares")
        everyone = {p.pid for p in psutil.Process(agent.pid).children(recursive=True)}
        assert spares < everyone
        agent.send_signal(signal.SIGKILL)
        wait_for(lambda: not any(alive(p) for p in everyone), 15, what="spares, templates and workers gone")
        agent.wait(15)
    finally:
        kill_tree(agent.pid)
        agent.communicate()


def test_a_template_with_a_thread_running_does_not_fork_and_spares_start_as_interpreters(tmp_path):
    nice = tmp_path / "nice"
    nice.mkdir()
    env = {**launcher_env(), "PROBE_FAILS": "3", "WARM_NICE_OUT": str(nice)}
    r = run("elaunch", *WARM[:-3], "--max-restarts=3", "--warm-start",
            "--warm-start-modules=json,warm_thread_probe,warm_nice_probe",
            str(SCRIPTS / "warm_probe.py"), str(tmp_path), cwd=tmp_path, env=env)
    assert r.returncode == 0, r.stderr
    assert "cannot fork spares" in r.stderr
    for rank in (0, 1):
        probes = [_probe(tmp_path, rank, attempt) for attempt in range(4)]
        assert not any(_forked(p) for p in probes), [p["cmdline"] for p in probes]
        # the first attempt, which found it out, started cold; the later ones in spares started as interpreters
        spares = [any(a.endswith("_warm_child.py") for a in p["cmdline"]) for p in probes]
        assert spares == [False, True, True, True], [p["cmdline"] for p in probes]


def test_a_spare_handed_a_worker_before_its_attempt_keeps_its_log_files_and_is_not_compared_on_the_mark(tmp_path):
    """``WorkerLauncher.prestart`` (in-process restart's replacement of a dead worker, as soon as the death is
    seen): the next attempt's spare of the rank is handed the running attempt's worker plus a mark that is not
    part of the comparison with the spare's environment, and runs it at once. When that attempt's logs are then
    asked for (the agent does at its start), they are the spare's, whose files the worker writes: before, with
    every spare handed over, the attempt's directory was made anew and the worker's output was lost."""
    from elaunch.procs import LogsSpec, Std, WorkerLauncher
    from elaunch.procs.spawn import is_subreaper, stop_being_subreaper

    script = tmp_path / "says.py"
    script.write_text("import os\nprint('mark', os.environ.get('MARK'), 'restart', os.environ['RESTART'], flush=True)\n")
    launcher = WorkerLauncher(LogsSpec(log_dir=str(tmp_path / "logs"), redirects=Std.ALL), "pre",
                              warm_modules=("json",))
    subreaper = is_subreaper()
    launcher.open()
    try:
        cmds = {0: [os.path.realpath(sys.executable), "-u", str(script)]}
        envs = {0: {**launcher_env(), "RESTART": "0"}}
        procs = launcher.start(0, launcher.attempt_logs(0, 1), cmds, envs, {}, another_may_follow=True)
        wait_for(lambda: procs.poll()[0] is not None, 30, what="attempt 0's worker")
        procs.close()
        assert launcher.prestart(0, cmds[0], {**envs[0], "RESTART": "9"}, {"MARK": "early"}) is None  # changed env
        launcher.pool.prepare(1, launcher.attempt_logs(1, 1), cmds, envs)
        wait_for(lambda: launcher.pool.ready(0), 30, what="attempt 1's spare")
        proc = launcher.prestart(0, cmds[0], envs[0], {"MARK": "early"})
        assert proc is not None
        assert proc.wait(30) == 0
        logs = launcher.attempt_logs(1, 1)
        assert open(logs.stdout[0]).read() == "mark early restart 0\n"
    finally:
        launcher.close()
        if not subreaper:
            stop_being_subreaper()


def _children() -> list[tuple[int, list[str]]]:
    """This process's children's ``(pid, argv)``, but those gone or zombies (an orphan this test process, a
    subreaper at times, adopted)."""
    out = []
    for child in psutil.Process().children():
        try:
            out.append((child.pid, child.cmdline()))
        except psutil.Error:
            pass
    return out


def _autogroup(pid: int | str = "self") -> str:
    with open(f"/proc/{pid}/autogroup") as f:
        return f.read().split()[-1]  # "/autogroup-<id> nice <n>"


@pytest.mark.skipif(not os.path.exists("/proc/self/autogroup"), reason="this kernel has no autogroups")
def test_an_importing_template_or_spare_lowers_its_autogroup_then_raises_it_before_a_worker_runs(tmp_path):
    """A thread's nice value ranks it only among its autogroup's threads (one autogroup per session, each with an
    equal share of the CPU), so a template or spare that imports at nice 19 beside a group lowers its session's
    autogroup too (measured: 4 templates took half of 2 cores from the group beside them). It raises it back once
    the imports end: a template that forks spares, and the worker a spare becomes, run at 0."""
    from elaunch.procs import LogsSpec, Std, WorkerLauncher
    from elaunch.procs.spawn import is_subreaper, stop_being_subreaper

    nice = tmp_path / "nice"
    nice.mkdir()
    script = tmp_path / "group.py"
    script.write_text("print(open('/proc/self/autogroup').read().split()[-1], flush=True)\n")
    launcher = WorkerLauncher(LogsSpec(log_dir=str(tmp_path / "logs"), redirects=Std.ALL), "ag",
                              warm_modules=("json", "warm_nice_probe"))
    subreaper = is_subreaper()
    launcher.open()
    pool = None
    try:
        cmds = {0: [os.path.realpath(sys.executable), "-u", str(script)]}
        path = os.pathsep.join(filter(None, [str(SCRIPTS), os.environ.get("PYTHONPATH")]))  # warm_nice_probe
        envs = {0: {**launcher_env(), "WARM_NICE_OUT": str(nice), "PYTHONPATH": path}}
        procs = launcher.start(0, launcher.attempt_logs(0, 1), cmds, envs, {}, another_may_follow=True)
        wait_for(lambda: procs.poll()[0] is not None, 30, what="attempt 0's worker")
        procs.close()
        wait_for(lambda: launcher.pool.ready(0), 60, what="the spare forked by attempt 1's template")
        forked = [p for p in _children() if "--template" in p[1]]  # the template, its fork
        templates = [pid for pid, _cmd in forked if (nice / str(pid)).exists()]  # the one that imported
        assert len(templates) == 1, forked
        assert (nice / str(templates[0])).read_text() == "19 19"  # it imported lowered
        assert _autogroup(templates[0]) == "0"  # and raised it back before it forked
        proc = launcher.pool.handoff(0, cmds[0], envs[0])
        assert proc is not None and proc.wait(30) == 0
        assert open(launcher.attempt_logs(1, 1).stdout[0]).read() == "0\n"  # a forked spare's new session: 0

        # a spare started as an interpreter beside a group (no template: no reaper) imports lowered too
        pool = warm.WarmPool(("json", "warm_nice_probe"))
        logs = launcher.attempt_logs(2, 1)
        assert pool.prepare(2, logs, cmds, envs) == 1
        spare = pool.pids()[0]
        imported = wait_for(lambda: (nice / str(spare)).exists() and (nice / str(spare)).read_text(), 60,
                            what="the spare's import")  # the probe opens the file, then writes it
        assert imported == "19 19"
        proc = pool.handoff(0, cmds[0], envs[0])
        assert proc is not None and proc.pid == spare and proc.wait(30) == 0
        assert open(logs.stdout[0]).read() == "0\n"  # the worker it became runs raised back
    finally:
        if pool is not None:
            pool.close()
        launcher.close()
        if not subreaper:
            stop_being_subreaper()
