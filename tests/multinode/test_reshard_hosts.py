"""Resharding from memory across test hosts: a host is lost and not replaced, the survivor goes on at world 2.

Two hosts (network namespaces, ``tests/multinode/netns.py``) of two workers each train a small
FSDP2 model (CPU, gloo; ``tests/scripts/dcp_reshard.py``) and save every step through
``torch.distributed.checkpoint`` twice: to memory (``SnapshotWriter``; ``--checkpoint-replicas=1``
gives each host the other's parts) and to a plain DCP directory both hosts see. One host is
killed whole (every process in it, SIGKILL) and not replaced: the survivor's next round has
world size 2, restores the step saved at world size 4 from its own memory (its slots and the
replicas of the lost host's ranks: the event says ``memory``, never ``disk``), and what each rank
loaded equals, tensor by tensor, DCP's load of the same step from the plain directory.
"""

from __future__ import annotations

import json
import os

import pytest

from elaunch.checkpoint import slotfile
from tests.conftest import wait_for
from tests.helpers import SCRIPTS
from tests.multinode import netns
from tests.multinode.conftest import agent_args, no_processes_in

pytestmark = [pytest.mark.multinode, pytest.mark.slow]

SECRET = "a secret every node of the job is given"
WORKER = str(SCRIPTS / "dcp_reshard.py")


def _events(log_dir, kind: str) -> list[dict]:
    found = []
    for path in log_dir.glob("*/events.jsonl"):
        found += [e for e in map(json.loads, path.read_text().splitlines()) if e["kind"] == kind]
    return found


def _whole_step_in(shm: str) -> int | None:
    """A step of world size 4 whose four parts are all in ``shm`` (the survivor's slots and replicas), or None."""
    ranks_of: dict[int, set] = {}
    for info in slotfile.inventory(shm):
        if info.reshardable and info.world_size == 4:
            ranks_of.setdefault(info.step, set()).add(info.rank)
    whole = [step for step, ranks in ranks_of.items() if ranks == {0, 1, 2, 3}]
    return max(whole, default=None)


@pytest.mark.parametrize("rdzv", ["c10d"], indirect=True)
def test_a_lost_host_is_not_replaced_and_the_survivor_reshards_the_step_from_its_memory(net, agents, rdzv, tmp_path):
    h1, h2 = net.add_host(), net.add_host()
    ep = rdzv.endpoint(h1)  # the store is in h1's agent: h2 is the one lost
    out, disk, stop = tmp_path / "out", tmp_path / "disk", tmp_path / "stop"
    out.mkdir()
    disk.mkdir()

    def agent(host, name):
        argv = agent_args(host, ep, backend="c10d", nnodes="1:2", nproc=2, rdzv_id="reshard",
                          extra=(f"--log-dir={tmp_path / name}", "--checkpoint-replicas=1", "--max-restarts=3"))
        return agents(host, argv + [WORKER, str(out), str(disk), str(stop), "1.0"], name,
                      env={"ELAUNCH_JOB_SECRET": SECRET})

    survivor, lost = agent(h1, "a1"), agent(h2, "a2")
    wait_for(lambda: all(list(out.glob(f"saved_{r}_4_*")) for r in range(4)), 180,
             what=f"every rank of world 4 saved\n{survivor.describe()}\n{lost.describe()}")
    shm = json.loads((out / "env_0_4.json").read_text())["ELAUNCH_CHECKPOINT_SHM"]
    step = wait_for(lambda: _whole_step_in(shm), 60, interval=0.05,
                    what="every part of one step in the survivor's memory (the lost host's as replicas)")
    assert os.path.exists(disk / f"step_{step}" / ".metadata")  # saved to disk first

    for earlier in [*out.glob("fresh_*_2"), *out.glob("verdict_*_2.json")]:  # of a first round at world 2, if any
        earlier.unlink()
    netns.kill_namespace_processes(lost.host.ns)  # the agent and its workers, SIGKILL; nobody replaces them
    wait_for(lambda: list(out.glob("verdict_*_2.json")) + list(out.glob("fresh_*_2")), 180,
             what=f"the survivor's world-2 round started\n{survivor.describe()}")
    wait_for(lambda: len(list(out.glob("verdict_*_2.json"))) == 2 or list(out.glob("fresh_*_2")), 120,
             what=f"both ranks' verdicts\n{survivor.describe()}")
    assert not list(out.glob("fresh_*_2")), f"the survivor started fresh\n{survivor.describe()}"
    verdicts = [json.loads((out / f"verdict_{r}_2.json").read_text()) for r in (0, 1)]
    for v in verdicts:
        assert v["world"] == 2 and v["source"] == "memory" and v["step"] >= step, v
        assert v["tensors"] > 0 and v["unequal"] == [], v  # the memory load equals DCP's load from disk
    assert verdicts[0]["step"] == verdicts[1]["step"]
    restores = [e for e in _events(tmp_path / "a1", "checkpoint_restore") if sorted(e["sources"]) == ["0", "1"]]
    assert restores, f"no restore event of the world-2 round\n{survivor.describe()}"
    assert restores[-1]["step"] == verdicts[0]["step"]
    assert set(restores[-1]["sources"].values()) <= {"memory", "peer"}  # from memory, never disk

    stop.touch()
    assert survivor.wait(120) == 0, survivor.describe()
    no_processes_in(net.hosts)
