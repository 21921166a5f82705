"""Resharding from memory across test hosts: the world shrinks (a host is lost) and grows (a host joins).

Two hosts (network namespaces, ``tests/multinode/netns.py``) of two workers each train a small
FSDP2 model (CPU, gloo; ``tests/scripts/dcp_reshard.py``) and save every step through
``torch.distributed.checkpoint`` twice: to memory (``SnapshotWriter``; ``--checkpoint-replicas=1``
gives each host the other's parts) and to a plain DCP directory both hosts see. One host is
killed whole (every process in it, SIGKILL) and not replaced: the survivor's next round has
world size 2, restores the step saved at world size 4 from its own memory (its slots and the
replicas of the lost host's ranks: the event says ``memory``, never ``disk``), and what each rank
loaded equals, tensor by tensor, DCP's load of the same step from the plain directory.

The other way round: one host runs alone at world size 2, then a second host joins. The membership
change makes a round of world size 4 that restores the step saved at world size 2 from memory: the
joining host holds nothing, so its agent fetches both saved ranks' parts from the first host over the
authenticated replica channel (its event says ``peer``, the first host's ``memory``), and again every
rank's load equals DCP's load of the same step from the plain directory.
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


def _whole_step_in(shm: str, world: int = 4) -> int | None:
    """A step of world size ``world`` whose parts are all in ``shm`` (a node's slots and replicas), or None."""
    ranks_of: dict[int, set] = {}
    for info in slotfile.inventory(shm):
        if info.reshardable and info.world_size == world:
            ranks_of.setdefault(info.step, set()).add(info.rank)
    whole = [step for step, ranks in ranks_of.items() if ranks == set(range(world))]
    return max(whole, default=None)


def _agent_for(agents, tmp_path, ep, out, disk, stop, pause: str):
    """``start(host, name)``: an agent of the job (c10d, 1 to 2 nodes of 2 workers, one replica, the job secret)
    running ``dcp_reshard.py``, its log directory ``tmp_path / name``."""
    def start(host, name):
        argv = agent_args(host, ep, backend="c10d", nnodes="1:2", nproc=2, rdzv_id="reshard",
                          extra=(f"--log-dir={tmp_path / name}", "--checkpoint-replicas=1", "--max-restarts=3"))
        return agents(host, argv + [WORKER, str(out), str(disk), str(stop), pause], name,
                      env={"ELAUNCH_JOB_SECRET": SECRET})
    return start


def _wait(predicate, timeout: float, what: str, *running):
    """``wait_for``, the agents' output (as it is at the deadline) in the message when it fails."""
    try:
        return wait_for(predicate, timeout, interval=0.05, what=what)
    except AssertionError as exc:
        raise AssertionError("\n".join([str(exc), *(a.describe() for a in running)])) from None


@pytest.mark.parametrize("rdzv", ["c10d"], indirect=True)
def test_a_lost_host_is_not_replaced_and_the_survivor_reshards_the_step_from_its_memory(net, agents, rdzv, tmp_path):
    h1, h2 = net.add_host(), net.add_host()
    ep = rdzv.endpoint(h1)  # the store is in h1's agent: h2 is the one lost
    out, disk, stop = tmp_path / "out", tmp_path / "disk", tmp_path / "stop"
    out.mkdir()
    disk.mkdir()

    agent = _agent_for(agents, tmp_path, ep, out, disk, stop, "1.0")
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


@pytest.mark.parametrize("rdzv", ["c10d"], indirect=True)
def test_a_joining_host_grows_the_world_and_every_rank_reshards_the_step_from_memory(net, agents, rdzv, tmp_path):
    h1, h2 = net.add_host(), net.add_host()
    ep = rdzv.endpoint(h1)  # the store is in h1's agent, which runs from the start
    out, disk, stop = tmp_path / "out", tmp_path / "disk", tmp_path / "stop"
    out.mkdir()
    disk.mkdir()
    agent = _agent_for(agents, tmp_path, ep, out, disk, stop, "0.5")

    first = agent(h1, "a1")
    _wait(lambda: all(list(out.glob(f"saved_{r}_2_*")) for r in range(2)) or first.proc.poll() is not None, 120,
          "both ranks of world 2 saved", first)
    assert first.proc.poll() is None, first.describe()
    shm = json.loads((out / "env_0_2.json").read_text())["ELAUNCH_CHECKPOINT_SHM"]
    step = _wait(lambda: _whole_step_in(shm, 2), 60, "both parts of one step in h1's memory", first)
    assert os.path.exists(disk / f"step_{step}" / ".metadata")  # saved to disk first
    assert not list(out.glob("saved_*_4_*"))

    joiner = agent(h2, "a2")  # the same arguments; h2 holds nothing

    def world_4_over():
        if any(a.proc.poll() is not None for a in (first, joiner)):
            return "an agent exited"
        return len(list(out.glob("verdict_*_4.json"))) == 4 or bool(list(out.glob("fresh_*_4")))
    _wait(world_4_over, 150, "every rank's verdict at world 4", first, joiner)
    assert not list(out.glob("fresh_*_4")), f"a rank of world 4 started fresh\n{first.describe()}\n{joiner.describe()}"
    assert len(list(out.glob("verdict_*_4.json"))) == 4, f"{first.describe()}\n{joiner.describe()}"
    verdicts = [json.loads((out / f"verdict_{r}_4.json").read_text()) for r in range(4)]
    for v in verdicts:
        assert v["world"] == 4 and v["source"] == "memory" and v["step"] >= step, v
        assert v["tensors"] > 0 and v["unequal"] == [], v  # the memory load equals DCP's load from disk
    restored = verdicts[0]["step"]
    assert all(v["step"] == restored for v in verdicts), verdicts

    mine = [e for e in _events(tmp_path / "a1", "checkpoint_restore") if e["step"] == restored]
    theirs = [e for e in _events(tmp_path / "a2", "checkpoint_restore") if e["step"] == restored]
    assert mine and theirs, f"no restore event of the world-4 round\n{first.describe()}\n{joiner.describe()}"
    assert set(mine[-1]["sources"].values()) == {"memory"}, mine[-1]  # h1's own slots
    assert set(theirs[-1]["sources"].values()) == {"peer"}, theirs[-1]  # fetched from h1: never disk
    h2_ranks = sorted(map(int, theirs[-1]["sources"]))
    assert len(h2_ranks) == 2 and sorted(h2_ranks + sorted(map(int, mine[-1]["sources"]))) == [0, 1, 2, 3]
    # h2's agent fetched both saved ranks' parts of the step into its restore/ (h1's replicas reach h2's memory
    # in the background too, so the verdicts alone cannot tell), and each of its ranks was given one of them
    for r in h2_ranks:
        env = json.loads((out / f"env_{r}_4.json").read_text())
        assert env["ELAUNCH_CHECKPOINT_STEP"] == str(restored), env
        restore_dir = os.path.join(env["ELAUNCH_CHECKPOINT_SHM"], "restore")
        assert env["ELAUNCH_CHECKPOINT_RESTORE"] == os.path.join(restore_dir, f"s{r % 2}"), env
        for saved in (0, 1):
            part = slotfile.read_info(os.path.join(restore_dir, f"s{saved}"))
            assert part is not None and part.reshardable, (saved, part, os.listdir(restore_dir))
            assert (part.step, part.rank, part.world_size) == (restored, saved, 2), part

    stop.touch()
    assert first.wait(120) == 0, first.describe()
    assert joiner.wait(120) == 0, joiner.describe()
    no_processes_in(net.hosts)
