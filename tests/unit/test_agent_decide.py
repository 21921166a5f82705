"""Table tests of the agent's pure decisions, rank assignment and worker env."""

import pytest

from elaunch.agent import EnvOptions, Step, Verdict, assign_ranks, judge, next_step, worker_env
from elaunch.rendezvous.contract import NodeInfo
from elaunch.spec import Worker, WorkerGroup, WorkerSpec


@pytest.mark.parametrize(
    "codes, waiting, expected",
    [
        ({0: None, 1: None}, 0, Verdict.RUNNING),
        ({0: None, 1: None}, 2, Verdict.MEMBERSHIP_CHANGE),
        ({0: 0, 1: None}, 0, Verdict.RUNNING),
        ({0: 0, 1: 0}, 0, Verdict.SUCCEEDED),
        ({0: 0, 1: 0}, 3, Verdict.SUCCEEDED),
        ({0: 1, 1: None}, 0, Verdict.FAILED),
        ({0: None, 1: -9}, 5, Verdict.FAILED),
        ({0: 0, 1: 3}, 0, Verdict.FAILED),
    ],
)
def test_judge(codes, waiting, expected):
    assert judge(codes, waiting) is expected


@pytest.mark.parametrize(
    "codes, new, expected",
    [
        # a failure while new nodes joined is the scale-up closing our sockets
        ({0: 1, 1: None}, 1, Verdict.MEMBERSHIP_CHANGE),
        ({0: -6, 1: 1}, 2, Verdict.MEMBERSHIP_CHANGE),
        # no newcomer: a failure stays a failure
        ({0: 1, 1: None}, 0, Verdict.FAILED),
        # newcomers change nothing for a healthy or finished group
        ({0: None, 1: None}, 1, Verdict.RUNNING),
        ({0: 0, 1: 0}, 1, Verdict.SUCCEEDED),
    ],
)
def test_judge_failure_during_a_scale_up(codes, new, expected):
    assert judge(codes, 0, new) is expected


@pytest.mark.parametrize(
    "verdict, used, budget, expected",
    [
        (Verdict.SUCCEEDED, 0, 0, Step.FINISH_OK),
        (Verdict.FAILED, 0, 0, Step.FINISH_FAILED),
        (Verdict.FAILED, 0, 1, Step.RESTART),
        (Verdict.FAILED, 1, 1, Step.FINISH_FAILED),
        (Verdict.FAILED, 2, 3, Step.RESTART),
        (Verdict.MEMBERSHIP_CHANGE, 5, 0, Step.REJOIN),
    ],
)
def test_next_step(verdict, used, budget, expected):
    assert next_step(verdict, used, budget) is expected


def test_next_step_rejects_running():
    with pytest.raises(ValueError):
        next_step(Verdict.RUNNING, 0, 1)


def _ranks(workers):
    return [(w.local_rank, w.global_rank, w.role_rank, w.world_size, w.role_world_size) for w in workers]


def test_identical_nodes_without_node_list():
    assert _ranks(assign_ranks((), 1, 3, "default", 2)) == [(0, 2, 2, 6, 6), (1, 3, 3, 6, 6)]


def test_heterogeneous_nodes_and_roles():
    nodes = (NodeInfo("a", "trainer", 2), NodeInfo("b", "reader", 1), NodeInfo("c", "trainer", 3))
    assert _ranks(assign_ranks(nodes, 2, 3, "trainer", 3)) == [(0, 3, 2, 6, 5), (1, 4, 3, 6, 5), (2, 5, 4, 6, 5)]
    assert _ranks(assign_ranks(nodes, 1, 3, "reader", 1)) == [(0, 2, 0, 6, 1)]


@pytest.mark.parametrize(
    "nodes, rank, world",
    [
        ((NodeInfo("a"),), 0, 2),  # fewer nodes than the world size
        ((NodeInfo("a"), NodeInfo("b")), 2, 2),  # rank out of range
        ((NodeInfo("a", "default", 4),), 0, 1),  # disagrees with our nproc
    ],
)
def test_inconsistent_rendezvous_is_rejected(nodes, rank, world):
    with pytest.raises(ValueError):
        assign_ranks(nodes, rank, world, "default", 1)


def _group():
    spec = WorkerSpec(role="trainer", local_world_size=2, cmd=("python", "x.py"))
    return WorkerGroup(spec=spec, group_rank=1, group_world_size=2, master_addr="10.0.0.1", master_port=1234)


def test_worker_env_has_torchrun_variables():
    worker = Worker(local_rank=1, global_rank=3, role_rank=3, world_size=4, role_world_size=4)
    env = worker_env({"PATH": "/bin"}, worker, _group(), 2, "/tmp/e.json", EnvOptions("job", 3, True, 1))
    assert env == {
        "PATH": "/bin",
        "RANK": "3",
        "LOCAL_RANK": "1",
        "GROUP_RANK": "1",
        "ROLE_RANK": "3",
        "ROLE_NAME": "trainer",
        "LOCAL_WORLD_SIZE": "2",
        "WORLD_SIZE": "4",
        "GROUP_WORLD_SIZE": "2",
        "ROLE_WORLD_SIZE": "4",
        "MASTER_ADDR": "10.0.0.1",
        "MASTER_PORT": "1234",
        "TORCHELASTIC_RESTART_COUNT": "2",
        "TORCHELASTIC_MAX_RESTARTS": "3",
        "TORCHELASTIC_RUN_ID": "job",
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
        "TORCHELASTIC_ERROR_FILE": "/tmp/e.json",
        "OMP_NUM_THREADS": "1",
    }


def test_worker_env_keeps_user_settings():
    worker = Worker(local_rank=0, global_rank=0, role_rank=0, world_size=1, role_world_size=1)
    base = {"OMP_NUM_THREADS": "4", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "0"}
    env = worker_env(base, worker, _group(), 0, "e", EnvOptions("j", 0, False, 1))
    assert env["OMP_NUM_THREADS"] == "4"
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "0"
    assert env["TORCHELASTIC_USE_AGENT_STORE"] == "False"


@pytest.mark.parametrize(
    "visible, local_rank, expected",
    [(None, 1, "1"), ("4,5,6", 2, "6"), ("7, 3", 1, "3")],
)
def test_virtual_local_rank(visible, local_rank, expected):
    base = {} if visible is None else {"CUDA_VISIBLE_DEVICES": visible}
    worker = Worker(local_rank=local_rank, global_rank=local_rank, role_rank=0, world_size=3, role_world_size=3)
    env = worker_env(base, worker, _group(), 0, "e", EnvOptions("j", 0, False, virtual_local_rank=True))
    assert env["LOCAL_RANK"] == "0"
    assert env["CUDA_VISIBLE_DEVICES"] == expected


def test_virtual_local_rank_without_a_device_fails():
    worker = Worker(local_rank=2, global_rank=2, role_rank=2, world_size=3, role_world_size=3)
    with pytest.raises(ValueError, match="CUDA_VISIBLE_DEVICES=0,1"):
        worker_env({"CUDA_VISIBLE_DEVICES": "0,1"}, worker, _group(), 0, "e", EnvOptions("j", 0, False, virtual_local_rank=True))
