"""elaunch under a real Slurm (issue 9 item 5): examples/slurm/train.sbatch on two nodes.

The cluster (``tests/slurm/cluster.py``): slurmctld and munged in one test host,
a slurmd in each of two more (``node1`` at 192.168.77.2, ``node2`` at .3), each in
its own network, UTS and mount namespace; so ``srun`` starts one elaunch agent in
each node's namespace, the agents meet in a c10d rendezvous on ``node1:29400``
and four workers (two per node) train ``examples/ddp_digits.py``. The tests submit
the example batch script itself with ``sbatch`` and read the job's output file.
"""

from __future__ import annotations

import re

import psutil
import pytest

from tests.conftest import REPO, wait_for
from tests.multinode.conftest import worker_envs
from tests.slurm.cluster import stray_job_processes
from tests.slurm.conftest import FINAL_STATES, assert_nothing_left

pytestmark = [pytest.mark.slurm, pytest.mark.multinode, pytest.mark.slow]

TRAIN = REPO / "examples" / "slurm" / "train.sbatch"
LR = ("--lr", "0.005")  # as the multinode tests: 8 epochs reach 0.95 in a world of 4
#: 12 steps per epoch in a world of 4: epochs of >= 0.6 s, so a signal sent after the
#: first epoch line lands well before the last step (the job's output comes with a delay)
SLOW = ("--step-sleep", "0.05")


def _final_accuracy(text: str) -> float:
    found = re.findall(r"final test accuracy: ([0-9.]+)", text)
    assert found, f"no final accuracy in:\n{text}"
    return float(found[-1])


def _workers_by_node(slurm, job) -> dict[str, list[dict[str, str]]]:
    """The environments of job ``job``'s elaunch workers, per node."""
    return {name: [e for e in worker_envs(host) if e.get("SLURM_JOB_ID") == job.id]
            for name, host in slurm.nodes.items()}


def _world_of_four_on_two_nodes(slurm, job):
    """Two workers on each node, all in one world of 4 whose group ranks are 0 and 1; None until then."""
    if job.state() in FINAL_STATES | {"GONE"}:
        raise AssertionError(f"job ended before its world of 4 was seen\n{job.describe()}")
    by_node = _workers_by_node(slurm, job)
    if not all(len(envs) == 2 for envs in by_node.values()):
        return None
    envs = [e for es in by_node.values() for e in es]
    if {e["WORLD_SIZE"] for e in envs} != {"4"}:
        return None
    return by_node


def test_a_two_node_job_trains_to_its_accuracy(slurm, jobs):
    job = jobs(TRAIN, "--epochs", "8", *LR)
    by_node = wait_for(lambda: _world_of_four_on_two_nodes(slurm, job), 120, interval=0.1,
                       what="two workers on each node in a world of 4")
    # one agent per node (GROUP_RANK 0 and 1), the rendezvous id is the job id
    assert {e["GROUP_RANK"] for e in by_node["node1"]} != {e["GROUP_RANK"] for e in by_node["node2"]}, by_node
    assert sorted(e["RANK"] for es in by_node.values() for e in es) == ["0", "1", "2", "3"], by_node
    assert {e["TORCHELASTIC_RUN_ID"] for es in by_node.values() for e in es} == {job.id}, by_node
    assert job.wait_end(120) == "COMPLETED", job.describe()
    out = job.output
    assert "rendezvous at node1:29400" in out, out
    assert "epoch 8/8" in out and "srun exited with status 0" in out, out
    assert all(line.endswith("restart 0") for line in out.splitlines() if line.startswith("epoch ")), out
    assert _final_accuracy(out) >= 0.95, out
    assert_nothing_left(slurm, [job], timeout=30)


def test_usr1_to_the_batch_shell_reaches_the_workers_and_the_job_completes(slurm, jobs, tmp_path):
    """``scancel --signal=USR1 --batch`` is what ``#SBATCH --signal=B:USR1@120`` does at the time limit.

    It signals the batch shell only; the script's trap passes it to srun, srun to the
    step on both nodes, whose slurmstepd signals every process of the step (agents and
    workers: proctrack/linuxproc follows the process tree); each agent also forwards
    its copy to its workers, and keeps running. The example saves once per notice.
    """
    job = jobs(TRAIN, "--epochs", "14", *SLOW, *LR)
    job.wait_text("epoch 1/14", 120)
    slurm.client(["scancel", "--signal=USR1", "--batch", job.id])
    out = job.wait_text("preemption notice (SIGUSR1): checkpoint saved", 60)
    assert "batch shell: SIGUSR1, passed on to srun" in out, out
    # the agent of each node received it and kept running (a notice, not a stop)
    job.wait_text("received SIGUSR1: forwarded to the workers", 30, count=2)
    assert job.wait_end(120) == "COMPLETED", job.describe()
    out = job.output
    after = out.split("preemption notice (SIGUSR1)", 1)[1]
    assert "epoch 14/14" in after and "resumed from" not in out, out
    assert all(line.endswith("restart 0") for line in out.splitlines() if line.startswith("epoch ")), out
    assert _final_accuracy(out) >= 0.95, out
    assert (tmp_path / "run" / "checkpoint.pt").exists()
    assert_nothing_left(slurm, [job], timeout=30)


def test_scancel_mid_training_ends_the_job_and_leaves_no_process(slurm, jobs):
    job = jobs(TRAIN, "--epochs", "500", *SLOW, *LR)  # far longer than the test
    job.wait_text("epoch 1/500", 120)
    procs, agents, workers = {}, [], []
    for pid, cmd in stray_job_processes(job.id).items():
        try:
            p = psutil.Process(pid)
            env = p.environ()
        except psutil.Error:
            continue
        procs[pid] = p
        if "RANK" in env and "TORCHELASTIC_RUN_ID" in env:
            workers.append(cmd)
        elif "bin/elaunch" in cmd:
            agents.append(cmd)
    assert len(agents) == 2 and len(workers) == 4, (agents, workers)  # one agent per node, two workers each
    slurm.client(["scancel", job.id])
    assert job.wait_end(60) == "CANCELLED", job.describe()
    # SIGTERM to every process of the job's steps, SIGKILL after KillWait (10 s); nothing may outlive it
    assert_nothing_left(slurm, [job], timeout=60)
    def alive(p: psutil.Process) -> bool:
        try:
            return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            return False
    assert not [pid for pid, p in procs.items() if alive(p)]
    assert "final test accuracy" not in job.output
