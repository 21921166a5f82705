"""The agent's side of in-memory checkpoints without processes: the node directory, the round's restore, the env.

Real slot files in a temporary directory; the job channel and the fetch are small fakes.
"""

from __future__ import annotations

import json
import logging
import os
import stat

import pytest

from elaunch.checkpoint import restore as R
from elaunch.checkpoint.keeper import ENV_RESTORE, ENV_SHM, ENV_STEP, CheckpointKeeper
from elaunch.agent.events import AgentEvents
from elaunch.checkpoint import plan as planner
from elaunch.checkpoint import slotfile
from elaunch.procs import snapshot_dir
from elaunch.supervision import Supervisor
from elaunch.rendezvous.contract import NodeInfo, RendezvousInfo
from elaunch.rendezvous.job_channel import InMemoryJobChannel, LocalJobChannel
from elaunch.spec import Worker
from tests.slots import write_slot

KEYS = {"0": b"0" * 32, "1": b"1" * 32, "2": b"2" * 32}  #: each node's replica key, by group rank


class Launcher:
    """What the keeper needs of a WorkerLauncher: a reaper (none here) and the supervisor of the helpers."""

    reaper = None

    def __init__(self) -> None:
        self.supervisor = Supervisor()


def keeper(tmp_path, channel, lines: list) -> CheckpointKeeper:
    k = CheckpointKeeper("job/1", 0, None, 60.0, lambda: channel, root=str(tmp_path))
    k.open(Launcher(), AgentEvents(None, "n0", "host", 0, echo=lines.append))
    return k


def workers(nodes: int, per_node: int, group_rank: int) -> list[Worker]:
    world = nodes * per_node
    return [Worker(local_rank=lr, global_rank=group_rank * per_node + lr, role_rank=group_rank * per_node + lr,
                   world_size=world, role_world_size=world) for lr in range(per_node)]


def info(round: int, rank: int, nodes: int, per_node: int) -> RendezvousInfo:
    return RendezvousInfo(round, rank, nodes, "127.0.0.1", 1, nodes=tuple(NodeInfo("127.0.0.1", "default", per_node)
                                                                        for _ in range(nodes)))


def test_ranks_of_each_node_and_the_ring():
    assert R.ranks_by_group([NodeInfo("a", "r", 2), NodeInfo("b", "r", 3)], 2, 2) == {"0": [0, 1], "1": [2, 3, 4]}
    assert R.ranks_by_group((), 2, 2) == {"0": [0, 1], "1": [2, 3]}
    addrs = {"0": "10.0.0.1:7", "1": "10.0.0.2:8", "2": "", "3": "[::1]:9"}
    assert R.ring(addrs, "1", 1) == [("::1", 9)]  # node 2 named no address
    assert R.ring(addrs, "3", 5) == [("10.0.0.1", 7), ("10.0.0.2", 8)]  # never itself, never more than there are
    assert R.ring(addrs, "0", 0) == []


def test_the_node_directory_is_0700_with_its_parts_and_goes(tmp_path):
    d = snapshot_dir.NodeDir.create("a b/c", 42, root=str(tmp_path))
    assert os.path.basename(d.path) == "elaunch-a_b_c-42"
    assert stat.S_IMODE(os.stat(d.path).st_mode) == 0o700
    assert sorted(os.listdir(d.path)) == ["replicas", "restore", "slots"]
    d.remove()
    assert not os.path.exists(d.path)


def test_no_writable_shm_is_one_warning_and_off(tmp_path, caplog):
    lines: list = []
    with caplog.at_level(logging.WARNING):
        k = CheckpointKeeper("job", 0, None, 60.0, LocalJobChannel, root=str(tmp_path / "missing"))
        k.open(Launcher(), AgentEvents(None, "n0", "host", 0, echo=lines.append))
    assert k.node_dir is None
    assert [r.getMessage() for r in caplog.records if "in-memory checkpoints are off" in r.getMessage()]
    k.prepare(info(0, 0, 1, 2), workers(1, 2, 0), 2)
    assert k.env(0) == {} and k.env(1) == {}  # no variable: the worker's API falls back to a directory
    k.close()


@pytest.mark.parametrize("path, ok", [
    ("/dev/shm/elaunch-x-1", True), ("/dev/shm/other-1", False), ("/tmp/elaunch-x-1", False),
    ("/dev/shm/elaunch-x-1/slots", False), ("/dev/shm/elaunch-x-1/../../etc", False), ("/dev/shm", False),
])
def test_the_reaper_removes_only_node_directories(path, ok):
    assert snapshot_dir.removable(path) is ok


def test_single_node_restores_the_newest_step_every_rank_has_from_its_own_slots(tmp_path):
    lines: list = []
    k = keeper(tmp_path, LocalJobChannel(), lines)
    shm = k.node_dir.path
    k.prepare(info(0, 0, 1, 2), workers(1, 2, 0), 2)
    assert k.env(0) == {ENV_SHM: shm} and k.env(1) == {ENV_SHM: shm}  # nothing saved yet: nothing to restore
    a0, b0 = slotfile.slot_paths(shm, 0)
    a1, b1 = slotfile.slot_paths(shm, 1)
    write_slot(a0, 4, rank=0, world_size=2)
    write_slot(b0, 5, rank=0, world_size=2)
    write_slot(a1, 4, rank=1, world_size=2)  # rank 1 died before saving step 5
    k.prepare(info(1, 0, 1, 2), workers(1, 2, 0), 2)
    assert k.env(0) == {ENV_SHM: shm, ENV_RESTORE: a0, ENV_STEP: "4"}  # the step every rank has, not 5
    assert k.env(1) == {ENV_SHM: shm, ENV_RESTORE: a1, ENV_STEP: "4"}
    (event,) = [json.loads(x) for x in lines if b"checkpoint_restore" in x]
    assert event["round"] == 1 and event["step"] == 4 and event["sources"] == {"0": "memory", "1": "memory"}
    k.close()
    assert not os.path.exists(shm)


def test_replicated_state_serves_a_local_rank_from_another_ranks_slot(tmp_path):
    k = keeper(tmp_path, LocalJobChannel(), [])
    shm = k.node_dir.path
    a0, _ = slotfile.slot_paths(shm, 0)
    write_slot(a0, 9, rank=0, world_size=2, replicated=True)
    k.prepare(info(1, 0, 1, 2), workers(1, 2, 0), 2)
    assert k.env(1)[ENV_RESTORE] == a0 and k.env(1)[ENV_STEP] == "9"
    record = k.status_record()
    assert record["step"] == 9 and record["bytes"] > 0
    k.close()


def _reserved(k: CheckpointKeeper) -> None:
    """Wait for the round's slot reservation thread, if the keeper started one."""
    if k._reserving is not None:
        k._reserving.thread.join(30)
        assert not k._reserving.is_alive()


def test_a_local_rank_with_no_slot_here_gets_both_reserved_at_the_restored_size(tmp_path, caplog):
    """Local rank 1 restores from rank 0's slot and has none of its own (a replacement node's case): the agent
    makes both its slot files, empty, the size of the snapshot it restores; rank 0's are left as they are."""
    k = keeper(tmp_path, LocalJobChannel(), [])
    shm = k.node_dir.path
    a0, b0 = slotfile.slot_paths(shm, 0)
    write_slot(a0, 9, data=b"x" * 100_000, rank=0, world_size=2, replicated=True)
    held = slotfile.read_info(a0)
    with caplog.at_level(logging.INFO, logger="elaunch.agent"):
        k.prepare(info(1, 0, 1, 2), workers(1, 2, 0), 2)
        _reserved(k)
    assert k.env(1)[ENV_RESTORE] == a0
    size = -(-held.size // 4096) * 4096
    for path in slotfile.slot_paths(shm, 1):
        st = os.stat(path)
        assert st.st_size == size and st.st_blocks * 512 >= size, path
    assert not os.path.exists(b0)  # rank 0 holds a slot here: it needs nothing made
    assert slotfile.inventory(shm) == [held]  # the reserved files read as empty
    assert "reserved 0.2 MiB of slots for local rank(s) [1]" in caplog.text
    k.prepare(info(2, 0, 1, 2), workers(1, 2, 0), 2)  # the next round: every rank has its slots
    assert k._reserving is None
    k.close()


def test_a_resharded_step_reserves_no_slot(tmp_path):
    """World 2 saved step 5; one node now runs 3 ranks: each reads every part, and its own state has another
    size than any part, so nothing is reserved for the ranks without slots."""
    k = keeper(tmp_path, LocalJobChannel(), [])
    shm = k.node_dir.path
    write_part(slotfile.slot_paths(shm, 0)[0], 5, 0, 2)
    write_part(os.path.join(shm, "replicas", "r1"), 5, 1, 2)
    k.prepare(info(1, 0, 1, 3), workers(1, 3, 0), 3)
    assert k.env(2)[ENV_STEP] == "5"
    _reserved(k)
    assert not any(os.path.exists(p) for lr in (1, 2) for p in slotfile.slot_paths(shm, lr))
    k.close()


def test_several_nodes_without_an_exchange_restore_nothing_alike(tmp_path):
    """A static job of two nodes: each would choose from its own memory alone, so none restores."""
    k = keeper(tmp_path, LocalJobChannel(), [])
    write_slot(slotfile.slot_paths(k.node_dir.path, 0)[0], 3, rank=0, world_size=4, replicated=True)
    k.prepare(info(1, 0, 2, 2), workers(2, 2, 0), 2)
    assert ENV_RESTORE not in k.env(0) and ENV_RESTORE not in k.env(1)
    k.close()


class Exchanging(InMemoryJobChannel):
    """An in-memory channel whose exchange returns the peers' documents given, with the caller's own."""

    def __init__(self, peers: dict) -> None:
        super().__init__("me")
        self.peers = peers
        self.asked: list = []

    def exchange(self, kind, round, doc, timeout):
        self.asked.append((kind, round, timeout))
        return {**self.peers, "me": doc}


def test_a_new_node_plans_from_the_exchanged_documents(tmp_path):
    """Node 1 holds nothing; node 0's doc says it holds step 7 (replicated): node 1's rank fetches it."""
    peer = {"v": planner.DOC_VERSION, "addr": "127.0.0.1:1", "group_rank": 0,
            "held": [[7, 0, 2, True, planner.SLOT, "/peer/slots/0.0", False]]}
    channel = Exchanging({"peer": peer})
    k = keeper(tmp_path, channel, [])
    k.prepare(info(2, 1, 2, 1), workers(2, 1, 1), 1)
    assert channel.asked == [("checkpoint", 2, k._exchange_timeout)]
    # the fetch from 127.0.0.1:1 fails (nothing listens): no other holder: the file is named but missing
    env = k.env(0)
    assert env[ENV_STEP] == "7" and env[ENV_RESTORE] == os.path.join(k.node_dir.restore, "r1")
    assert not os.path.exists(env[ENV_RESTORE])
    k.close()


def test_a_failed_fetch_falls_back_to_another_holder_of_the_same_step(tmp_path):
    docs = {
        "0": {"v": 1, "addr": "10.0.0.1:5", "held": [[7, 0, 2, True, "slot", "/a/slots/0.0", False]]},
        "1": {"v": 1, "addr": "10.0.0.2:5", "held": [[7, 1, 2, True, "replica", "/b/replicas/r1", False],
                                                     [6, 1, 2, True, "slot", "/b/slots/0.0", False]]},
        "2": {"v": 1, "addr": "", "held": []},
    }
    calls = []

    def fetch(host, port, rank, step, dest, timeout, *, key, source=None):
        calls.append((host, rank, step))
        assert key == KEYS[{"10.0.0.1": "0", "10.0.0.2": "1"}[host]] and source == "10.0.0.3"
        if host == "10.0.0.1":
            return False  # the least-picked peer is gone
        open(dest, "wb").close()
        return True

    (tmp_path / "restore").mkdir()
    restore = R.RoundRestore(docs, "2", str(tmp_path / "restore"), 1.0, fetch=fetch, keys=KEYS, source="10.0.0.3")
    plan = restore.plan({"0": [0], "1": [1], "2": [2]}, 3)
    assert plan.step == 7 and plan.mine[2].node == "0"
    files = restore.gather(plan)
    assert files == {2: (str(tmp_path / "restore" / "r2"), R.PEER)}
    assert calls == [("10.0.0.1", 0, 7), ("10.0.0.2", 1, 7)]  # the same step from the other peer, never step 6


def test_a_step_no_holder_can_give_is_a_missing_file_never_another_step(tmp_path):
    docs = {"0": {"v": 1, "addr": "10.0.0.1:5", "held": [[7, 0, 2, True, "slot", "/a/slots/0.0", False]]},
            "1": {"v": 1, "addr": "", "held": []}}
    restore = R.RoundRestore(docs, "1", str(tmp_path), 1.0, fetch=lambda *a, **k: False, keys=KEYS)
    files = restore.gather(restore.plan({"0": [0], "1": [1]}, 2))
    assert files == {1: (str(tmp_path / "r1"), R.MISSING)}


def test_a_peer_that_published_no_key_is_never_fetched_from(tmp_path):
    docs = {"0": {"v": 1, "addr": "10.0.0.1:5", "held": [[7, 0, 2, True, "slot", "/a/slots/0.0", False]]},
            "1": {"v": 1, "addr": "", "held": []}}
    calls = []
    restore = R.RoundRestore(docs, "1", str(tmp_path), 1.0, fetch=lambda *a, **k: calls.append(a) or True,
                             keys={"0": b""})
    files = restore.gather(restore.plan({"0": [0], "1": [1]}, 2))
    assert files == {1: (str(tmp_path / "r1"), R.MISSING)} and calls == []


def test_own_persisted_file_of_the_step_is_the_fallback(tmp_path):
    pt = tmp_path / "rank_0_of_2.pt"
    pt.write_bytes(b"")
    docs = {"0": {"v": 1, "addr": "10.0.0.1:5", "held": [[7, 0, 2, True, "slot", "/a/slots/0.0", False]]},
            "1": {"v": 1, "addr": "", "held": [[7, 0, 2, True, "disk", str(pt), False]]}}
    restore = R.RoundRestore(docs, "1", str(tmp_path), 1.0, fetch=lambda *a, **k: False, keys=KEYS)
    files = restore.gather(restore.plan({"0": [0], "1": [1]}, 2))
    assert files == {1: (str(pt), R.DISK)}


def test_status_shows_each_nodes_newest_step_its_age_and_memory_held():
    from elaunch.rendezvous.dynamic.state import RendezvousState
    from elaunch.status import report

    s = RendezvousState(round=1, complete=True, participants={"a_1_0": 0, "b_2_0": 1})
    for node in s.participants:
        s.node_infos[node] = NodeInfo("10.0.0.1", "default", 1)
    records = {"a_1_0": {"step": 41, "time": 90.0, "bytes": 3 * 2**20, "at": 99.0}}
    doc = report.build(s, {}, backend="c10d", endpoint="h:1", run_id="j", now=100.0, dead_after=15.0,
                       checkpoints=records)
    assert [n["checkpoint"] for n in doc["nodes"]] == [{"step": 41, "age": 10.0, "bytes": 3 * 2**20}, None]
    lines = report.table(doc).splitlines()
    header = next(line for line in lines if line.startswith("NODE"))
    assert header.split()[-4:] == ["STEP", "STEP", "AGE", "SNAPSHOTS"]
    row0 = next(line for line in lines if line.startswith("0 "))
    assert row0.endswith("41    10.0 s    3.0 MiB"), row0
    plain = report.build(s, {}, backend="c10d", endpoint="h:1", run_id="j", now=100.0, dead_after=15.0)
    assert "STEP" not in report.table(plain)  # no columns for a job that keeps no snapshots


def test_a_new_agent_sweeps_node_directories_whose_agents_are_gone(tmp_path):
    import subprocess
    import sys

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True)
    dead = int(gone.stdout)  # exited and reaped
    live = snapshot_dir.NodeDir.create("other", os.getpid(), root=str(tmp_path))  # a live agent's
    stale = snapshot_dir.NodeDir.create("old", dead, root=str(tmp_path))
    foreign = tmp_path / f"elaunch-other-{dead}"  # not a node directory: no slots/replicas/restore
    foreign.mkdir()
    (tmp_path / "elaunch-bench-1795958730618671691").mkdir()  # ends in no pid (a nanosecond clock): left alone
    assert snapshot_dir.sweep(str(tmp_path)) == [stale.path]
    assert os.path.isdir(live.path) and foreign.is_dir() and not os.path.exists(stale.path)
    again = snapshot_dir.NodeDir.create("old", dead, root=str(tmp_path))
    snapshot_dir.NodeDir.create("new", 1, root=str(tmp_path))  # pid 1 lives: its creation sweeps the dead one
    assert not os.path.exists(again.path) and os.path.isdir(live.path)


def test_the_sweep_removes_progress_directories_whose_agents_are_gone(tmp_path):
    """An agent and its reaper killed together leave the workers' progress directory too."""
    import subprocess
    import sys

    from elaunch.procs.progress_files import ProgressFiles

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True)
    dead = int(gone.stdout)
    mine = ProgressFiles(range(2), base_dir=str(tmp_path))  # this live process's
    assert mine.directory.endswith(f"-{os.getpid()}")
    assert snapshot_dir._progress_dir(mine.directory)  # the sweep knows the files ProgressFiles makes
    left = tmp_path / f"elaunch-progress-x1y2-{dead}"
    left.mkdir()
    for name in ("progress_0", "stacks_0", "progress_11"):
        (left / name).write_bytes(b"")
    other = tmp_path / f"elaunch-progress-keep-{dead}"  # something else in it: not ours to judge
    other.mkdir()
    (other / "notes.txt").write_text("x")
    assert snapshot_dir.sweep(str(tmp_path)) == [str(left)]
    assert os.path.isdir(mine.directory) and other.is_dir()
    mine.close()


def test_the_status_record_is_published_every_few_seconds_one_write_at_a_time(tmp_path):
    import threading

    release, calls = threading.Event(), []

    class Slow(InMemoryJobChannel):
        def publish_node_record(self, kind, doc):
            calls.append(kind)
            release.wait(10)  # an unreachable backend holds the write

    now = [100.0]
    channel = Slow()
    k = CheckpointKeeper("job", 0, None, 60.0, lambda: channel, root=str(tmp_path), clock=lambda: now[0])
    k.open(Launcher(), AgentEvents(None, "n0", "host", 0))
    k.poll()
    now[0] += 1.0
    k.poll()  # too soon
    now[0] += 10.0
    k.poll()  # due, but the first write still hangs
    assert calls == ["checkpoint"]
    release.set()
    k._publishing.join(5)
    k.poll()
    wait = k._publishing
    wait.join(5)
    assert calls == ["checkpoint", "checkpoint"]
    k.close()


# -- resharding a torch.distributed.checkpoint step (SnapshotWriter's parts, flagged reshardable) ---------------

def write_part(path: str, step: int, rank: int, world_size: int) -> None:
    """A reshardable part of ``rank`` at ``step`` (the header as ``SnapshotWriter`` commits it; the meta is text)."""
    write_slot(path, step, rank=rank, world_size=world_size)
    fd = os.open(path, os.O_RDWR)
    try:
        import mmap

        with mmap.mmap(fd, os.fstat(fd).st_size) as buf:
            info = slotfile.parse(buf, path)
            seq = slotfile.begin(buf)
            slotfile.commit(buf, seq, step=step, rank=rank, world_size=world_size, replicated=False,
                            meta_len=info.meta_len, data_len=info.data_len, reshardable=True)
    finally:
        os.close(fd)
    assert slotfile.read_info(path).reshardable


def test_a_shrink_restores_each_local_rank_from_the_parts_in_its_nodes_memory(tmp_path):
    """World 4 saved step 5 (two nodes); the survivor alone holds its slots and the peer's replicas: world 2."""
    lines: list = []
    k = keeper(tmp_path, LocalJobChannel(), lines)
    shm = k.node_dir.path
    slots = [slotfile.slot_paths(shm, lr)[0] for lr in (0, 1)]
    for r in (0, 1):
        write_part(slots[r], 5, r, 4)
        write_part(os.path.join(shm, "replicas", f"r{r + 2}"), 5, r + 2, 4)
    write_part(slotfile.slot_paths(shm, 0)[1], 4, 0, 4)  # an older step of rank 0: not complete
    k.prepare(info(1, 0, 1, 2), workers(1, 2, 0), 2)
    assert k.env(0) == {ENV_SHM: shm, ENV_RESTORE: slots[0], ENV_STEP: "5"}
    assert k.env(1) == {ENV_SHM: shm, ENV_RESTORE: slots[1], ENV_STEP: "5"}
    (event,) = [json.loads(x) for x in lines if b"checkpoint_restore" in x]
    assert event["sources"] == {"0": "memory", "1": "memory"}
    k.close()


def _grow_docs(tmp_path, peer_parts=((0, "/a/slots/0.0"), (1, "/a/slots/1.0")), extra=()):
    return {"0": {"v": 2, "addr": "10.0.0.1:5", "held": [[5, r, 2, False, "slot", p, False, True]
                                                          for r, p in peer_parts]},
            "1": {"v": 2, "addr": "", "held": [list(e) for e in extra]}}


def test_a_grow_fetches_every_saved_rank_s_part_into_restore(tmp_path):
    calls = []

    def fetch(host, port, rank, step, dest, timeout, *, key, source=None):
        calls.append((host, rank, step, os.path.basename(dest)))
        open(dest, "wb").close()
        return True

    restore = R.RoundRestore(_grow_docs(tmp_path), "1", str(tmp_path), 1.0, fetch=fetch, keys=KEYS)
    plan = restore.plan({"0": [0, 1], "1": [2, 3]}, 4)
    assert plan.step == 5 and plan.saved_world_size == 2
    files = restore.gather(plan)
    assert calls == [("10.0.0.1", 0, 5, "s0"), ("10.0.0.1", 1, 5, "s1")]  # the whole step, by saved rank
    assert files == {2: (str(tmp_path / "s0"), R.PEER), 3: (str(tmp_path / "s1"), R.PEER)}


def test_a_part_a_holder_cannot_give_comes_from_another_holder_of_it(tmp_path):
    docs = _grow_docs(tmp_path)
    docs["2"] = {"v": 2, "addr": "10.0.0.3:5", "held": [[5, 1, 2, False, "replica", "/c/replicas/r1", False, True]]}
    calls = []

    def fetch(host, port, rank, step, dest, timeout, *, key, source=None):
        calls.append((host, rank))
        if (host, rank) == ("10.0.0.3", 1):
            return False  # the least-picked holder of part 1 is gone
        open(dest, "wb").close()
        return True

    restore = R.RoundRestore(docs, "1", str(tmp_path), 1.0, fetch=fetch, keys=KEYS)
    files = restore.gather(restore.plan({"0": [0], "1": [1], "2": [2]}, 3))
    assert calls == [("10.0.0.1", 0), ("10.0.0.3", 1), ("10.0.0.1", 1)]
    assert files == {1: (str(tmp_path / "s1"), R.PEER)}


def test_a_part_no_holder_can_give_is_read_from_this_nodes_dcp_directory_else_missing(tmp_path):
    d = tmp_path / "dcp" / "step_000000000005"
    d.mkdir(parents=True)
    own_dir = (5, 0, 0, False, "disk", str(d), False, True)
    restore = R.RoundRestore(_grow_docs(tmp_path, extra=[own_dir]), "1", str(tmp_path), 1.0,
                             fetch=lambda *a, **k: False, keys=KEYS)
    plan = restore.plan({"0": [0, 1], "1": [2, 3]}, 4)
    assert plan.parts  # memory holds every part: the plan gathers; the fetch fails, the directory serves
    assert restore.gather(plan) == {2: (str(d), R.DISK), 3: (str(d), R.DISK)}
    restore = R.RoundRestore(_grow_docs(tmp_path), "1", str(tmp_path), 1.0, fetch=lambda *a, **k: False, keys=KEYS)
    files = restore.gather(restore.plan({"0": [0, 1], "1": [2, 3]}, 4))
    assert files == {2: (str(tmp_path / "r2"), R.MISSING), 3: (str(tmp_path / "r3"), R.MISSING)}


def test_a_step_memory_lacks_a_part_of_is_restored_from_the_persisted_dcp_directory(tmp_path):
    """Only rank 0's part survived in memory; the newest complete DCP directory in --checkpoint-dir serves."""
    lines: list = []
    k = keeper(tmp_path, LocalJobChannel(), lines)
    ckpt_dir = tmp_path / "ckpt"
    done, torn = ckpt_dir / "dcp" / "step_000000000005", ckpt_dir / "dcp" / "step_000000000006"
    for d in (done, torn):
        d.mkdir(parents=True)
        (d / "__0_0.distcp").write_bytes(b"x")
    (done / ".metadata").write_bytes(b"m")  # step 6 has no .metadata: not complete
    k._ckpt_dir = str(ckpt_dir)  # after open(): no persister process for this test
    write_part(slotfile.slot_paths(k.node_dir.path, 0)[0], 5, 0, 2)
    k.prepare(info(1, 0, 1, 2), workers(1, 2, 0), 2)
    assert k.env(0)[ENV_RESTORE] == k.env(1)[ENV_RESTORE] == str(done) and k.env(0)[ENV_STEP] == "5"
    (event,) = [json.loads(x) for x in lines if b"checkpoint_restore" in x]
    assert event["sources"] == {"0": "disk", "1": "disk"}
    k._ckpt_dir = None
    k.close()
