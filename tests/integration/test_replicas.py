"""The replica service (``checkpoint.replicas``) with real children, real TCP on loopback and real slot files.

A committed slot on one node appears bit-identical as ``replicas/r<rank>`` on its
successor; a newer commit replaces it, an older one never does, and a slot whose
write began during the send never becomes a replica. ``fetch`` gets a replica (or
a local slot) from a peer and refuses what the peer does not have. A SIGKILLed
child is restarted by ``check()`` and serves again; ``close()`` leaves no process.
"""

from __future__ import annotations

import os
import signal
import socket
import threading
import time

import psutil
import pytest

from elaunch.checkpoint import slotfile
from elaunch.checkpoint._replica_child import superseded
from elaunch.checkpoint.replicas import ReplicaService, fetch
from tests.conftest import wait_for
from tests.slots import KEY, node, shm, write_slot  # noqa: F401 - fixtures

DEADLINE = 20.0  #: seconds a copy may take to appear (the machine is shared and noisy)
BIG = os.urandom(1 << 20) * 256  #: 256 MiB of data: a send long enough to be caught in the middle


def read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def replica_step(node_dir: str, rank: int = 0) -> int | None:
    info = slotfile.read_info(os.path.join(node_dir, "replicas", f"r{rank}"))
    return None if info is None else info.step


def counted(service: ReplicaService, name: str, at_least: int = 1) -> bool:
    return service.stats()[name] >= at_least


def queued_at(port: int) -> int:
    """Bytes waiting unread in the established TCP sockets whose local port is ``port`` (/proc/net/tcp)."""
    total = 0
    with open("/proc/net/tcp") as f:
        for line in f.readlines()[1:]:
            fields = line.split()
            if int(fields[1].split(":")[1], 16) == port and fields[3] == "01":
                total += int(fields[4].split(":")[1], 16)
    return total


def test_a_committed_slot_appears_on_the_successor_and_a_newer_one_replaces_it(node):
    a_dir, a = node("a")
    b_dir, b = node("b")
    a.set_ring([("127.0.0.1", b.port, KEY)])
    slot0, slot1 = slotfile.slot_paths(a_dir, 0)
    write_slot(slot0, 1, os.urandom(1 << 20))
    wait_for(lambda: replica_step(b_dir) == 1, DEADLINE, what="step 1's replica on b")
    replica = os.path.join(b_dir, "replicas", "r0")
    assert read(replica) == read(slot0)
    assert os.stat(replica).st_mode & 0o777 == 0o600
    assert b.held() == os.path.getsize(slot0)
    write_slot(slot1, 2, os.urandom(3 << 20))
    wait_for(lambda: replica_step(b_dir) == 2, DEADLINE, what="step 2's replica on b")
    assert read(replica) == read(slot1)
    # no receipt left behind; step 1's copy stays beside it, as the slots keep the step before
    assert sorted(os.listdir(os.path.join(b_dir, "replicas"))) == ["r0", "r0.prev"]
    assert read(replica + ".prev") == read(slot0)
    assert a.stats()["sent"] == 2 and b.stats()["received"] == 2


def test_a_node_killed_between_its_ranks_copies_of_a_step_leaves_the_step_before_whole(node, shm):
    # a's two ranks reach step 2, but only rank 0's copy of it is sent before a dies: b still has
    # step 1 of both ranks (rank 0's as the copy its step 2 replaced), and serves it
    a_dir, a = node("a")
    b_dir, b = node("b")
    a.set_ring([("127.0.0.1", b.port, KEY)])
    first = {r: os.urandom(1 << 20) for r in (0, 1)}
    for r in (0, 1):
        write_slot(slotfile.slot_paths(a_dir, r)[0], 1, first[r], rank=r, world_size=2)
    wait_for(lambda: replica_step(b_dir, 0) == 1 and replica_step(b_dir, 1) == 1, DEADLINE, what="step 1's copies")
    write_slot(slotfile.slot_paths(a_dir, 0)[1], 2, os.urandom(1 << 20), rank=0, world_size=2)
    wait_for(lambda: replica_step(b_dir, 0) == 2, DEADLINE, what="rank 0's step 2 on b")
    a.close()  # a is gone before rank 1's step 2 existed
    held = {(i.rank, i.step) for i in slotfile.inventory(b_dir, ("replicas",))}
    assert held == {(0, 2), (0, 1), (1, 1)}
    restore = os.path.join(shm, "restore")
    os.mkdir(restore)
    for r in (0, 1):
        dest = os.path.join(restore, str(r))
        assert fetch("127.0.0.1", b.port, r, 1, dest, timeout=10, key=KEY)
        assert read(dest)[-len(first[r]):] == first[r]


def test_of_replicated_state_one_copy_goes_out_per_node(node):
    a_dir, a = node("a")
    b_dir, b = node("b")
    for local, rank in ((0, 5), (1, 4)):  # DDP: the same state on both; any rank's serves any rank
        write_slot(slotfile.slot_paths(a_dir, local)[0], 1, b"same" * 1000, rank=rank, replicated=True)
    sharded = slotfile.slot_paths(a_dir, 2)
    write_slot(sharded[0], 1, os.urandom(1 << 16), rank=6)
    a.set_ring([("127.0.0.1", b.port, KEY)])
    wait_for(lambda: replica_step(b_dir, 4) == 1 and replica_step(b_dir, 6) == 1, DEADLINE, what="r4 and r6 on b")
    write_slot(sharded[1], 2, os.urandom(1 << 16), rank=6)  # a's sender has looked at rank 5 since
    wait_for(lambda: replica_step(b_dir, 6) == 2, DEADLINE, what="r6's step 2 on b")
    # one copy of the replicated state (r4, not r5); the sharded rank's step 1 kept beside its step 2
    assert sorted(os.listdir(os.path.join(b_dir, "replicas"))) == ["r4", "r6", "r6.prev"]


def test_replicated_state_is_not_copied_to_a_node_whose_own_workers_saved_that_step(node):
    """DDP: b's own ranks saved the step a offers (or commit it within the grace): b can serve it already,
    so nothing is sent; a step b lacks is still sent, and sharded state always is."""
    a_dir, a = node("a")
    b_dir, b = node("b")
    write_slot(slotfile.slot_paths(b_dir, 0)[0], 3, b"same" * 1000, rank=1, replicated=True)
    write_slot(slotfile.slot_paths(a_dir, 0)[0], 3, b"same" * 1000, rank=0, replicated=True)
    a.set_ring([("127.0.0.1", b.port, KEY)])
    wait_for(lambda: counted(b, "own"), DEADLINE, what="b declining step 3 as its own")
    write_slot(slotfile.slot_paths(a_dir, 0)[1], 4, b"same" * 1000, rank=0, replicated=True)
    write_slot(slotfile.slot_paths(b_dir, 0)[1], 4, b"same" * 1000, rank=1, replicated=True)  # within the grace
    wait_for(lambda: counted(b, "own", 2), DEADLINE, what="b declining step 4 as its own")
    write_slot(slotfile.slot_paths(a_dir, 0)[0], 9, b"same" * 1000, rank=0, replicated=True)  # b stays at 4
    wait_for(lambda: replica_step(b_dir, 0) == 9, DEADLINE, what="step 9's replica on b")
    write_slot(slotfile.slot_paths(a_dir, 1)[0], 4, os.urandom(1 << 16), rank=7)  # sharded: b has no rank 7
    wait_for(lambda: replica_step(b_dir, 7) == 4, DEADLINE, what="r7 on b")
    assert b.stats()["own"] == 2 and b.stats()["received"] == 2
    assert sorted(os.listdir(os.path.join(b_dir, "replicas"))) == ["r0", "r7"]


def test_replicas_of_replicated_state_a_newer_snapshot_supersedes_are_removed(node):
    """Each round whose ring changed can leave a full copy of replicated state under another ``r<rank>``;
    once this node holds a newer replicated snapshot, no restore can choose those, and they go. Sharded
    replicas, and replicated ones at least as new as anything the node holds, stay."""
    a_dir, a = node("a")
    b_dir, b = node("b")
    c_dir, c = node("c")
    write_slot(slotfile.slot_paths(a_dir, 0)[0], 5, b"same" * 1000, rank=0, replicated=True)
    write_slot(slotfile.slot_paths(a_dir, 1)[0], 5, os.urandom(1 << 16), rank=3)  # sharded
    a.set_ring([("127.0.0.1", c.port, KEY)])
    wait_for(lambda: replica_step(c_dir, 0) == 5 and replica_step(c_dir, 3) == 5, DEADLINE, what="r0 and r3 on c")
    a.set_ring([])
    write_slot(slotfile.slot_paths(b_dir, 0)[0], 8, b"same" * 1000, rank=4, replicated=True)  # the next round
    b.set_ring([("127.0.0.1", c.port, KEY)])
    wait_for(lambda: replica_step(c_dir, 4) == 8, DEADLINE, what="r4 on c")
    wait_for(lambda: replica_step(c_dir, 0) is None, DEADLINE, what="r0 (step 5) pruned: r4 holds step 8")
    b.set_ring([])
    write_slot(slotfile.slot_paths(c_dir, 0)[0], 9, b"same" * 1000, rank=1, replicated=True)  # c's own, newer
    wait_for(lambda: replica_step(c_dir, 4) is None, DEADLINE, what="r4 (step 8) pruned: c's own slot holds step 9")
    assert sorted(os.listdir(os.path.join(c_dir, "replicas"))) == ["r3"]  # sharded: kept
    assert c.stats()["pruned"] == 2
    assert slotfile.read_info(slotfile.slot_paths(c_dir, 0)[0]).step == 9  # slots are never pruned


def test_superseded_names_only_replicated_replicas_older_than_the_newest_replicated_snapshot(shm):
    node_dir = os.path.join(shm, "n")
    for sub in ("slots", "replicas"):
        os.makedirs(os.path.join(node_dir, sub))
    rep = os.path.join(node_dir, "replicas")
    write_slot(os.path.join(rep, "r0"), 5, b"x" * 100, rank=0, replicated=True)
    write_slot(os.path.join(rep, "r3"), 2, b"x" * 100, rank=3)  # sharded, older: kept
    write_slot(os.path.join(rep, "r4"), 8, b"x" * 100, rank=4, replicated=True)
    write_slot(slotfile.slot_paths(node_dir, 0)[0], 7, b"x" * 100, rank=1, replicated=True)
    write_slot(slotfile.slot_paths(node_dir, 0)[1], 3, b"x" * 100, rank=1, replicated=True)  # an old own slot
    write_slot(os.path.join(rep, "r8"), 1, b"x" * 100, rank=8, replicated=True, commit=False)  # under way
    assert superseded(node_dir) == [os.path.join(rep, "r0")]  # r4 (step 8) is newer than the node's own step 7
    write_slot(slotfile.slot_paths(node_dir, 0)[1], 9, b"x" * 100, rank=1, replicated=True)
    assert sorted(superseded(node_dir)) == [os.path.join(rep, "r0"), os.path.join(rep, "r4")]
    assert superseded(os.path.join(shm, "none")) == []


def test_each_successor_of_the_ring_gets_a_copy_until_the_ring_leaves_it_out(node):
    a_dir, a = node("a")
    b_dir, b = node("b")
    c_dir, c = node("c")
    slot0, slot1 = slotfile.slot_paths(a_dir, 0)
    write_slot(slot0, 1, os.urandom(1 << 16))
    a.set_ring([("127.0.0.1", b.port, KEY), ("127.0.0.1", c.port, KEY)])  # --checkpoint-replicas=2
    wait_for(lambda: replica_step(b_dir) == 1 and replica_step(c_dir) == 1, DEADLINE, what="copies on b and c")
    a.set_ring([("127.0.0.1", c.port, KEY)])  # the next round: b is no successor any more
    write_slot(slot1, 2, os.urandom(1 << 16))
    wait_for(lambda: replica_step(c_dir) == 2, DEADLINE, what="step 2 on c")
    write_slot(slot0, 3, os.urandom(1 << 16))
    wait_for(lambda: replica_step(c_dir) == 3, DEADLINE, what="step 3 on c")  # a has looked at b's link since
    assert replica_step(b_dir) == 1 and b.stats()["received"] == 1


def test_an_older_snapshot_never_replaces_a_newer_replica(node):
    a_dir, a = node("a")
    b_dir, b = node("b")
    c_dir, c = node("c")
    write_slot(slotfile.slot_paths(a_dir, 0)[0], 5, os.urandom(1 << 16))
    a.set_ring([("127.0.0.1", b.port, KEY)])
    wait_for(lambda: replica_step(b_dir) == 5, DEADLINE, what="step 5's replica on b")
    newer = read(os.path.join(b_dir, "replicas", "r0"))
    write_slot(slotfile.slot_paths(c_dir, 0)[0], 3, os.urandom(1 << 16))  # rank 0 again, an older step
    c.set_ring([("127.0.0.1", b.port, KEY)])
    wait_for(lambda: counted(c, "skipped") or counted(c, "sent") or counted(b, "discarded"), DEADLINE,
             what="b's answer to c's older snapshot")
    assert read(os.path.join(b_dir, "replicas", "r0")) == newer
    assert c.stats()["sent"] == 0


def test_a_slot_whose_write_began_before_the_send_never_becomes_a_replica(node):
    a_dir, a = node("a")
    b_dir, b = node("b")
    slot0, slot1 = slotfile.slot_paths(a_dir, 0)
    write_slot(slot0, 1, os.urandom(1 << 20))
    a.set_ring([("127.0.0.1", b.port, KEY)])
    wait_for(lambda: replica_step(b_dir) == 1, DEADLINE, what="step 1's replica on b")
    old = read(os.path.join(b_dir, "replicas", "r0"))
    os.kill(b.pid, signal.SIGSTOP)  # b answers nothing: a's offer of step 2 waits for b's go
    try:
        write_slot(slot1, 2, os.urandom(1 << 20))
        wait_for(lambda: queued_at(b.port) > 0, DEADLINE, what="a's offer of step 2 queued at b")
        write_slot(slot1, 3, os.urandom(1 << 20), commit=False)  # the worker begins a new write in it
    finally:
        os.kill(b.pid, signal.SIGCONT)
    wait_for(lambda: counted(b, "discarded") and counted(a, "torn"), DEADLINE, what="b discarding the torn copy")
    assert read(os.path.join(b_dir, "replicas", "r0")) == old and replica_step(b_dir) == 1
    write_slot(slot1, 3, os.urandom(1 << 20))  # the write commits: that one is sent
    wait_for(lambda: replica_step(b_dir) == 3, DEADLINE, what="step 3's replica on b")
    assert read(os.path.join(b_dir, "replicas", "r0")) == read(slot1)


def receipts(node_dir: str, sub: str = "replicas") -> list[str]:
    return [n for n in os.listdir(os.path.join(node_dir, sub)) if n.startswith(".")]


def header_received(node_dir: str) -> bool:
    """True once a receipt in ``replicas/`` has its header (magic and an even seq)."""
    for name in receipts(node_dir):
        try:
            with open(os.path.join(node_dir, "replicas", name), "rb") as f:
                head = f.read(16)
        except OSError:
            continue
        if head[:8] == slotfile.MAGIC and slotfile.seq_of(head) % 2 == 0:
            return True
    return False


def test_a_slot_whose_write_began_during_the_send_never_becomes_a_replica(node):
    """The header and meta went out whole before the write began: only the end mark tells the copy is torn."""
    a_dir, a = node("a")
    b_dir, b = node("b")
    slot0, slot1 = slotfile.slot_paths(a_dir, 0)
    write_slot(slot0, 1, os.urandom(1 << 16))
    a.set_ring([("127.0.0.1", b.port, KEY)])
    wait_for(lambda: replica_step(b_dir) == 1, DEADLINE, what="step 1's replica on b")
    old = read(os.path.join(b_dir, "replicas", "r0"))
    write_slot(slot1, 2, BIG)
    wait_for(lambda: header_received(b_dir), DEADLINE, interval=0.001, what="b receiving step 2")
    os.kill(b.pid, signal.SIGSTOP)  # a's send stalls in the middle (b's buffers fill)
    try:
        assert receipts(b_dir), "b received step 2 whole before it could be stopped: make BIG bigger"
        write_slot(slot1, 3, BIG[::-1], commit=False)  # the worker begins a new write in it
    finally:
        os.kill(b.pid, signal.SIGCONT)
    wait_for(lambda: counted(b, "discarded") or counted(b, "received", 2), 60, what="b's verdict on step 2")
    assert read(os.path.join(b_dir, "replicas", "r0")) == old and not receipts(b_dir)
    wait_for(lambda: counted(a, "torn") or counted(a, "sent", 2), DEADLINE, what="a hearing b's verdict")
    assert b.stats()["discarded"] == 1 and a.stats()["torn"] == 1


def test_fetch_gets_a_replica_or_a_local_slot_and_nothing_else(node, shm, caplog):
    a_dir, a = node("a")
    b_dir, b = node("b")
    slot0 = slotfile.slot_paths(a_dir, 0)[0]
    write_slot(slot0, 7, os.urandom(1 << 20), rank=3)
    a.set_ring([("127.0.0.1", b.port, KEY)])
    wait_for(lambda: replica_step(b_dir, 3) == 7, DEADLINE, what="the replica on b")
    restore = os.path.join(shm, "restore")
    os.mkdir(restore)
    dest = os.path.join(restore, "3")
    assert fetch("127.0.0.1", b.port, 3, 7, dest, timeout=10, key=KEY)
    assert read(dest) == read(slot0) and os.stat(dest).st_mode & 0o777 == 0o600
    os.unlink(dest)
    assert fetch("127.0.0.1", a.port, 3, 7, dest, timeout=10, key=KEY)  # a serves its own slot
    assert read(dest) == read(slot0)
    os.unlink(dest)
    assert not fetch("127.0.0.1", b.port, 3, 8, dest, timeout=10, key=KEY)  # no such step
    assert not fetch("127.0.0.1", b.port, 2, 7, dest, timeout=10, key=KEY)  # no such rank
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        port = unused.getsockname()[1]
    assert not fetch("127.0.0.1", port, 3, 7, dest, timeout=10, key=KEY)  # nobody there
    assert os.listdir(restore) == []


def test_a_fetch_whose_peer_dies_in_the_middle_fails_and_leaves_nothing(node, shm):
    a_dir, a = node("a")
    write_slot(slotfile.slot_paths(a_dir, 0)[0], 4, BIG)
    restore = os.path.join(shm, "restore")
    os.mkdir(restore)
    result = []
    thread = threading.Thread(target=lambda: result.append(fetch("127.0.0.1", a.port, 0, 4,
                                                                 os.path.join(restore, "r0"), timeout=60, key=KEY)))
    thread.start()
    try:
        wait_for(lambda: os.listdir(restore), DEADLINE, interval=0.001, what="the fetch receiving")
        os.kill(a.pid, signal.SIGKILL)
    finally:
        thread.join(60)
    assert result == [False] and os.listdir(restore) == []


def test_a_killed_child_is_restarted_by_check_and_serves_again(node, shm):
    a_dir, a = node("a")
    b_dir, b = node("b")
    slot0, slot1 = slotfile.slot_paths(a_dir, 0)
    write_slot(slot0, 1, os.urandom(1 << 16))
    a.set_ring([("127.0.0.1", b.port, KEY)])
    wait_for(lambda: replica_step(b_dir) == 1, DEADLINE, what="step 1's replica on b")
    for service in (b, a):  # the receiver, then the sender (whose ring must be handed over again)
        pid = service.pid
        assert not service.check()
        os.kill(pid, signal.SIGKILL)
        wait_for(lambda: psutil.Process(pid).status() == psutil.STATUS_ZOMBIE, 10, what="the child's death")
        service.set_ring([("127.0.0.1", b.port, KEY)] if service is a else [])  # to a dead child: no error
        wait_for(service.check, 10, what="the child's restart")  # its threads go, then the kernel reports it
        assert service.pid not in (None, pid)
    port = b.port
    write_slot(slot1, 2, os.urandom(1 << 16))
    wait_for(lambda: replica_step(b_dir) == 2, DEADLINE, what="step 2's replica on b after the restarts")
    dest = os.path.join(shm, "fetched")
    assert b.port == port and fetch("127.0.0.1", port, 0, 2, dest, timeout=10, key=KEY)
    assert read(dest) == read(slot1)


def test_once_its_restarts_are_spent_the_service_is_off_without_an_error(shm, caplog):
    node_dir = os.path.join(shm, "a")
    service = ReplicaService(node_dir, "127.0.0.1", restarts=1, key=KEY)
    try:
        port = service.start()
        for _ in range(2):
            pid = service.pid
            os.kill(pid, signal.SIGKILL)
            wait_for(lambda: service.check() or service.pid is None, 10, what="the child's restart or end")
        assert "replica service (pid %d) was killed by SIGKILL; peers' copies" % pid in caplog.text
        assert service.pid is None and not service.check() and service.private_fds() == ()
        service.set_ring([("127.0.0.1", 1, KEY)])  # nothing to tell: no error
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=5).close()
    finally:
        service.close()


def test_close_leaves_no_process_and_refuses_peers(node):
    _, a = node("a")
    pid, port = a.pid, a.port
    a.close()
    assert a.pid is None and not psutil.pid_exists(pid)
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
    a.close()  # idempotent


def test_throughput_of_a_256_mib_snapshot_over_loopback(node, shm):
    """Not a speed check (the machine is shared): prints the copy's and the fetch's rates for the report."""
    a_dir, a = node("a")
    b_dir, b = node("b")
    a.set_ring([("127.0.0.1", b.port, KEY)])
    t0 = time.monotonic()
    write_slot(slotfile.slot_paths(a_dir, 0)[0], 1, BIG)
    t1 = time.monotonic()
    wait_for(lambda: replica_step(b_dir) == 1, 120, interval=0.005, what="the 256 MiB replica")
    t2 = time.monotonic()
    assert fetch("127.0.0.1", b.port, 0, 1, os.path.join(shm, "fetched"), timeout=120, key=KEY)
    t3 = time.monotonic()
    mib = os.path.getsize(os.path.join(b_dir, "replicas", "r0")) / (1 << 20)
    print(f"\n{mib:.0f} MiB slot: written in {t1 - t0:.3f} s; on the successor {t2 - t1:.3f} s after the commit "
          f"({mib / (t2 - t1):.0f} MiB/s, up to {0.05:.2f} s of it the sender's scan period); "
          f"fetched in {t3 - t2:.3f} s ({mib / (t3 - t2):.0f} MiB/s)")
