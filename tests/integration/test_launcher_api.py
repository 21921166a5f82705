"""elaunch.launcher beside torch.distributed.launcher.api: the same calls, the same outcomes.

Each side-by-side case calls ``elastic_launch(config, entrypoint)(*args)`` of both
modules in this process (one node, two workers, c10d rendezvous on 127.0.0.1) and
compares what they returned or raised. The orphan cases run elaunch only: torch
leaves a failed worker's children behind.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import pickle
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import psutil
import pytest

from tests.conftest import track_processes, wait_for
from tests.helpers import free_port
from tests.integration import launcher_fns

pytest.importorskip("torch")

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
TORCH, ELAUNCH = "torch.distributed.launcher.api", "elaunch.launcher.api"
BOTH = [TORCH, ELAUNCH]


@pytest.fixture(scope="module", autouse=True)
def multiprocessing_helpers():
    """torch's spawn and forkserver workers start multiprocessing's resource tracker and fork
    server, which live as long as this process: start them before the leftover check looks."""
    import multiprocessing.forkserver
    import multiprocessing.resource_tracker

    multiprocessing.resource_tracker.ensure_running()
    multiprocessing.forkserver.ensure_running()


@pytest.fixture(autouse=True)
def restored_environ():
    """Both launchers set TORCHELASTIC_SIGNALS_TO_HANDLE in os.environ: undo it after each test."""
    saved = dict(os.environ)
    for key in launcher_fns.WORKER_VARS:
        os.environ.pop(key, None)
    yield
    os.environ.clear()
    os.environ.update(saved)


def launch(module: str, entrypoint, *args, start_method: str = "fork", max_restarts: int = 0,
           rdzv_backend: str = "c10d", **kw):
    """``elastic_launch`` of ``module`` on one node with two workers; return its result."""
    api = importlib.import_module(module)
    config = api.LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=2, run_id="launcher-api-test",
                              rdzv_backend=rdzv_backend, rdzv_endpoint=f"127.0.0.1:{free_port()}",
                              start_method=start_method, max_restarts=max_restarts, monitor_interval=0.1, **kw)
    return api.elastic_launch(config, entrypoint)(*args)


def failure_outcome(module: str, entrypoint, *args, start_method: str = "fork") -> dict:
    """What ``ChildFailedError`` says about the root cause, in a comparable shape."""
    with pytest.raises(ChildFailedError) as info:
        launch(module, entrypoint, *args, start_method=start_method)
    exc = info.value
    rank, first = exc.get_first_failure()
    message = first.message if isinstance(first.message, str) else first.message.get("message")
    callstack = first.error_file_data["message"]["extraInfo"]["py_callstack"]
    return {"name": exc.name, "rank": rank, "exitcode": first.exitcode, "message": message,
            "traceback_names_fn": f"in {entrypoint.__name__}" in callstack,
            "error_file": os.path.isfile(first.error_file), "in_format_msg": message in exc.format_msg()}


def _fields(cls) -> dict:
    return {f.name: (f.default if f.default is not dataclasses.MISSING else
                     f.default_factory() if f.default_factory is not dataclasses.MISSING else "required")
            for f in dataclasses.fields(cls)}


def test_launch_config_has_torchs_fields_defaults_and_post_init(monkeypatch):
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs

    apis = {module: importlib.import_module(module) for module in BOTH}
    assert _fields(apis[ELAUNCH].LaunchConfig) == _fields(apis[TORCH].LaunchConfig)
    for module, api in apis.items():
        config = api.LaunchConfig(1, 2, 3)
        assert config.rdzv_configs == {"timeout": 900} and config.shutdown_timeout == 30, module
        assert isinstance(config.logs_specs, DefaultLogsSpecs) and config.numa_options is None, module
        assert api.LaunchConfig(1, 1, 1, rdzv_timeout=5, rdzv_configs={"timeout": 7}).rdzv_configs == {"timeout": 5}
        assert api.LaunchConfig(1, 1, 1, rdzv_configs={"timeout": 7}).rdzv_configs == {"timeout": 7}
        with pytest.raises(ValueError, match="shutdown_timeout must be non-negative, got -1"):
            api.LaunchConfig(1, 1, 1, shutdown_timeout=-1)
        monkeypatch.setenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "12")
        assert api.LaunchConfig(1, 1, 1).shutdown_timeout == 12
        monkeypatch.delenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT")


@pytest.mark.parametrize("bad", [
    {"min_nodes": 2, "max_nodes": 1},
    {"rdzv_backend": "no-such-backend"},
    {"rdzv_backend": "static"},  # without rdzv_configs["rank"]
], ids=["min>max", "unknown-backend", "static-without-rank"])
def test_a_bad_configuration_raises_value_error(bad):
    for module in BOTH:
        api = importlib.import_module(module)
        fields = {"min_nodes": 1, "max_nodes": 1, "nproc_per_node": 1, "rdzv_backend": "c10d",
                  "rdzv_endpoint": f"127.0.0.1:{free_port()}", "start_method": "fork", **bad}
        with pytest.raises(ValueError):
            api.elastic_launch(api.LaunchConfig(**fields), launcher_fns.worker_env)()


def test_fork_runs_a_function_that_cannot_be_pickled():
    offset = 7
    fn = lambda x: (int(os.environ["RANK"]) + offset) * x  # noqa: E731 - a lambda closure: not picklable
    with pytest.raises((pickle.PicklingError, AttributeError)):
        pickle.dumps(fn)
    results = {module: launch(module, fn, 3) for module in BOTH}
    assert results[TORCH] == {0: 21, 1: 24}
    assert results[ELAUNCH] == results[TORCH]


@pytest.mark.parametrize("start_method", ["spawn", "forkserver"])
def test_spawned_workers_unpickle_the_function_and_return_its_values(start_method):
    results = {module: launch(module, launcher_fns.rank_scaled, 5, "x", start_method=start_method)
               for module in BOTH}
    assert results[TORCH] == {0: (0, "x", 0), 1: (5, "x", 1)}
    assert results[ELAUNCH] == results[TORCH]


def test_spawn_refuses_a_function_that_cannot_be_pickled():
    fn = lambda: 1  # noqa: E731
    errors = {}
    for module in BOTH:
        with pytest.raises((pickle.PicklingError, AttributeError)) as info:
            launch(module, fn, start_method="spawn")
        errors[module] = type(info.value)
    assert errors[ELAUNCH] is errors[TORCH]


def test_program_entrypoint_runs_its_argv_and_returns_none_per_rank(tmp_path):
    results = {}
    for module in BOTH:
        out = tmp_path / module
        out.mkdir()
        code = "import sys; open(sys.argv[1], 'w').write(sys.argv[2])"
        results[module] = launch(module, sys.executable, "-c", code, str(out / "rank_${local_rank}"), module)
        assert sorted(p.name for p in out.iterdir()) == ["rank_0", "rank_1"]  # the ${local_rank} macro
        assert (out / "rank_1").read_text() == module
    assert results[TORCH] == {0: None, 1: None}
    assert results[ELAUNCH] == results[TORCH]


# torch's side runs forked workers only where the start method cannot change the outcome:
# its spawned workers each import torch, about 5 s on this machine.


@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_a_raising_function_gives_child_failed_error_with_its_traceback(start_method):
    theirs = failure_outcome(TORCH, launcher_fns.fail_on_rank, 1, "bad value 42")
    ours = failure_outcome(ELAUNCH, launcher_fns.fail_on_rank, 1, "bad value 42", start_method=start_method)
    assert theirs == {"name": "fail_on_rank", "rank": 1, "exitcode": 1, "message": "ValueError: bad value 42",
                      "traceback_names_fn": True, "error_file": True, "in_format_msg": True}
    assert ours == theirs


# torch's side of the restart case runs in a fresh interpreter: inside this process, after
# earlier failed forked launches, torch.multiprocessing at times reads a failed worker's
# still-empty error file and raises EOFError from torch's own launch_agent.
RESTART_DRIVER = textwrap.dedent("""
    import json
    from tests.integration import launcher_fns
    from tests.integration.test_launcher_api import TORCH, launch
    print("RESULT", json.dumps(launch(TORCH, launcher_fns.fail_first_attempt, max_restarts=1)))
""")


def test_a_function_failing_once_is_restarted_and_its_values_returned():
    proc = subprocess.run([sys.executable, "-c", RESTART_DRIVER], cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")][-1]
    results = {TORCH: {int(k): v for k, v in json.loads(line[len("RESULT "):]).items()},
               ELAUNCH: launch(ELAUNCH, launcher_fns.fail_first_attempt, max_restarts=1)}
    assert results[TORCH] == {0: 1, 1: 1}  # TORCHELASTIC_RESTART_COUNT of the second attempt
    assert results[ELAUNCH] == results[TORCH]


def test_a_handled_signal_stops_function_workers_and_raises_signal_exception():
    """elaunch only: torch's forked workers inherit its agent's SIGTERM handler and, run
    inside pytest, linger for minutes after it (torch raises the same SignalException)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException

    with pytest.raises(SignalException) as info:
        launch(ELAUNCH, launcher_fns.term_the_agent)
    assert info.value.sigval == signal.SIGTERM  # and the leftover check finds no worker


def test_function_workers_see_torchruns_environment():
    envs = {module: launch(module, launcher_fns.worker_env) for module in BOTH}
    theirs, ours = envs[TORCH], envs[ELAUNCH]
    assert sorted(ours) == sorted(theirs) == [0, 1]
    for rank in (0, 1):
        # deliberate differences (docs/migrating-from-torchrun.md): each elaunch round hosts a
        # new workers' store (its own port, TORCHELASTIC_USE_AGENT_STORE=False); error files
        # live in each launcher's own log directory
        for key in ("MASTER_PORT", "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_ERROR_FILE"):
            assert theirs[rank].pop(key) and ours[rank].pop(key), key
        assert ours[rank] == theirs[rank]
    assert theirs[1]["RANK"] == "1" and theirs[1]["LOCAL_RANK"] == "1" and theirs[1]["WORLD_SIZE"] == "2"


@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_function_output_goes_to_the_log_files(tmp_path, start_method):
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std

    layouts = {}
    for module, method in ((TORCH, "fork"), (ELAUNCH, start_method)):
        logs = DefaultLogsSpecs(log_dir=str(tmp_path / module), redirects=Std.ALL)
        launch(module, launcher_fns.print_rank, logs_specs=logs, start_method=method)
        found = {}
        for path in (tmp_path / module).glob("*/attempt_0/*/std*.log"):
            found[f"{path.parent.name}/{path.name}"] = path.read_text().strip()
        layouts[module] = found
    assert layouts[TORCH]["1/stdout.log"] == "stdout of rank 1"
    assert layouts[TORCH]["0/stderr.log"] == "stderr of rank 0"
    assert layouts[ELAUNCH] == layouts[TORCH]


# A script whose function and return value's class live in __main__: spawned workers
# re-import it as __mp_main__ (hence the guard), as multiprocessing's spawn does.
MAIN_SCRIPT = textwrap.dedent("""
    import os
    from elaunch.launcher import LaunchConfig, elastic_launch

    class Answer:
        def __init__(self, rank):
            self.rank = rank

    def answer(base):
        return Answer(base + int(os.environ["RANK"]))

    if __name__ == "__main__":
        config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=2, rdzv_backend="c10d",
                              rdzv_endpoint="127.0.0.1:0", start_method="spawn", max_restarts=0)
        out = elastic_launch(config, answer)(40)
        print("RESULT", {rank: (type(a).__name__, a.rank) for rank, a in out.items()})
""")


def test_spawn_runs_a_function_of_the_callers_main_script(tmp_path):
    script = tmp_path / "main_script.py"
    script.write_text(MAIN_SCRIPT)
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=dict(os.environ, PYTHONPATH=str(REPO)),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "RESULT {0: ('Answer', 40), 1: ('Answer', 41)}" in proc.stdout


def _pids(pid_dir: Path) -> list[int]:
    return [int(pid) for path in pid_dir.glob("*.pids") for pid in path.read_text().split()]


def _gone(pids: list[int]) -> bool:
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                return False
        except psutil.NoSuchProcess:
            pass
    return True


@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_no_worker_or_worker_child_outlives_a_failure(tmp_path, start_method):
    with pytest.raises(ChildFailedError):
        launch(ELAUNCH, launcher_fns.child_then_fail, str(tmp_path), start_method=start_method)
    pids = _pids(tmp_path)
    assert len(pids) == 4  # two workers and their children
    track_processes(pids)
    assert _gone(pids), [p for p in pids if not _gone([p])]


# Runs elastic_launch with forked workers that each fork a child that does not exec.
KILLED_DRIVER = textwrap.dedent("""
    import sys
    from elaunch.launcher import LaunchConfig, elastic_launch
    from tests.integration import launcher_fns

    pid_dir, kill_agent = sys.argv[1], sys.argv[2:] == ["kill-agent"]
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=2, rdzv_backend="c10d",
                          rdzv_endpoint="127.0.0.1:0", start_method="fork", max_restarts=0)
    elastic_launch(config, lambda: launcher_fns.fork_child_then_wait(pid_dir, kill_agent))()
""")


def test_forked_workers_and_their_children_die_with_a_killed_agent(tmp_path):
    """The worker's forked child holds every descriptor the worker has: had the worker kept
    the reaper's pipe, the reaper would never see the agent die and the child would live on."""
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    env = dict(os.environ, PYTHONPATH=str(REPO))
    agent = subprocess.Popen([sys.executable, "-c", KILLED_DRIVER, str(pid_dir)], cwd=REPO, env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: (pid_dir / "1.pids").exists(), 60, what="rank 1's pid file")
        pids = [int(p) for p in (pid_dir / "1.pids").read_text().split()]
        track_processes(pids)
        agent.send_signal(signal.SIGKILL)
        agent.wait(30)
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait()
    # the worker dies of PR_SET_PDEATHSIG, its child by the reaper
    wait_for(lambda: _gone(pids), 20, what=f"worker {pids[0]} and its child {pids[1]} to die")


def test_workers_killing_their_agent_at_once_leave_no_child(tmp_path):
    """Each worker forks a child and ``kill -9``s the agent the moment it runs, while the
    agent may still be starting the other worker: the watchdog must know a worker before
    it runs (the gap a loaded CI machine once hit with the agent killed from outside)."""
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    env = dict(os.environ, PYTHONPATH=str(REPO))
    agent = subprocess.Popen([sys.executable, "-c", KILLED_DRIVER, str(pid_dir), "kill-agent"],
                             cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        assert agent.wait(60) == -signal.SIGKILL
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait()
    pids = [int(p) for f in sorted(pid_dir.glob("*.pids")) for p in f.read_text().split()]
    assert pids, "no worker ran before the agent died"
    track_processes(pids)
    wait_for(lambda: _gone(pids), 20, what=f"workers and their children {pids} to die")


def test_the_caller_adopts_no_orphan_after_the_launch_returns(tmp_path):
    """The agent makes its process a child subreaper while workers run (their orphans come to it);
    under the Python API that process is the caller's, and the flag stayed set after the launch:
    every orphan of the caller's later children became its zombie. After ``elastic_launch``
    returns, the flag is as it was, and an orphan goes to init again."""
    script = tmp_path / "caller.py"
    script.write_text(textwrap.dedent(f"""
        import ctypes, os, subprocess, sys, time
        sys.path.insert(0, {str(REPO)!r})
        from elaunch.launcher.api import LaunchConfig, elastic_launch
        prctl = ctypes.CDLL(None).prctl
        def subreaper():
            v = ctypes.c_int(-1)
            prctl(37, ctypes.byref(v), 0, 0, 0)  # PR_GET_CHILD_SUBREAPER
            return v.value
        before = subreaper()
        config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=2, run_id="subreaper",
                              rdzv_backend="c10d", rdzv_endpoint="127.0.0.1:{free_port()}", monitor_interval=0.1)
        elastic_launch(config, sys.executable)("-c", "pass")
        after = subreaper()
        # a child that starts a grandchild and exits at once: whose child is the orphan then?
        child = subprocess.Popen([sys.executable, "-c", "import subprocess, sys; print(subprocess.Popen("
                                  "[sys.executable, '-c', 'import time; time.sleep(30)']).pid)"],
                                 stdout=subprocess.PIPE, text=True)
        orphan = int(child.stdout.readline())  # (not read(): the orphan holds the pipe open for its 30 s)
        child.wait()
        import psutil
        deadline = time.monotonic() + 30
        while psutil.Process(orphan).ppid() == child.pid and time.monotonic() < deadline:
            time.sleep(0.01)
        adopted = psutil.Process(orphan).ppid() == os.getpid()
        psutil.Process(orphan).kill()
        print(before, after, adopted)
    """))
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    before, after, adopted = r.stdout.split()[-3:]
    assert (before, after, adopted) == ("0", "0", "False"), r.stdout


def test_a_launch_from_a_thread_other_than_the_main_one_runs_as_torchs():
    """Python sets signal handlers from the main thread only: torch's agent then installs none, and a launch
    from a notebook's, a server's or a test harness's thread runs (elaunch raised "signal only works in main
    thread" before)."""
    import threading

    results = {}
    for module in BOTH:
        def go(module=module):
            try:
                results[module] = launch(module, launcher_fns.rank_scaled, 3, "t")
            except BaseException as exc:  # noqa: BLE001 - reported below
                results[module] = f"{type(exc).__name__}: {exc}"

        thread = threading.Thread(target=go, name=f"launch-{module}")
        thread.start()
        thread.join(120)
        assert not thread.is_alive()
    assert results[TORCH] == {0: (0, "t", 0), 1: (3, "t", 1)}
    assert results[ELAUNCH] == results[TORCH]


def test_a_programs_arguments_are_made_strings_as_torchs(tmp_path):
    """torch's SubprocessHandler runs ``[entrypoint, *map(str, args)]``: ``elastic_launch(config, python)
    ("train.py", "--epochs", 10)`` works (elaunch raised TypeError for the 10 before)."""
    for module in BOTH:
        out = tmp_path / module
        code = "import sys; open(sys.argv[1] + '_${local_rank}', 'w').write(' '.join(sys.argv[2:]))"
        assert launch(module, sys.executable, "-c", code, out, 10, 2.5, None) == {0: None, 1: None}
    assert (tmp_path / f"{ELAUNCH}_1").read_text() == (tmp_path / f"{TORCH}_1").read_text() == "10 2.5 None"


def test_config_from_args_hands_its_config_to_elastic_launch_as_torchs_run_does(tmp_path):
    """torch's ``run(args)`` is ``config, cmd, cmd_args = config_from_args(args); elastic_launch(config,
    cmd)(*cmd_args)``: a program that does the same with elaunch's modules runs its job (the config,
    elaunch's own frozen LaunchConfig, failed in elastic_launch before: TypeError)."""
    script = tmp_path / "script.py"
    script.write_text("import os, sys\nopen(sys.argv[1] + '_' + os.environ['RANK'], 'w').write(sys.argv[2])\n")
    results = {}
    for run_module, api_module in (("torch.distributed.run", TORCH), ("elaunch.run", ELAUNCH)):
        run, api = importlib.import_module(run_module), importlib.import_module(api_module)
        args = run.parse_args(["--nnodes=1", "--nproc-per-node=2", "--rdzv-backend=c10d",
                               f"--rdzv-endpoint=127.0.0.1:{free_port()}", "--max-restarts=0", "--monitor-interval=0.1",
                               str(script), str(tmp_path / run_module), run_module])
        config, cmd, cmd_args = run.config_from_args(args)
        results[run_module] = api.elastic_launch(config, cmd)(*cmd_args)
        assert (tmp_path / f"{run_module}_1").read_text() == run_module
    assert results["elaunch.run"] == results["torch.distributed.run"] == {0: None, 1: None}


def test_the_raised_child_failed_error_is_elaunchs_and_torchs_class_and_pickles(tmp_path, monkeypatch):
    """``except elaunch.errors.ChildFailedError`` catches what elaunch raises (it missed it: a separate class
    with the same name), so does torch's class; the exception pickles and copies (a new local class was made
    at each raise, which nothing could find), and elaunch's ``@record`` around a launch copies the root cause's
    error file into its own, as torch's ``@record`` does (it recorded the ChildFailedError's traceback)."""
    import copy

    import elaunch.errors

    outer = tmp_path / "outer.json"

    @elaunch.errors.record
    def nested():
        launch(ELAUNCH, launcher_fns.fail_on_rank, 1, "bad value 42")

    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(outer))
    with pytest.raises(elaunch.errors.ChildFailedError) as info:
        nested()
    exc = info.value
    assert isinstance(exc, ChildFailedError)
    assert json.loads(outer.read_text())["message"]["message"] == "ValueError: bad value 42"
    for again in (pickle.loads(pickle.dumps(exc)), copy.copy(exc)):
        assert type(again) is type(exc) and str(again) == str(exc)
        assert again.get_first_failure()[0] == 1 and again.name == "fail_on_rank"


def test_a_backend_a_program_registered_in_torchs_registry_runs_as_under_torch():
    """``rendezvous_handler_registry.register(name, creator)`` (torch's docs show it) and then
    ``LaunchConfig(rdzv_backend=name)``: torch's launcher uses the creator, and elaunch's now too
    (it said "unknown rendezvous backend" before). The creator: torch's c10d handler under that name."""
    pytest.importorskip("elaunch_test_plugin")
    from elaunch_test_plugin.rdzv import Renamed, _c10d
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry

    name = "launcher-api-test-c10d"
    rendezvous_handler_registry.register(name, lambda p: Renamed(_c10d(p), name))
    try:
        results = {module: launch(module, launcher_fns.rank_scaled, 5, "r", rdzv_backend=name) for module in BOTH}
    finally:
        rendezvous_handler_registry._registry.pop(name)  # torch's registry is this process's: leave it as it was
    from elaunch.rendezvous import registry

    assert name not in registry.backend_names()  # looked up in torch's registry each time, not kept in elaunch's
    assert results[TORCH] == {0: (0, "r", 0), 1: (5, "r", 1)}
    assert results[ELAUNCH] == results[TORCH]
