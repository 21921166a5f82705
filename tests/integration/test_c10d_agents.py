"""Several agents on one c10d endpoint (loopback): world formation, scale-up, scale-down."""

from __future__ import annotations

import pytest

from tests.conftest import wait_for
from tests.helpers import SCRIPTS, finish_agents, free_port, kill_tree, launcher_env, load_envs, port_open, start, start_agent

pytestmark = pytest.mark.slow


def _agent(port, nnodes, script_args, *extra, rdzv_id="job", conf="last_call_timeout=1,join_timeout=60",
           monitor_interval=0.1, env=None):
    return start_agent("c10d", f"127.0.0.1:{port}", *script_args, rdzv_id=rdzv_id, nnodes=nnodes, conf=conf,
                       monitor_interval=monitor_interval, extra=extra, env=env)




def test_two_agents_form_a_world_of_two(tmp_path):
    port = free_port()
    agents = [_agent(port, 2, [str(SCRIPTS / "env_dump.py"), str(tmp_path)]) for _ in range(2)]
    for code, err, _ in finish_agents(agents):
        assert code == 0, err
    envs = load_envs(tmp_path)
    assert sorted(envs) == ["env_0_0", "env_1_0"]
    assert {e["GROUP_RANK"] for e in envs.values()} == {"0", "1"}
    assert all(e["WORLD_SIZE"] == "2" and e["GROUP_WORLD_SIZE"] == "2" for e in envs.values())
    assert envs["env_0_0"]["MASTER_PORT"] == envs["env_1_0"]["MASTER_PORT"]
    assert all(e["TORCHELASTIC_USE_AGENT_STORE"] == "True" for e in envs.values())


def test_jobs_with_different_ids_never_merge(tmp_path):
    port = free_port()
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    # job a's agent hosts the shared store, so its worker stays until job b's agent is done
    release = tmp_path / "release"
    host = _agent(port, 1, [str(SCRIPTS / "env_dump.py"), str(a), "--wait-for", str(release)], rdzv_id="job-a")
    wait_for(lambda: port_open(port), 60, what="store host listening")
    other = _agent(port, 1, [str(SCRIPTS / "env_dump.py"), str(b)], rdzv_id="job-b")
    try:
        results = finish_agents([other])
    finally:
        release.touch()
    results += finish_agents([host])
    for code, err, _ in results:
        assert code == 0, err
    for d in (a, b):
        envs = load_envs(d)
        assert list(envs) == ["env_0_0"] and envs["env_0_0"]["WORLD_SIZE"] == "1"
    assert load_envs(a)["env_0_0"]["TORCHELASTIC_RUN_ID"] == "job-a"
    assert load_envs(b)["env_0_0"]["TORCHELASTIC_RUN_ID"] == "job-b"


def test_scale_up_a_node_joins_a_running_job(tmp_path):
    # torchrun 2.13 deadlocks here: the joiner waits for a MASTER_ADDR nobody republishes.
    port = free_port()
    script = [str(SCRIPTS / "gloo_loop.py"), str(tmp_path), "300"]  # until `stop`
    first = _agent(port, "1:2", script)
    second = None
    try:
        wait_for(lambda: (tmp_path / "progress_1").exists(), 90, what="world of 1 running")
        second = _agent(port, "1:2", script)
        wait_for(lambda: (tmp_path / "progress_2").exists(), 90, what="world of 2 running")
    finally:
        (tmp_path / "stop").touch()
        results = finish_agents([a for a in (first, second) if a])
    assert [code for code, _, _ in results] == [0, 0], results


def test_workers_killed_by_a_scale_up_elsewhere_are_not_a_failure(tmp_path):
    # `slow` polls the rendezvous only every 30 s, so it learns of the newcomer from
    # its own worker dying on the closed gloo socket after `fast` re-formed. With no
    # restarts left, counting that as a failure would end the job (torchrun does).
    port = free_port()
    script = [str(SCRIPTS / "gloo_loop.py"), str(tmp_path), "300"]  # until `stop`
    env = launcher_env(LOGLEVEL="INFO")
    fast = _agent(port, "2:3", script, "--max-restarts=0", env=env)
    wait_for(lambda: port_open(port), 60, what="store host listening")
    slow = _agent(port, "2:3", script, "--max-restarts=0", monitor_interval=30, env=env)
    late = None
    try:
        wait_for(lambda: (tmp_path / "progress_2").exists(), 90, what="world of 2 running")
        late = _agent(port, "2:3", script, "--max-restarts=0", env=env)
        wait_for(lambda: (tmp_path / "progress_3").exists(), 90, what="world of 3 running")
    finally:
        (tmp_path / "stop").touch()
        results = finish_agents([a for a in (fast, slow, late) if a])
    # each agent's own exit status and the end of its log (INFO), so a failure says who and why
    for name, (code, err, _) in zip(("fast (store host)", "slow", "late"), results):
        assert code == 0, f"agent {name} exited {code}; its stderr ends:\n{err[-6000:]}"
    assert "new node(s) joined" in results[1][1], results[1][1]
    assert "worker group failed" not in results[1][1]


def test_scale_down_a_node_dies_and_the_rest_continue(tmp_path):
    port = free_port()
    script = [str(SCRIPTS / "gloo_loop.py"), str(tmp_path), "300"]  # until `stop`
    host = _agent(port, "1:2", script, "--max-restarts=3")
    # the first agent to bind the endpoint hosts the store: make sure it is `host`
    wait_for(lambda: port_open(port), 60, what="store host listening")
    other = _agent(port, "1:2", script, "--max-restarts=3")
    try:
        wait_for(lambda: (tmp_path / "progress_2").exists(), 90, what="world of 2 running")
        (tmp_path / "progress_1").unlink(missing_ok=True)
        kill_tree(other.pid)  # SIGKILL the non-host agent and its workers
        wait_for(lambda: (tmp_path / "progress_1").exists(), 90, what="world of 1 running again")
    finally:
        (tmp_path / "stop").touch()
        results = finish_agents([host, other])
    assert results[0][0] == 0, results[0][1]


def test_a_waiting_node_says_what_it_waits_for(tmp_path):
    # LOGLEVEL=INFO: the first node of --nnodes=2 says every few seconds that it waits for one more
    port = free_port()
    err = tmp_path / "a.err"
    with open(err, "w") as f:
        first = start("elaunch", "--nnodes=2", "--nproc-per-node=1", "--rdzv-backend=c10d",
                      f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=wait", "--rdzv-conf=join_timeout=60",
                      "--local-addr=127.0.0.1", str(SCRIPTS / "env_dump.py"), str(tmp_path),
                      env=launcher_env(LOGLEVEL="INFO"), stderr=f)
    second = None
    try:
        wait_for(lambda: "waiting for nodes: 1/2 joined (min 2, max 2), 1 more needed to start; gives up in"
                 in err.read_text(), 30, what="the waiting line")
        second = _agent(port, 2, [str(SCRIPTS / "env_dump.py"), str(tmp_path)], rdzv_id="wait",
                        conf="join_timeout=60")
        assert first.wait(timeout=60) == 0, err.read_text()
        _out, serr = second.communicate(timeout=60)
        assert second.returncode == 0, serr
    finally:
        for a in (first, second):
            if a is not None:
                kill_tree(a.pid)
