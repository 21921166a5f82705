"""The persister child: writes the node's newest consistent snapshot to the checkpoint directory.

``python elaunch/checkpoint/_persister_child.py FD NODE_DIR CKPT_DIR INTERVAL``: FD is this
end of a ``SOCK_SEQPACKET`` socket pair with the agent (``persister.py``). At every
multiple of INTERVAL seconds since the epoch (0 or less: never by itself; the same
ticks on every node, see :func:`choose`) and on each message ``persist N`` it
persists once (:func:`persist_once`) and answers ``ran N`` to the message. Each step
whose files are all written is reported as ``done STEP STEP_DIR SECONDS``; a failed
write as ``error TEXT`` (and tried again at the next persist). End of file on FD
(the agent closed it, or died): exit. SIGTERM: finish the write under way, then exit.

It runs at ``nice`` 10 with one torch thread, so training keeps the CPU.
"""

from __future__ import annotations

import os
import select
import signal
import socket
import sys
import time

from elaunch.checkpoint import slotfile
from elaunch.procs._proctree import exists


def _committed(node_dir: str) -> dict[int, list[slotfile.SlotInfo]]:
    """Each local rank's committed slots (0 to 2), by local rank (from the names ``slots/<lr>.<n>``)."""
    by_rank: dict[int, list[slotfile.SlotInfo]] = {}
    try:
        names = os.listdir(os.path.join(node_dir, "slots"))
    except OSError:
        return by_rank
    for name in names:
        lr, dot, n = name.partition(".")
        if not (dot and lr.isdigit() and n in ("0", "1")):
            continue
        info = slotfile.read_info(os.path.join(node_dir, "slots", name))
        by_rank.setdefault(int(lr), [])
        if info is not None:
            by_rank[int(lr)].append(info)
    return by_rank


def choose(node_dir: str, before: float | None = None) -> tuple[int, list[slotfile.SlotInfo]] | None:
    """The step to persist and the slots holding it, or None (nothing consistent to persist).

    The world is the latest commit's (the running round's); older worlds' slots are
    left aside. Sharded state: the newest step every local rank committed in that
    world, one slot per rank (a rank one save ahead of its peers still holds that
    step in its other slot). Replicated state (every slot of the world replicated):
    any rank's snapshot is the whole state, so the newest step any local rank
    committed, one slot: the lowest global rank's that holds it.

    ``before`` (seconds since the epoch; sharded state only): take the newest common
    step every local rank committed no later than that, if any is still held, so
    that nodes persisting at the same wall-clock tick pick the same step and the
    job's step becomes complete (nodes share nothing else to agree on).
    """
    by_rank = _committed(node_dir)
    infos = [i for slots in by_rank.values() for i in slots]
    if not infos:
        return None
    world = max(infos, key=lambda i: i.time).world_size
    held = [{i.step: i for i in slots if i.world_size == world} for slots in by_rank.values()]
    if all(i.replicated for h in held for i in h.values()):
        step = max(s for h in held for s in h)
        return step, [min((h[step] for h in held if step in h), key=lambda i: i.rank)]
    common = set(held[0]).intersection(*held[1:])
    if not common:
        return None
    early = [s for s in common if before is not None and all(h[s].time <= before for h in held)]
    step = max(early or common)
    return step, sorted((h[step] for h in held), key=lambda i: i.rank)


class NodePersister:
    """What the child remembers between persists: the rank files it wrote (no rewrite)."""

    def __init__(self, node_dir: str, ckpt_dir: str) -> None:
        self.node_dir, self.ckpt_dir = node_dir, ckpt_dir
        self._written: set[tuple[int, int, int]] = set()  # (step, rank, world_size)

    def persist_once(self, before: float | None = None) -> tuple[int, str, float] | None:
        """Write the chosen step's rank files not yet written (:func:`choose`); prune older steps once all are.

        Returns:
            ``(step, step_dir, seconds)`` when files were written and the step is now
            whole on disk for this node; None: nothing new, or a slot changed while
            it was read (the newer snapshot is taken next time).

        Raises:
            OSError: a file cannot be written (nothing torn is left behind).
        """
        from elaunch.checkpoint import persisted

        pick = choose(self.node_dir, before)
        if pick is None:
            return None
        step, slots = pick
        if all(i.reshardable for i in slots):  # DCP parts: an ordinary DCP directory
            return self._persist_dcp(step, slots)
        todo = [i for i in slots if (step, i.rank, i.world_size) not in self._written
                and not os.path.exists(persisted.rank_file(self.ckpt_dir, step, i.rank, i.world_size))]
        if not todo:
            return None
        began = time.monotonic()
        for info in todo:
            state = _read(info)
            if state is None:
                return None  # overwritten since chosen: the next persist takes the newer step
            path = persisted.write_rank_file(self.ckpt_dir, step, info.rank, info.world_size, info.replicated, state)
            del state
            _remove_stale_temporaries(path)
            self._written.add((step, info.rank, info.world_size))
        previous = persisted.newest_complete(self.ckpt_dir, at_most=step - 1)
        persisted.prune(self.ckpt_dir, step if previous is None else previous[0])  # the previous one stays
        return step, persisted.step_dir(self.ckpt_dir, step), time.monotonic() - began

    def _persist_dcp(self, step: int, slots: list[slotfile.SlotInfo]) -> tuple[int, str, float] | None:
        """Write this node's ranks' parts of a DCP save into ``dcp/step_<step>/``; its ``.metadata`` once all are there.

        A part is read as ``SnapshotReader`` reads it (its JSON document, its data copied out:
        nothing is unpickled). Each rank's file leaves out what DCP's plan gave another rank
        (``SnapshotWriter`` marks it when the plan was known at the commit) and what a sidecar
        of the same save already holds, so a replicated tensor is written once per node at
        most, once in all when the plan was known. Older DCP steps are pruned once a newer one is complete.

        Returns:
            As :meth:`persist_once`: ``(step, step_dir, seconds)`` when this node's files were written.

        Raises:
            OSError: a file cannot be written. RuntimeError: a part is malformed, or the parts of
            a whole save leave a region out.
        """
        from elaunch.checkpoint import CheckpointError, persisted
        from elaunch.checkpoint.dcp import read_part
        from elaunch.checkpoint.persisted import persisted_dir

        d = persisted_dir(self.ckpt_dir, step)
        if os.path.exists(os.path.join(d, persisted.DCP_METADATA)):
            return None  # complete: nothing is rewritten in it
        have = persisted.read_sidecars(d)
        todo = [i for i in slots if (step, i.rank, i.world_size) not in self._written
                and have.get(i.rank, {}).get("world_size") != i.world_size]
        began = time.monotonic()
        for info in todo:
            try:
                part = read_part(info)
            except CheckpointError as exc:
                raise RuntimeError(f"rank {info.rank}'s DCP part of step {step}: {exc}") from exc
            if part is None:
                return None  # overwritten since chosen (or not a DCP part): the next persist takes the newer step
            layout, items = part
            skip = persisted.held_keys(persisted.read_sidecars(d), info.world_size)
            items = [it[:3] for it in items if it[3] is not False]  # False: DCP's plan gave it another rank
            path = persisted.write_dcp_part(self.ckpt_dir, step, info.rank, info.world_size, layout, items, skip,
                                            time=info.time)
            del part, items
            _remove_stale_temporaries(path)
            _remove_stale_temporaries(os.path.join(d, persisted.dcp_sidecar_name(info.rank)))
            self._written.add((step, info.rank, info.world_size))
        try:
            persisted.finish_dcp_step(self.ckpt_dir, step)
        except ValueError as exc:
            raise RuntimeError(f"step {step}: {exc}") from exc
        keep = persisted.newest_dcp(self.ckpt_dir, at_most=step)
        persisted.prune_dcp(self.ckpt_dir, step if keep is None else keep[0])  # a complete one stays until superseded
        return (step, d, time.monotonic() - began) if todo else None


def _read(info: slotfile.SlotInfo):
    """The state in ``info``'s slot if it still holds that very commit, else None."""
    from elaunch.checkpoint import CheckpointError, Snapshot, _tree
    from elaunch.checkpoint._read import read as read_slot_file

    try:  # a DTensor is written as a dict of primitives and its local shard: this process has no mesh
        got, state = read_slot_file(info.path, "cpu", dtensors=_tree.as_entry)
        snap = Snapshot(got.step, state)
    except CheckpointError:  # written to while read (seqlock), or emptied; other errors are reported
        return None
    except (AttributeError, ImportError) as exc:  # unpickling the structure needs the state's classes
        raise RuntimeError(f"cannot read step {info.step} of rank {info.rank} ({exc}): the state's classes must "
                           "be importable from a module on the agent's PYTHONPATH, not defined in __main__") from exc
    now = slotfile.read_info(info.path)
    if now is None or now.seq != info.seq or snap.step != info.step:
        return None  # a write began after the choice: what was read may be the newer one
    return snap.state


def _remove_stale_temporaries(path: str) -> None:
    """Remove what earlier writers of ``path`` killed midway left (``.NAME.tmp-PID``, PID no longer running here).

    Only this node writes a given rank's file of a step (its rank, or its lowest
    for replicated state), so a writer's pid is a pid of this host.
    """
    folder, name = os.path.split(path)
    prefix = f".{name}.tmp-"
    for other in os.listdir(folder):
        pid = other[len(prefix):]
        if other.startswith(prefix) and pid.isdigit() and not exists(int(pid)):
            try:
                os.unlink(os.path.join(folder, other))
            except OSError:
                pass


class _Stop(Exception):
    """SIGTERM while waiting: exit now."""


def main(fd: int, node_dir: str, ckpt_dir: str, interval: float) -> int:
    os.nice(10)
    chan = socket.socket(fileno=fd)
    busy, stopping = [False], [False]

    def on_term(_signum, _frame):
        stopping[0] = True
        if not busy[0]:
            raise _Stop

    signal.signal(signal.SIGTERM, on_term)
    try:
        import torch

        torch.set_num_threads(1)
        worker = NodePersister(node_dir, ckpt_dir)
        tick = _next_tick(interval)
        while not stopping[0]:
            timeout = None if tick is None else max(tick - time.time(), 0.0)
            ready, _, _ = select.select([chan], [], [], timeout)
            words = chan.recv(4096).decode("ascii", "replace").split() if ready else ["tick"]
            if not words:
                return 0  # the agent closed the channel or died
            busy[0] = True
            _persist(worker, chan, tick if words[0] == "tick" else None)
            busy[0] = False
            if words[0] == "persist":
                chan.send(f"ran {words[1] if len(words) > 1 else 0}".encode("ascii"))
            elif words[0] == "tick":
                tick = _next_tick(interval)
    except (_Stop, BrokenPipeError, ConnectionResetError):
        pass
    finally:
        # past the loop a SIGTERM just ends the process: raised as _Stop during the interpreter's teardown it
        # printed a traceback of its own
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    return 0


def _next_tick(interval: float) -> float | None:
    """The next multiple of ``interval`` seconds since the epoch (every node's persister ticks together), or None."""
    return (time.time() // interval + 1) * interval if interval > 0 else None


def _persist(worker: NodePersister, chan: socket.socket, tick: float | None) -> None:
    try:
        done = worker.persist_once(tick)
    except Exception as exc:  # noqa: BLE001 - reported to the agent; the next persist tries again
        chan.send(f"error persisting to {worker.ckpt_dir}: {type(exc).__name__}: {exc}".replace("\n", " ")
                  .encode("utf-8", "replace")[:4096])
        return
    if done is not None:
        step, path, seconds = done
        chan.send(f"done {step} {path} {seconds:.6f}".encode("utf-8", "replace"))


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]), sys.argv[2], sys.argv[3], float(sys.argv[4])))
