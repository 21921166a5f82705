"""The launcher end to end on one node: real agent, real workers, real signals."""

from __future__ import annotations

import json
import re
import signal

import pytest

from tests.conftest import wait_for
from tests.helpers import ELAUNCH_ADDED_ENV, SCRIPTS, alive, kill_tree, load_envs, read_pids, run, start

NPROC2 = ("--standalone", "--nproc-per-node=2")


def test_standalone_gives_each_worker_its_ranks(tmp_path):
    r = run("elaunch", *NPROC2, str(SCRIPTS / "env_dump.py"), str(tmp_path), "--flag", "x y")
    assert r.returncode == 0, r.stderr
    envs = load_envs(tmp_path)
    assert sorted(envs) == ["env_0_0", "env_1_0"]
    for rank in (0, 1):
        env = envs[f"env_{rank}_0"]
        assert env["RANK"] == env["LOCAL_RANK"] == str(rank)
        assert env["WORLD_SIZE"] == env["LOCAL_WORLD_SIZE"] == env["ROLE_WORLD_SIZE"] == "2"
        assert env["GROUP_RANK"] == "0" and env["GROUP_WORLD_SIZE"] == "1"
        assert env["MASTER_ADDR"] == "127.0.0.1" and 0 < int(env["MASTER_PORT"]) < 65536
        assert env["OMP_NUM_THREADS"] == "1"
        assert env["TORCHELASTIC_RESTART_COUNT"] == "0"
        assert env["TORCHELASTIC_ERROR_FILE"].endswith("error.json")
    assert envs["env_0_0"]["TORCHELASTIC_RUN_ID"] == envs["env_1_0"]["TORCHELASTIC_RUN_ID"]
    argv = json.loads((tmp_path / "env_0_0.json").read_text())["argv"]
    assert argv[1:] == [str(tmp_path), "--flag", "x y"]


#: Variables whose values legitimately differ between two launches or launchers.
PER_LAUNCH = {"MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_ERROR_FILE"}
#: Deliberate, documented differences (docs/migrating-from-torchrun.md): the
#: standalone agent hosts the workers' store on loopback, torchrun's on the FQDN.
DOCUMENTED = {"MASTER_ADDR"}


@pytest.mark.slow
def test_worker_env_matches_torchrun(tmp_path):
    results = {}
    for which in ("torchrun", "elaunch"):
        out = tmp_path / which
        out.mkdir()
        r = run(which, *NPROC2, "--max-restarts=2", str(SCRIPTS / "env_dump.py"), str(out))
        assert r.returncode == 0, r.stderr
        results[which] = load_envs(out)
    assert sorted(results["elaunch"]) == sorted(results["torchrun"])
    for name, theirs in results["torchrun"].items():
        ours = results["elaunch"][name]
        extra, missing = set(ours) - ELAUNCH_ADDED_ENV - set(theirs), set(theirs) - set(ours)
        assert not extra and not missing, f"{name}: extra {extra}, missing {missing}"
        differ = {k for k in theirs if ours[k] != theirs[k]}
        assert differ <= PER_LAUNCH | DOCUMENTED, {k: (ours[k], theirs[k]) for k in differ}


@pytest.mark.slow
@pytest.mark.parametrize("attempt", range(3))
def test_restart_after_gloo_worker_crash_recovers(tmp_path, attempt):
    # torchrun 2.13 fails this most of the time: the restarted workers read the dead
    # workers' addresses from a reused store ("Gloo connectFullMesh failed").
    r = run("elaunch", *NPROC2, "--max-restarts=1", "--shutdown-timeout=5",
            str(SCRIPTS / "gloo_crash.py"), "1", str(tmp_path), timeout=180)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "done_1").read_text() == "3"
    assert not (tmp_path / "done_0").exists()


def test_failed_rank_restarts_group_until_budget_exhausted(tmp_path):
    schedule = json.dumps({"0:1": 3, "1:1": 3, "2:1": 3})
    r = run("elaunch", *NPROC2, "--max-restarts=1", str(SCRIPTS / "exit_schedule.py"), schedule, str(tmp_path))
    assert r.returncode == 1
    starts = set((tmp_path / "starts.log").read_text().split("\n")[:-1])
    # one restart; rank 0 may be stopped before it logs, the failing rank always logs
    assert {"0 1", "1 1"} <= starts <= {"0 0", "0 1", "1 0", "1 1"}
    summary = r.stderr[r.stderr.index("exit_schedule.py FAILED"):]
    assert re.search(r"rank\s*:\s*1 \(local_rank: 1\)", summary), summary
    assert re.search(r"exitcode\s*:\s*3 ", summary), summary
    # no error file: the summary shows the last lines of the worker's stderr instead
    assert "rank 1 exiting with 3 on purpose" in summary
    assert "Traceback" not in r.stderr


def test_restart_recovers_when_failure_is_transient(tmp_path):
    schedule = json.dumps({"0:0": 5})
    r = run("elaunch", *NPROC2, "--max-restarts=3", str(SCRIPTS / "exit_schedule.py"), schedule, str(tmp_path))
    assert r.returncode == 0, r.stderr
    starts = set((tmp_path / "starts.log").read_text().split("\n")[:-1])
    # rank 1 of attempt 0 may be stopped before it logs; attempt 1 runs both to the end
    assert {"0 0", "1 0", "1 1"} <= starts <= {"0 0", "0 1", "1 0", "1 1"}


def test_worker_killed_by_signal_is_reported_by_name(tmp_path):
    schedule = json.dumps({"0:0": -int(signal.SIGKILL)})
    r = run("elaunch", *NPROC2, str(SCRIPTS / "exit_schedule.py"), schedule)
    assert r.returncode == 1
    assert "SIGKILL" in r.stderr


def _start_sleepers(tmp_path, nproc=2):
    agent = start("elaunch", "--standalone", f"--nproc-per-node={nproc}", str(SCRIPTS / "sleeper.py"), str(tmp_path))
    files = [tmp_path / f"pids_{r}" for r in range(nproc)]
    try:
        wait_for(lambda: all(f.exists() for f in files), 60, what="workers to start")
    except AssertionError:
        kill_tree(agent.pid)
        raise
    return agent, [pid for f in files for pid in read_pids(f)]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_signal_to_agent_is_forwarded_and_exit_status_conventional(tmp_path, sig):
    agent, pids = _start_sleepers(tmp_path)
    agent.send_signal(sig)
    _, err = agent.communicate(timeout=60)
    assert agent.returncode == 128 + sig, err
    wait_for(lambda: not any(alive(p) for p in pids), 30, what="workers to exit")
    if sig == signal.SIGTERM:
        assert (tmp_path / "term_0").exists() and (tmp_path / "term_1").exists()


def test_worker_ignoring_sigterm_is_killed_after_shutdown_timeout(tmp_path):
    agent = start("elaunch", "--standalone", "--nproc-per-node=1", "--shutdown-timeout=1",
                  str(SCRIPTS / "sleeper.py"), str(tmp_path), "--ignore-term")
    wait_for(lambda: (tmp_path / "pids_0").exists(), 60, what="worker to start")
    pids = read_pids(tmp_path / "pids_0")
    agent.send_signal(signal.SIGTERM)
    agent.communicate(timeout=60)
    assert agent.returncode == 128 + signal.SIGTERM
    wait_for(lambda: not any(alive(p) for p in pids), 30, what="worker to be killed")


def test_no_worker_outlives_agent_killed_with_sigkill(tmp_path):
    agent = start("elaunch", "--standalone", "--nproc-per-node=2",
                  str(SCRIPTS / "sleeper.py"), str(tmp_path), "--grandchild")
    files = [tmp_path / "pids_0", tmp_path / "pids_1"]
    wait_for(lambda: all(f.exists() for f in files), 60, what="workers to start")
    pids = [pid for f in files for pid in read_pids(f)]
    assert len(pids) == 4 and all(alive(p) for p in pids)
    agent.kill()
    agent.communicate(timeout=30)
    wait_for(lambda: not any(alive(p) for p in pids), 30, what="workers and grandchildren to die")


@pytest.mark.parametrize(
    "flags, target",
    [
        (["-m"], "tests.scripts.env_dump"),
        (["--run-path"], str(SCRIPTS / "env_dump.py")),
    ],
)
def test_module_and_run_path_entrypoints(tmp_path, flags, target):
    from tests.conftest import REPO

    r = run("elaunch", *NPROC2, *flags, target, str(tmp_path), cwd=REPO)
    assert r.returncode == 0, r.stderr
    envs = load_envs(tmp_path)
    assert sorted(envs) == ["env_0_0", "env_1_0"]
    assert json.loads((tmp_path / "env_1_0.json").read_text())["argv"][1:] == [str(tmp_path)]


def test_no_python_runs_any_executable(tmp_path):
    r = run("elaunch", *NPROC2, "--no-python", "sh", "-c", 'echo "$RANK/$WORLD_SIZE" > "$0/rank_$RANK"', str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert sorted(p.read_text() for p in tmp_path.glob("rank_*")) == ["0/2\n", "1/2\n"]


@pytest.mark.slow
def test_two_static_nodes_form_a_gloo_world(tmp_path):
    from tests.helpers import free_port, start

    port = free_port()
    agents = [
        start("elaunch", "--nnodes=2", "--nproc-per-node=1", "--rdzv-backend=static", f"--node-rank={rank}",
              "--master-addr=127.0.0.1", f"--master-port={port}", "--max-restarts=1",
              str(SCRIPTS / "gloo_crash.py"), "-1", str(tmp_path))
        for rank in (0, 1)
    ]
    try:
        results = [a.communicate(timeout=120) for a in agents]
    finally:
        for a in agents:
            kill_tree(a.pid)
    assert [a.returncode for a in agents] == [0, 0], [err for _, err in results]
    assert (tmp_path / "done_0").read_text() == "3"  # all_reduce of ranks 1 + 2 over two nodes


def test_flags_elaunch_does_not_implement_yet_say_so(tmp_path):
    r = run("elaunch", "--standalone", "--nproc-per-node=1", "--duplicate-stdout-filters=loss",
            "--numa-binding=node", str(SCRIPTS / "env_dump.py"), str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert "--duplicate-stdout-filters=loss is accepted for torchrun compatibility but has no effect" in r.stderr
    assert "--numa-binding=node is accepted" in r.stderr


@pytest.mark.parametrize(
    "peer, peer_shows",
    [("segv", "SIGSEGV"), ("raise", "RuntimeError: a peer's collective broke")],
)
def test_root_cause_is_the_worker_that_failed_first_even_if_it_exited_last(tmp_path, peer, peer_shows):
    # rank 1 records its error first and exits last; rank 0 (the lower rank) fails
    # right after, by signal or with its own error file in the same whole second
    r = run("elaunch", *NPROC2, "--shutdown-timeout=2", str(SCRIPTS / "late_root_cause.py"), peer)
    assert r.returncode == 1
    summary = r.stderr[r.stderr.index("late_root_cause.py FAILED"):]
    root, others = summary.split("Other Failures:")
    assert re.search(r"rank\s*:\s*1 \(local_rank: 1\)", root), summary
    assert "ValueError: the real root cause" in root
    assert peer_shows in others and re.search(r"rank\s*:\s*0 \(local_rank: 0\)", others), summary
