"""FSDP2 across test hosts under faults: five worker SIGKILLs and a host replaced, bit-identical to no fault.

Two hosts (network namespaces, ``tests/multinode/netns.py``) of two workers each run
``examples/fsdp2_dcp.py`` (CPU, gloo), which saves every step through DCP into elaunch's memory
(``SnapshotWriter``; ``--checkpoint-replicas=1``: each host keeps the other's parts) and restores
with ``SnapshotReader``. The world size stays 4 throughout (``--nnodes=2``):

* attempts 0 to 4 each lose one worker, SIGKILLed right after saving a step (``--crash-at``), on
  ranks of both hosts; every next attempt restores exactly that step from memory on all 4 ranks;
* in attempt 5 every process of the second host (not the one holding the c10d store) is SIGKILLed
  and an agent on a third host, with a new address, takes its place: its ranks' parts come from
  the first host's replicas (its ``checkpoint_restore`` event says ``peer``), all 4 ranks restore
  the same step.

The final parameters are bit-identical to an uninterrupted run at world size 4 (``--standalone
--nproc-per-node=4`` on one host: FSDP2's sharding and the data split depend on the world size and
the global rank only, not on the host layout, and gloo's collectives give the same bits over the
bridge as over loopback; checked when this test was written).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from elaunch.checkpoint import slotfile
from tests.conftest import wait_for
from tests.helpers import run
from tests.multinode import netns
from tests.multinode.conftest import agent_args, no_processes_in, worker_envs

pytest.importorskip("torch")
pytestmark = [pytest.mark.multinode, pytest.mark.slow]

SECRET = "a secret every node of the job is given"
EXAMPLE = str(Path(__file__).resolve().parents[2] / "examples" / "fsdp2_dcp.py")
STEPS = 28
#: attempt i's crash: (global rank, step); ranks 0-1 run on the first host, 2-3 on the second
CRASHES = [(1, 2), (2, 5), (0, 8), (3, 11), (1, 14)]
REPLACED_IN = len(CRASHES)  # the attempt in which the second host is lost


def _journal(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _events(log_dir: Path, kind: str) -> list[dict]:
    found = []
    for path in log_dir.glob("*/events.jsonl"):
        found += [e for e in map(json.loads, path.read_text().splitlines()) if e["kind"] == kind]
    return found


def _whole_step_after(shm: str, step: int) -> int | None:
    """A step after ``step`` of world size 4 whose four parts are all in ``shm`` (own slots and replicas), or None."""
    ranks_of: dict[int, set] = {}
    for info in slotfile.inventory(shm):
        if info.reshardable and info.world_size == 4 and info.step > step:
            ranks_of.setdefault(info.step, set()).add(info.rank)
    return max((s for s, ranks in ranks_of.items() if ranks == {0, 1, 2, 3}), default=None)


def _uninterrupted(tmp_path: Path) -> str:
    out = tmp_path / "uninterrupted.sha"
    r = run("elaunch", "--standalone", "--nproc-per-node=4", EXAMPLE, "--steps", str(STEPS), "--final-params",
            str(out), timeout=120)
    assert r.returncode == 0, r.stderr[-4000:]
    return out.read_text().strip()


@pytest.mark.parametrize("rdzv", ["c10d"], indirect=True)
def test_five_worker_kills_and_a_replaced_host_end_bit_identical_to_an_uninterrupted_run(net, agents, rdzv,
                                                                                         tmp_path):
    expected = _uninterrupted(tmp_path)
    h1, h2, h3 = net.add_host(), net.add_host(), net.add_host()
    ep = rdzv.endpoint(h1)  # the store is in h1's agent: h2 is the host lost
    journal, final = tmp_path / "journal.jsonl", tmp_path / "final.sha"
    crash_at = ",".join(f"{r}:{s}" for r, s in CRASHES)

    def agent(host, name):
        argv = agent_args(host, ep, backend="c10d", nnodes="2", nproc=2, rdzv_id="fsdp2faults",
                          extra=(f"--log-dir={tmp_path / name}", "--checkpoint-replicas=1", "--max-restarts=10"))
        script = [EXAMPLE, "--steps", str(STEPS), "--crash-at", crash_at, "--journal", str(journal),
                  "--final-params", str(final)]
        return agents(host, argv + script, name, env={"ELAUNCH_JOB_SECRET": SECRET})

    a1, a2 = agent(h1, "a1"), agent(h2, "a2")

    def replaced_attempt_restored():
        for a in (a1, a2):
            assert a.proc.poll() is None, f"{a} exited ({a.proc.returncode})\n{a.describe()}"
        starts = [e for e in _journal(journal) if e["event"] == "start" and e["attempt"] == REPLACED_IN]
        return len(starts) == 4

    wait_for(replaced_attempt_restored, 120, interval=0.1,
             what=f"attempt {REPLACED_IN} started on all 4 ranks\n{a1.describe()}\n{a2.describe()}")
    shm = wait_for(lambda: {e.get("ELAUNCH_CHECKPOINT_SHM") for e in worker_envs(h1)} - {None}, 30,
                   what="h1's checkpoint memory").pop()
    last_crash = CRASHES[-1][1]
    before_kill = wait_for(lambda: _whole_step_after(shm, last_crash), 60, interval=0.02,
                           what="a step after the last crash whole in h1's memory (h2's parts as replicas)")
    assert before_kill < STEPS - 1, "the run ended before the host could be lost: give it more --steps"
    netns.kill_namespace_processes(h2.ns)  # the agent and its workers, SIGKILL
    a2.proc.wait(timeout=10)
    no_processes_in([h2], timeout=10)
    a3 = agent(h3, "a3")
    codes = [a1.wait(120), a3.wait(120)]
    assert codes == [0, 0], f"{a1.describe()}\n{a3.describe()}"
    no_processes_in(net.hosts)

    records = _journal(journal)
    crashes = [(e["attempt"], e["rank"], e["step"]) for e in records if e["event"] == "crash"]
    assert crashes == [(i, r, s) for i, (r, s) in enumerate(CRASHES)], crashes  # 5 SIGKILLs, one an attempt
    starts = [e for e in records if e["event"] == "start"]
    assert all(e["world_size"] == 4 for e in starts), starts
    first = [e for e in starts if e["attempt"] == 0]
    assert sorted(e["rank"] for e in first) == [0, 1, 2, 3] and {e["step"] for e in first} == {None}, first
    for attempt in range(1, REPLACED_IN + 1):  # after each worker kill: exactly the step saved before it, from memory
        these = [e for e in starts if e["attempt"] == attempt][:4]  # the host's loss restarts uncounted: 5 again
        assert sorted(e["rank"] for e in these) == [0, 1, 2, 3], these
        assert {(e["step"], e["source"]) for e in these} == {(CRASHES[attempt - 1][1], "memory")}, these

    (restore,) = _events(tmp_path / "a3", "checkpoint_restore")  # the replacing host: its parts from h1's replicas
    assert len(restore["sources"]) == 2 and set(restore["sources"].values()) == {"peer"}, restore
    assert before_kill <= restore["step"] < STEPS - 1, restore
    after = starts[4 * (REPLACED_IN + 1):]  # the starts of the rounds after the host was lost
    last = {e["rank"]: e for e in after}  # the final round's start of each rank
    assert sorted(last) == [0, 1, 2, 3], after
    assert {e["step"] for e in last.values()} == {restore["step"]}, after  # all 4 ranks: the same step
    assert final.read_text().strip() == expected  # bit-identical to the uninterrupted run
