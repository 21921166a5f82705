"""The checkpoint persister (``checkpoint.persister``) with real savers, a real child and real files in /dev/shm.

Savers (``tests/scripts/ckpt_saver.py``) commit snapshots into a node directory with
``elaunch.checkpoint.save``; the persister's child writes them to a checkpoint
directory, which plain ``torch.load`` reads back bit for bit. A rank one step ahead
is not persisted ahead of its peers; a child killed in the middle of a write leaves
the previous checkpoint whole; a dead child is restarted by ``check()``; ``close()``
lets a write finish and reaps the child.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid

import psutil
import pytest

from elaunch.procs.helper_process import HelperDied
from elaunch.checkpoint.persister import Persister
from tests.conftest import SCRIPTS, wait_for

torch = pytest.importorskip("torch")
from elaunch.checkpoint import persisted  # noqa: E402 - after the torch check

_spec = importlib.util.spec_from_file_location("ckpt_saver", SCRIPTS / "ckpt_saver.py")
saver_module = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(saver_module)
make_state = saver_module.make_state

READY = 60.0  #: seconds for a child or saver to import torch on a busy 2-core machine


@pytest.fixture
def dirs():
    """``(node_dir, ckpt_dir)`` under a fresh /dev/shm directory, removed afterwards."""
    root = f"/dev/shm/elaunch-test-persister-{uuid.uuid4().hex[:8]}"
    os.makedirs(os.path.join(root, "node", "slots"), mode=0o700)
    yield os.path.join(root, "node"), os.path.join(root, "ckpt")
    shutil.rmtree(root, ignore_errors=True)


class Saver:
    """One worker process saving into the node directory when told (``save(step)``)."""

    def __init__(self, node_dir: str, local_rank: int, rank: int, world_size: int, mib: float, sharded: bool,
                 marker: bool = False):
        env = dict(os.environ, ELAUNCH_CHECKPOINT_SHM=node_dir, LOCAL_RANK=str(local_rank), RANK=str(rank),
                   WORLD_SIZE=str(world_size), OMP_NUM_THREADS="1")
        argv = [sys.executable, str(SCRIPTS / "ckpt_saver.py"), str(mib), *(["sharded"] if sharded else []),
                *(["marker"] if marker else [])]
        self.rank, self.mib = rank, mib
        self.proc = subprocess.Popen(argv, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def ready(self) -> None:
        assert self.proc.stdout.readline().strip() == "ready"

    def save(self, *steps: int) -> None:
        for step in steps:
            self.proc.stdin.write(f"save {step}\n")
            self.proc.stdin.flush()
            assert self.proc.stdout.readline().strip() == f"saved {step}"

    def close(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def savers(dirs):
    """``start((local_rank, rank, world_size), ..., mib=1, sharded=False, marker=False)`` -> ready :class:`Saver` s."""
    made: list[Saver] = []

    def start(*ranks: tuple[int, int, int], mib: float = 1.0, sharded: bool = False, marker: bool = False):
        new = [Saver(dirs[0], lr, r, w, mib, sharded, marker) for lr, r, w in ranks]
        made.extend(new)
        for s in new:
            s.ready()
        return new

    yield start
    for s in made:
        s.close()


@pytest.fixture
def persister(dirs):
    """``make(interval=0)`` -> a started :class:`Persister` over ``dirs``, its child past its imports; closed after."""
    made: list[Persister] = []

    def make(interval: float = 0.0) -> Persister:
        p = Persister(dirs[0], dirs[1], interval)
        made.append(p)
        p.start()
        assert p.persist_now(wait=READY) is None  # answered: torch is imported; nothing saved yet
        return p

    yield make
    for p in made:
        p.close()


def same_bits(a, b) -> bool:
    """True when ``a`` and ``b`` are the same state: containers, leaves, and every tensor's dtype, shape and bytes."""
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)))
    if isinstance(a, dict):
        return type(a) is type(b) and list(a) == list(b) and all(same_bits(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(same_bits, a, b))
    return type(a) is type(b) and a == b


def files_of(ckpt_dir: str) -> dict[int, list[str]]:
    """``{step: sorted file names}`` under ``ckpt_dir``, temporary files included."""
    return {step: sorted(os.listdir(persisted.step_dir(ckpt_dir, step)))
            for step in persisted.steps_on_disk(ckpt_dir)}


def loads_as(path: str, step: int, rank: int, world_size: int, mib: float, replicated: bool = True) -> bool:
    """True when plain ``torch.load`` of ``path`` gives exactly the saver's state of ``step``."""
    got = torch.load(path)  # torch alone, its defaults (weights_only)
    return (got["step"], got["rank"], got["world_size"], got["replicated"]) == (step, rank, world_size, replicated) \
        and same_bits(got["state"], make_state(step, rank, mib))


def test_the_agent_side_imports_no_torch():
    code = "import elaunch.checkpoint.persister, sys; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_committed_step_is_persisted_within_the_interval(dirs, savers, persister):
    interval = 1.0
    p = persister(interval)
    [s] = savers((0, 0, 1))
    s.save(1)
    saved = time.monotonic()
    wait_for(lambda: persisted.newest_complete(dirs[1]), interval + 5.0, what="step 1 persisted without asking")
    assert time.monotonic() - saved < interval + 5.0
    [(step, path, seconds)] = wait_for(p.poll_done, 5.0, what="the done report")
    assert (step, path) == (1, persisted.step_dir(dirs[1], 1)) and 0 < seconds < interval + 5.0
    assert loads_as(persisted.rank_file(dirs[1], 1, 0, 1), 1, 0, 1, s.mib)
    s.save(2)
    wait_for(lambda: persisted.newest_complete(dirs[1])[0] == 2, interval + 5.0, what="step 2 persisted")
    assert p.poll_done()[-1][0] == 2


def test_persist_now_returns_the_step_and_torch_loads_it_bit_identically(dirs, savers, persister):
    p = persister()
    assert psutil.Process(p.pid).nice() == 10  # training keeps the CPU
    a, b = savers((0, 4, 8), (1, 5, 8))  # replicated: one file per node, its lowest global rank's
    a.save(1, 2)
    b.save(1, 2)
    assert p.persist_now(wait=READY) == 2
    assert files_of(dirs[1]) == {2: ["rank_4_of_8.pt"]}
    assert loads_as(persisted.rank_file(dirs[1], 2, 4, 8), 2, 4, 8, a.mib)
    assert persisted.newest_complete(dirs[1])[0] == 2
    assert p.persist_now(wait=READY) is None  # nothing new
    assert [d[0] for d in p.poll_done()] == [2]


def test_a_rank_ahead_of_its_peers_is_persisted_at_the_step_all_hold(dirs, savers, persister):
    p = persister()
    a, b = savers((0, 0, 2), (1, 1, 2), sharded=True)
    a.save(1, 2, 3)
    b.save(1, 2)  # b is still computing step 3
    assert p.persist_now(wait=READY) == 2
    assert files_of(dirs[1]) == {2: ["rank_0_of_2.pt", "rank_1_of_2.pt"]}
    for s in (a, b):
        assert loads_as(persisted.rank_file(dirs[1], 2, s.rank, 2), 2, s.rank, 2, s.mib, replicated=False)
    b.save(3)
    assert p.persist_now(wait=READY) == 3
    assert sorted(files_of(dirs[1])) == [2, 3]  # the previous checkpoint stays
    a.save(4)
    b.save(4)
    assert p.persist_now(wait=READY) == 4
    assert sorted(files_of(dirs[1])) == [3, 4]  # ... until a newer one is complete
    assert loads_as(persisted.rank_file(dirs[1], 4, 1, 2), 4, 1, 2, b.mib, replicated=False)


def temporary_file(ckpt_dir: str, step: int) -> str | None:
    try:
        names = os.listdir(persisted.step_dir(ckpt_dir, step))
    except FileNotFoundError:
        return None
    return next((n for n in names if n.startswith(".") and ".tmp-" in n), None)


def test_a_child_killed_mid_write_leaves_the_previous_checkpoint_whole(dirs, savers, persister):
    p = persister()
    [s] = savers((0, 0, 1), mib=256)
    s.save(1)
    assert p.persist_now(wait=READY) == 1
    s.save(2)
    p.persist_now()
    wait_for(lambda: temporary_file(dirs[1], 2), READY, interval=0.001, what="step 2's write under way")
    os.kill(p.pid, signal.SIGKILL)
    assert files_of(dirs[1])[1] == ["rank_0_of_1.pt"]
    assert not os.path.exists(persisted.rank_file(dirs[1], 2, 0, 1)), "the write was over before the kill"
    assert persisted.newest_complete(dirs[1])[0] == 1  # the temporary file is not a checkpoint
    assert loads_as(persisted.rank_file(dirs[1], 1, 0, 1), 1, 0, 1, s.mib)
    wait_for(lambda: p.check(), 10, what="the child restarted")
    assert p.persist_now(wait=READY) == 2
    assert loads_as(persisted.rank_file(dirs[1], 2, 0, 1), 2, 0, 1, s.mib)
    assert files_of(dirs[1]) == {1: ["rank_0_of_1.pt"], 2: ["rank_0_of_1.pt"]}  # the dead writer's temporary went


def test_a_dead_child_is_restarted_by_check_until_the_budget_is_spent(dirs, savers, persister):
    p = persister()
    [s] = savers((0, 0, 1))
    pids = [p.pid]
    for n in range(3):
        os.kill(p.pid, signal.SIGKILL)
        wait_for(lambda: p.check(), 10, what="the child restarted")
        assert p.pid not in pids
        pids.append(p.pid)
        s.save(n)
        assert p.persist_now(wait=READY) == n  # the new child persists
    os.kill(p.pid, signal.SIGKILL)
    with pytest.raises(HelperDied, match=r"^checkpoint persister \(pid \d+\) was killed by SIGKILL$"):
        wait_for(lambda: p.check(), 10, what="the child reported")
    assert all(not psutil.pid_exists(pid) for pid in pids)


def test_close_lets_a_write_finish_and_reaps_the_child(dirs, savers, persister):
    p = persister()
    [s] = savers((0, 0, 1), mib=256)
    s.save(1)
    p.persist_now()
    wait_for(lambda: temporary_file(dirs[1], 1), READY, interval=0.001, what="step 1's write under way")
    pid = p.pid
    p.close()
    assert not psutil.pid_exists(pid)  # reaped: not even a zombie
    assert files_of(dirs[1]) == {1: ["rank_0_of_1.pt"]}  # finished, not torn or left as a temporary
    assert loads_as(persisted.rank_file(dirs[1], 1, 0, 1), 1, 0, 1, s.mib)
    assert [d[0] for d in p.poll_done()] in ([], [1]) and p.pid is None
    p.close()  # idempotent


def _commit(node_dir: str, local_rank: int, n: int, step: int, rank: int, world: int, replicated: bool,
            stamp: float) -> None:
    """Write slot ``n`` of ``local_rank`` as committed (a header and a tiny meta: ``choose`` reads no data)."""
    from elaunch.checkpoint import slotfile

    path = slotfile.slot_paths(node_dir, local_rank)[n]
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.ftruncate(fd, slotfile.file_size(4, 0))
        import mmap

        with mmap.mmap(fd, slotfile.file_size(4, 0)) as buf:
            seq = slotfile.begin(buf)
            buf[slotfile.META_AT:slotfile.META_AT + 4] = b"meta"
            slotfile.commit(buf, seq, step=step, rank=rank, world_size=world, replicated=replicated, meta_len=4,
                            data_len=0, stamp=stamp)
    finally:
        os.close(fd)


_R, _S = True, False  # replicated, sharded
#: slots as (local_rank, slot, step, rank, world, replicated, time) -> (step, ranks written) or None
CHOICES = [
    ("nothing saved", [], None),
    ("in step", [(0, 0, 1, 0, 2, _R, 1), (0, 1, 2, 0, 2, _R, 3), (1, 0, 1, 1, 2, _R, 2), (1, 1, 2, 1, 2, _R, 4)],
     (2, [0])),
    ("replicated: the lowest global rank", [(0, 0, 7, 3, 4, _R, 1), (1, 0, 7, 2, 4, _R, 2)], (7, [2])),
    ("sharded: every rank", [(0, 0, 7, 3, 4, _S, 1), (1, 0, 7, 2, 4, _S, 2)], (7, [2, 3])),
    ("sharded, one rank ahead: the step all hold",
     [(0, 0, 2, 0, 2, _S, 1), (0, 1, 3, 0, 2, _S, 5), (1, 0, 1, 1, 2, _S, 2), (1, 1, 2, 1, 2, _S, 3)], (2, [0, 1])),
    ("replicated, one rank ahead: its newer step",
     [(0, 0, 2, 1, 2, _R, 1), (0, 1, 3, 1, 2, _R, 5), (1, 0, 1, 0, 2, _R, 2), (1, 1, 2, 0, 2, _R, 3)], (3, [1])),
    ("sharded, two ahead: no step in common", [(0, 0, 3, 0, 2, _S, 4), (0, 1, 4, 0, 2, _S, 5), (1, 0, 2, 1, 2, _S, 3)],
     None),
    ("sharded, a rank not yet saved in the new world",
     [(0, 0, 6, 0, 2, _S, 9), (0, 1, 5, 2, 4, _S, 1), (1, 0, 5, 3, 4, _S, 2)], None),
    ("replicated, a rank not yet saved in the new world",
     [(0, 0, 6, 0, 2, _R, 9), (0, 1, 5, 2, 4, _R, 1), (1, 0, 7, 3, 4, _R, 2)], (6, [0])),
    ("the old world's slots left aside", [(0, 0, 6, 0, 1, _S, 9), (0, 1, 5, 1, 4, _S, 1)], (6, [0])),
    ("after a rollback: the latest commit's world, not the highest step's",
     [(0, 0, 10, 0, 2, _S, 1), (0, 1, 9, 0, 4, _S, 5), (1, 0, 8, 1, 4, _S, 4), (1, 1, 9, 1, 4, _S, 6)], (9, [0, 1])),
    ("sharded, a slot never committed", [(0, 0, 1, 0, 2, _S, 1), (1, None, 0, 0, 0, _S, 0)], None),
]


@pytest.mark.parametrize("slots, expected", [c[1:] for c in CHOICES], ids=[c[0] for c in CHOICES])
def test_choose_the_step_every_local_rank_holds(dirs, slots, expected):
    from elaunch.checkpoint._persister_child import choose

    for lr, n, step, rank, world, replicated, stamp in slots:
        if n is None:  # made, never committed (a worker killed in its first save)
            open(os.path.join(dirs[0], "slots", f"{lr}.0"), "wb").close()
        else:
            _commit(dirs[0], lr, n, step, rank, world, replicated, float(stamp))
    got = choose(dirs[0])
    assert (None if got is None else (got[0], [i.rank for i in got[1]])) == expected
    assert got is None or all(i.step == got[0] for i in got[1])


def test_a_slot_overwritten_after_the_choice_is_not_written_under_the_chosen_step(dirs, savers):
    from elaunch.checkpoint._persister_child import NodePersister, _read, choose

    [s] = savers((0, 0, 1))
    s.save(1, 2)
    step, [info] = choose(dirs[0])
    assert step == 2 and same_bits(_read(info), make_state(2, 0, s.mib))
    s.save(3, 4)  # both slots rewritten: the one chosen now holds step 4
    assert _read(info) is None
    assert NodePersister(dirs[0], dirs[1]).persist_once()[0] == 4  # the next persist takes the newer


def test_a_state_the_child_cannot_unpickle_is_reported_once_not_skipped_in_silence(dirs, savers, persister, caplog):
    p = persister()
    [s] = savers((0, 0, 1), marker=True)  # a leaf of a class defined in the saver's __main__
    s.save(1)
    with caplog.at_level(logging.DEBUG, logger="elaunch.checkpoint.persister"):
        assert p.persist_now(wait=READY) is None
        assert p.persist_now(wait=READY) is None
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "Marker" in warnings[0] and dirs[1] in warnings[0], warnings
    assert persisted.steps_on_disk(dirs[1]) == []


@pytest.mark.parametrize("before, expected", [(None, 3), (5.5, 2), (6.5, 3), (0.5, 3)],
                         ids=["newest", "committed by the tick", "all by the tick", "none by the tick: newest"])
def test_a_tick_persists_sharded_state_at_the_step_committed_by_it(dirs, before, expected):
    """Nodes tick at the same wall-clock moments: the step committed by then is the one they all pick."""
    from elaunch.checkpoint._persister_child import choose

    for lr, n, step, stamp in [(0, 0, 2, 1), (0, 1, 3, 5), (1, 0, 2, 2), (1, 1, 3, 6)]:
        _commit(dirs[0], lr, n, step, lr, 2, False, float(stamp))
    assert choose(dirs[0], before)[0] == expected
    for lr, n, step, stamp in [(0, 0, 2, 1), (0, 1, 3, 5), (1, 0, 2, 2), (1, 1, 3, 6)]:
        _commit(dirs[0], lr, n, step, lr, 2, True, float(stamp))
    assert choose(dirs[0], before)[0] == 3  # replicated: one node's file is the whole state, the newest


def test_ticks_fall_on_multiples_of_the_interval_since_the_epoch():
    from elaunch.checkpoint._persister_child import _next_tick

    now = time.time()
    tick = _next_tick(60.0)
    assert tick % 60.0 == 0 and now < tick <= now + 60.0 and _next_tick(0) is None

