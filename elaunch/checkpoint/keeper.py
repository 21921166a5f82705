"""The agent's side of in-memory checkpoints: the keeper of the node directory, the round's restore, the helpers.

A worker saves with ``elaunch.checkpoint.save`` into its slots in the agent's node
directory (``procs.snapshot_dir``: ``/dev/shm/elaunch-<run id>-<agent pid>``, 0700);
the :class:`CheckpointKeeper` owns that directory for the agent's run:

* **made at the start of the run, removed at its end** (success, failure, a handled
  signal), and by the reaper after a ``kill -9`` of the agent. Without a writable
  ``/dev/shm``: one warning, in-memory checkpoints are off (no variable is set).
* **each round's restore** (:meth:`CheckpointKeeper.prepare`, before the workers
  start): what this node holds (``slotfile.inventory``, the newest complete step
  in ``--checkpoint-dir`` and its newest complete DCP directory) is exchanged with the round's other nodes through the job
  channel (one round trip; it returns once every node's document is in, or after
  ``--checkpoint-exchange-timeout`` seconds without the missing ones; a single-node
  round plans from its own inventory), every node runs the same pure
  ``checkpoint.plan.choose`` on the same documents, and this node fetches what its
  ranks need from peers' memory (``checkpoint.replicas.fetch``) into ``restore/``: its
  ranks' own parts, or, when a ``torch.distributed.checkpoint`` step is resharded to a
  new world size, every saved rank's part (``SnapshotReader`` reads them all).
  Each worker gets ``ELAUNCH_CHECKPOINT_SHM`` (the directory) and, when the job
  restores, ``ELAUNCH_CHECKPOINT_RESTORE`` (its file) and ``ELAUNCH_CHECKPOINT_STEP``.
  **A fetch that fails** falls back to another holder of the same step (a peer, then
  disk); when none is left the worker is still given the plan's step and a file that
  does not exist, so its ``ckpt.load()`` raises and the round fails (a counted
  restart, after which every node plans again): ranks never resume from different
  steps, and a node never silently starts fresh beside peers that restored.
  A local rank that restores here but has no slot on this node yet (a replacement
  node) gets both its slot files reserved, the restored snapshot's size, by a
  thread of the agent while its worker starts, so that its first saves do not
  allocate them while its peers wait (:meth:`CheckpointKeeper._reserve_slots`).
* **the helpers** (added to the launcher's supervisor, ``elaunch.supervision``: checked at
  each look of the monitor, a dead one restarted, then turned off with one warning; the
  keeper stops them itself at its close, before the directory goes): the replica service (``checkpoint.replicas``, with
  ``--checkpoint-replicas`` > 0 once a round has more than one node; its ring is the
  next N nodes by group rank) and the persister (``checkpoint.persister``, with
  ``--checkpoint-dir``), asked to persist at once when a worker fails, on a forwarded
  notice, and on a handled signal (then waited for up to ``--checkpoint-timeout`` seconds
  before the directory goes).
* **events and status**: ``checkpoint_restore`` and ``checkpoint_persisted`` in
  ``events.jsonl``; a ``checkpoint`` node record (newest step, its time, bytes held)
  for ``elaunch status``, at most every :data:`STATUS_EVERY` seconds.

It is a :class:`~elaunch.agent.watchdog.Watchdog` (``env``, ``poll``, ``close``), so
the agent's monitor polls it; it never raises an alarm. torchrun has nothing of the
kind. Stdlib only: no torch in the agent.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

from elaunch.checkpoint import persisted
from elaunch.checkpoint import plan as planner
from elaunch.checkpoint import slotfile
from elaunch.checkpoint.restore import MISSING, RoundRestore, ranks_by_group, successors
from elaunch.procs.snapshot_dir import SHM_ROOT, NodeDir
from elaunch.supervision import OFF, SERVICES, THREADS, HelperThread
from elaunch.rendezvous.job_channel import publish

log = logging.getLogger("elaunch.agent")

#: Seconds the round's inventory exchange may take before this node plans without the missing documents
#: (``--checkpoint-exchange-timeout``'s default): short, since a member that died after the rendezvous
#: holds every other node's workers back until then (the exchange waits at most twice this).
EXCHANGE_TIMEOUT = 5.0
#: Seconds one fetch of a snapshot from a peer may take, and the agent waits for the persist it asked for
#: on a handled signal before removing the directory (``--checkpoint-timeout``'s default).
FETCH_TIMEOUT = PERSIST_WAIT = 30.0
#: Most seconds between two ``checkpoint`` node records (status).
STATUS_EVERY = 5.0
ENV_SHM, ENV_RESTORE, ENV_STEP = "ELAUNCH_CHECKPOINT_SHM", "ELAUNCH_CHECKPOINT_RESTORE", "ELAUNCH_CHECKPOINT_STEP"
#: The nice value of the thread that reserves a restoring rank's slots (:meth:`CheckpointKeeper._reserve_slots`).
RESERVE_NICE = 19
_GOES_ON = "in-memory checkpoints go on without it"  #: the warning's tail when a helper is turned off


class NodeSnapshot(NamedTuple):
    """This node's in-memory checkpoints as a metrics scrape reads them (:meth:`CheckpointKeeper.snapshot_facts`).

    Attributes:
        step: the newest step committed to this node's slots, or None (no ``ckpt.save`` yet).
        time: when it was committed (seconds since the epoch), or None.
        persisted_time: when the newest step persisted to ``--checkpoint-dir`` in this run was
            committed in memory (seconds since the epoch), or None (no ``--checkpoint-dir``, or
            nothing persisted yet).
    """

    step: int | None = None
    time: float | None = None
    persisted_time: float | None = None


def plan_reason_line(plan: "planner.Plan") -> tuple[int, str]:
    """``(logging level, message)`` of the agent's line for ``plan.reason`` (which must be set).

    A newer step that some saved rank had not committed (``plan.partial``: a fault during its save, after
    most kills) while an older step restores is the normal course: INFO, naming the step restored. A step
    blocked by its world size, or no step at all (the workers start fresh), is a WARNING.
    """
    if plan.step is not None and plan.partial:
        return logging.INFO, f"checkpoint restore: step {plan.step} restored, not a newer one: {plan.reason}"
    tail = f"; step {plan.step} restored" if plan.step is not None else "; the workers start fresh"
    return logging.WARNING, f"checkpoint restore: {plan.reason}{tail}"


class CheckpointKeeper:
    """One agent run's in-memory checkpoints (see the module docstring).

    Args:
        run_id: the job's id (the directory's name).
        replicas: ``--checkpoint-replicas`` (resolved: >= 0).
        ckpt_dir: ``--checkpoint-dir`` or None.
        persist_interval: ``--checkpoint-persist-interval``, seconds.
        channel: returns the rendezvous' job channel (exchange, node records).
        root: where node directories go (default ``/dev/shm``).
        exchange_timeout, fetch_timeout, persist_wait: seconds, see the constants.
        clock: seconds since the epoch (injectable for tests).
        secret: the job secret (``ELAUNCH_JOB_SECRET``), or None: this agent's replica service then
            takes a random key, published in its inventory document for the round's other nodes.

    Attributes:
        node_dir: the node directory, or None (off, or not opened).
        polls: the monitor must call :meth:`poll` while the group runs (a helper runs).
        interval: None (the monitor's interval is fine).
    """

    interval = None

    def __init__(self, run_id: str, replicas: int, ckpt_dir: str | None, persist_interval: float,
                 channel: Callable[[], object], *, root: str = SHM_ROOT, exchange_timeout: float = EXCHANGE_TIMEOUT,
                 fetch_timeout: float = FETCH_TIMEOUT, persist_wait: float = PERSIST_WAIT,
                 clock: Callable[[], float] = time.time, secret: bytes | None = None) -> None:
        self._run_id, self._replicas, self._ckpt_dir = run_id, replicas, ckpt_dir
        self._persist_interval = persist_interval
        self._events, self._channel, self._root = None, channel, root
        self._exchange_timeout, self._fetch_timeout, self._persist_wait = exchange_timeout, fetch_timeout, persist_wait
        self._clock = clock
        self._secret = secret
        self.node_dir: NodeDir | None = None
        self._launcher = None
        self._persister = None
        self._service = None
        self._env: dict[int, dict[str, str]] = {}  # local rank -> this round's restore variables
        self._published_at = float("-inf")
        self._publishing = None  # the thread writing the last status record
        self._reserving: HelperThread | None = None  # the round's slot reservation (see _reserve_slots)
        self._signalled = False
        self._warned_static = False
        self._asked: str | None = None  # a persist asked from a signal handler, done at the next poll
        self._persisted_commit: float | None = None  # when the newest step persisted in this run was committed
        self.polls = False

    @classmethod
    def for_launch(cls, config, run_id: str, channel: Callable[[], object]) -> "CheckpointKeeper":
        """The keeper of a launch's options (``LaunchConfig``: ``checkpoint_replicas``, ``checkpoint_dir``,
        ``checkpoint_persist_interval``, ``checkpoint_timeout``, ``checkpoint_exchange_timeout``, ``max_nodes``)."""
        wait = config.checkpoint_timeout
        return cls(run_id, config.checkpoint_replicas, config.checkpoint_dir,
                   config.checkpoint_persist_interval, channel, exchange_timeout=config.checkpoint_exchange_timeout,
                   fetch_timeout=wait, persist_wait=wait, secret=config.job_secret)

    # -- the run -----------------------------------------------------------------------------------------------

    def open(self, launcher, events) -> None:
        """Make the node directory (the reaper removes it if the agent dies); start the persister if asked.

        Args:
            launcher: the agent's ``WorkerLauncher``, opened (its reaper; its supervisor owns the helpers).
            events: the run's event log (``AgentEvents``).
        """
        self._launcher, self._events = launcher, events
        self.node_dir = NodeDir.create(self._run_id, root=self._root)
        if self.node_dir is None:
            return
        if launcher.reaper is not None:
            launcher.reaper.remove_on_exit(self.node_dir.path)
        if self._ckpt_dir:
            from elaunch.checkpoint.persister import Persister

            persister = Persister(self.node_dir.path, self._ckpt_dir, self._persist_interval, launcher.reaper)
            try:
                persister.start()
            except OSError as exc:
                log.warning("checkpoint persister could not start (%s): nothing is persisted to %s", exc,
                            self._ckpt_dir)
            else:
                self._persister = launcher.supervisor.add(persister, SERVICES, on_death=OFF, note=_GOES_ON,
                                                          turned_off=self._persister_off)
                self.polls = True

    def close(self) -> None:
        """Wait for a persist asked on a signal (up to ``persist_wait`` seconds), stop the helpers, remove the
        directory. Idempotent."""
        self._stop_reserving()
        persister, self._persister = self._persister, None
        if persister is not None:
            if self._signalled:
                self._await_persist(persister)
            self._report_persisted(persister)
            self._launcher.supervisor.stop(persister)  # before its directory goes
        service, self._service = self._service, None
        if service is not None:
            self._launcher.supervisor.stop(service)
        if self.node_dir is not None:
            self.node_dir.remove()
            self.node_dir = None

    # -- the round ---------------------------------------------------------------------------------------------

    def prepare(self, info, workers: Sequence, local_world_size: int) -> None:
        """Plan this round's restore and fetch what this node's ranks need; before the workers start.

        Args:
            info: the round (``RendezvousInfo``).
            workers: this node's ``Worker`` list, ranks assigned.
            local_world_size: workers per node (when ``info.nodes`` is empty).
        """
        self._env = {}
        if self.node_dir is None:
            return
        self._stop_reserving()
        nd = self.node_dir
        nd.clear_restore()
        me = str(info.rank)
        multi = info.world_size > 1
        addr = self._start_service(info) if multi and self._replicas > 0 else ""
        doc = planner.inventory_doc(slotfile.inventory(nd.path), self._persisted(), addr, dcp=self._persisted_dcp())
        if addr and self._secret is None:
            doc["key"] = self._service.key.hex()  # the round's nodes authenticate to this node's service with it
        docs = self._exchange(info.round, {**doc, "group_rank": info.rank}) if multi else {me: doc}
        docs[me] = doc
        keys = {g: self._peer_key(d) for g, d in docs.items()}
        source = self._service.host if self._service is not None else None
        restore = RoundRestore(docs, me, nd.restore, self._fetch_timeout, keys=keys, source=source)
        plan = self._plan(info, restore, workers, local_world_size)
        if plan.reason:
            log.log(*plan_reason_line(plan))
        if plan.parts:
            log.info("checkpoint restore: step %d saved at world size %d is resharded from memory to world size %d "
                     "(this node gathers every saved rank's part)", plan.step, plan.saved_world_size,
                     len(plan.sources))
        for line in plan.refused:
            log.warning("checkpoint restore: refused %s", line)
        files = restore.gather(plan) if plan.step is not None else {}
        if plan.step is not None:
            for w in workers:
                self._env[w.local_rank] = {ENV_RESTORE: files[w.global_rank][0], ENV_STEP: str(plan.step)}
            self._events.checkpoint_restore(info.round, plan.step, {r: kind for r, (_path, kind) in files.items()})
            if not plan.parts:
                self._reserve_slots({w.local_rank: files[w.global_rank] for w in workers})
        if self._service is not None:
            addrs = {g: planner.addr_from_doc(d) for g, d in docs.items() if keys.get(g)}
            peers = [(host, port, keys[g]) for g, (host, port) in successors(addrs, me, self._replicas)] if multi else []
            self._service.set_ring(peers)

    def _reserve_slots(self, files: dict[int, tuple[str, str]]) -> None:
        """Reserve the slots of each local rank that restores here and has none yet, in a thread of the agent.

        A replacement node's workers (or a rank moved to another node) find no slot of theirs
        in this node's memory, and each made its two slot files at its first two saves, the
        whole snapshot's pages each time (0.9 s for 256 MiB on a fresh test host, against
        0.05-0.1 s for a save into existing slots), while every peer waited for it at the
        next collective. The agent makes them, the restored snapshot's size each
        (``slotfile.reserve``), while the worker starts: its first save finds them, and a
        warm spare's hook maps them (``checkpoint.spare``). The thread runs at nice
        :data:`RESERVE_NICE`: at normal priority its page zeroing delayed the replacement's start
        on loaded cores (issue 37's node-replaced run, 3 test hosts on 2 cores, three runs each: the
        fault cost a median 7.1 s without the reservation, 7.0 s with it at normal priority, 6.5 s at
        nice 19; docs/benchmarks.md). Not when the step is resharded
        (a new rank's state has another size than the part it reads). The thread (tier
        :data:`~elaunch.supervision.THREADS`) ends by itself; the next round's
        :meth:`prepare` and :meth:`close` stop it first.

        Args:
            files: local rank -> (the file its worker restores, its kind), as ``RoundRestore.gather`` gave them.
        """
        sizes = {}
        for local_rank, (path, kind) in sorted(files.items()):
            if kind == MISSING or any(os.path.lexists(p) for p in slotfile.slot_paths(self.node_dir.path, local_rank)):
                continue
            info = slotfile.read_info(path)
            if info is not None:
                sizes[local_rank] = info.size
        if not sizes:
            return
        node_dir = self.node_dir.path

        def run(stop) -> None:
            try:  # idle CPU only: the worker's own start (its imports) is the critical path meanwhile
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), RESERVE_NICE)  # Linux: this thread
            except OSError:
                pass
            took = 0
            for local_rank, size in sizes.items():
                if stop.is_set():
                    break
                took += slotfile.reserve(node_dir, local_rank, size)
            log.info("checkpoint restore: reserved %.1f MiB of slots for local rank(s) %s", took / (1 << 20),
                     sorted(sizes))

        self._reserving = self._launcher.supervisor.add(
            HelperThread("slot reservation", run, thread_name="elaunch-slot-reserve", warn_late=False),
            THREADS, on_death=OFF, wakes=False, start=True)

    def _stop_reserving(self) -> None:
        """Stop (wait for) the last round's slot reservation, if any."""
        thread, self._reserving = self._reserving, None
        if thread is not None:
            self._launcher.supervisor.stop(thread)

    def _peer_key(self, doc: dict) -> bytes:
        """The key of the replica service a node's document names: the job's, or the one it published (b"": none)."""
        if self._secret is not None:
            return self._job_key()
        try:
            key = bytes.fromhex(doc.get("key", "")) if isinstance(doc, dict) else b""
        except (TypeError, ValueError):
            return b""
        return key if len(key) == 32 else b""

    def _job_key(self) -> bytes:
        from elaunch.checkpoint.replica_wire import job_key

        return job_key(self._secret, self._run_id)

    def _plan(self, info, restore: RoundRestore, workers: Sequence, local_world_size: int) -> planner.Plan:
        """The round's plan from every node's document; no restore where the nodes cannot agree on one.

        Without job state (a static job of several nodes) no document is exchanged: each
        node would choose from its own memory alone, and nodes could restore different
        steps, so none restores (every ``ckpt.load()`` returns None, alike).
        """
        if info.world_size > 1 and not self._channel().keeps_job_state:
            if not self._warned_static:
                self._warned_static = True
                log.warning("in-memory checkpoints are not restored: this rendezvous cannot exchange what each "
                            "node holds (use c10d or etcd); ckpt.save() still works")
            return planner.Plan(None)
        world = workers[0].world_size if workers else 0
        try:
            return restore.plan(ranks_by_group(info.nodes, info.world_size, local_world_size), world)
        except ValueError as exc:
            log.warning("checkpoint restore: no plan for round %d (%s); the workers start fresh", info.round, exc)
            return planner.Plan(None)

    def env(self, local_rank: int) -> dict[str, str]:
        """``ELAUNCH_CHECKPOINT_*`` of ``local_rank``'s worker ({} when off): the directory, the
        same in every round (before the first too: warm spares start early), and this round's
        restore, if any."""
        if self.node_dir is None:
            return {}
        return {ENV_SHM: self.node_dir.path, **self._env.get(local_rank, {})}

    def new_attempt(self, round: int) -> None:
        """Nothing: :meth:`prepare` did the round's work."""

    def _persisted(self):
        """``persisted.newest_complete(--checkpoint-dir)``, or None (no directory, nothing complete, unreadable)."""
        return self._from_ckpt_dir(persisted.newest_complete)

    def _persisted_dcp(self) -> tuple[int, str] | None:
        """``persisted.newest_dcp(--checkpoint-dir)``: the newest complete persisted DCP directory, or None."""
        return self._from_ckpt_dir(persisted.newest_dcp)

    def _from_ckpt_dir(self, reader: Callable[[str], object]):
        """``reader(--checkpoint-dir)``, or None: no directory, or it cannot be read (logged)."""
        if not self._ckpt_dir:
            return None
        try:
            return reader(self._ckpt_dir)
        except OSError as exc:
            log.warning("checkpoint restore: cannot read %s (%s)", self._ckpt_dir, exc)
            return None

    def _exchange(self, round: int, doc: dict) -> dict[str, dict]:
        """Every node's document of this round by group rank (text); a node whose document is missing holds nothing."""
        try:
            got = self._channel().exchange("checkpoint", round, doc, self._exchange_timeout)
        except Exception as exc:  # noqa: BLE001 - a restore aid: the round goes on without the others' documents
            log.warning("checkpoint restore: the inventory exchange of round %d failed (%s)", round, exc)
            return {}
        out = {}
        for d in got.values():
            if isinstance(d, dict) and type(d.get("group_rank")) is int:
                out[str(d["group_rank"])] = d
        return out

    def _start_service(self, info) -> str:
        """Start the replica service at the first multi-node round; return ``host:port`` ("" when off)."""
        if self._service is None and self._launcher is not None:
            host = info.nodes[info.rank].addr if info.nodes else "127.0.0.1"
            key = self._job_key() if self._secret is not None else None  # None: the service makes a random one
            try:
                from elaunch.checkpoint.replicas import ReplicaService

                service = ReplicaService(self.node_dir.path, host, self._launcher.reaper, key=key)
                service.start()
                if self._secret is None:
                    log.info("replica service: peers authenticate with keys shared through the rendezvous; set "
                             "ELAUNCH_JOB_SECRET to keep out whoever can read the rendezvous store too")
            except (ImportError, OSError) as exc:
                log.warning("replica service could not start on %s (%s): no peer keeps this node's snapshots",
                            host, exc)
                self._replicas = 0
                return ""
            # its check never raises: a service past its restarts turns itself off with a warning
            self._service = self._launcher.supervisor.add(service, SERVICES, on_death=OFF, note=_GOES_ON,
                                                          turned_off=self._service_off)
            self.polls = True
        service = self._service
        if service is None or service.port is None:
            return ""
        service.set_members([n.addr for n in info.nodes] if info.nodes else None)  # this round's nodes only
        # (before this node's document names the port: no peer connects before the child has the list)
        host = service.host
        return f"[{host}]:{service.port}" if ":" in host else f"{host}:{service.port}"

    # -- while the group runs ----------------------------------------------------------------------------------

    def _persister_off(self) -> None:
        """The supervisor turned the persister off (it died past its restarts): nothing is persisted any more."""
        self._persister = None

    def _service_off(self) -> None:
        """The supervisor turned the replica service off; the next multi-node round starts a new one."""
        self._service = None

    def poll(self, watched=None) -> None:
        """Log persists, publish the status record (the supervisor checked the helpers just before)."""
        if self._asked is not None:
            why, self._asked = self._asked, None
            self.persist_now(why)
        if self._persister is not None:
            self._report_persisted(self._persister)
        now = self._clock()
        writing = self._publishing is not None and self._publishing.is_alive()  # never two writes at once
        if self.node_dir is not None and now - self._published_at >= STATUS_EVERY and not writing:
            self._published_at = now
            self._publishing = publish(self._channel(), "checkpoint", self.status_record())

    def status_record(self) -> dict:
        """The ``checkpoint`` node record: the newest step of this node's slots, its time, bytes held."""
        own = slotfile.newest(slotfile.inventory(self.node_dir.path, ("slots",))) if self.node_dir is not None else None
        return {"step": own.step if own else None, "time": own.time if own else None,
                "bytes": self.node_dir.bytes_held() if self.node_dir is not None else 0, "at": self._clock()}

    def snapshot_facts(self):
        """This node's newest in-memory snapshot for ``--metrics-port``: a :class:`NodeSnapshot`, or None when off.

        ``step`` and ``time`` (seconds since the epoch) are the newest commit in this node's slots, read
        now (``/dev/shm`` headers, no network: safe from the metrics server's thread); ``persisted_time``
        is when the newest step persisted to ``--checkpoint-dir`` in this run was committed (None before
        the first persist, and without ``--checkpoint-dir``).
        """
        node_dir = self.node_dir
        if node_dir is None:
            return None
        own = slotfile.newest(slotfile.inventory(node_dir.path, ("slots",)))
        return NodeSnapshot(own.step if own else None, own.time if own else None, self._persisted_commit)

    def ask_persist(self, why: str) -> None:
        """Have the next :meth:`poll` ask for a persist (safe in a signal handler: sets one attribute)."""
        self._asked = why

    def persist_now(self, why: str) -> None:
        """Ask the persister to write the newest snapshot now (a worker failed, a notice, a signal); never waits."""
        if why == "signal":
            self._signalled = True
        if self._persister is None:
            return
        try:
            self._persister.persist_now()
        except OSError as exc:
            log.warning("checkpoint persister: cannot persist on %s (%s)", why, exc)

    def _await_persist(self, persister) -> None:
        deadline = time.monotonic() + self._persist_wait
        try:
            persister.persist_now(wait=self._persist_wait)  # answered once the write asked before is done too
        except OSError as exc:
            log.warning("checkpoint persister: %s", exc)
        if time.monotonic() > deadline:
            log.warning("checkpoint persister: still writing after %g s; stopping it", self._persist_wait)

    def _report_persisted(self, persister) -> None:
        for step, path, seconds in persister.poll_done():
            self._persisted_commit = self._commit_time(step, self._clock() - seconds)
            self._events.checkpoint_persisted(step, path, seconds)
            log.info("checkpoint of step %d persisted to %s in %.2f s", step, path, seconds)

    def _commit_time(self, step: int, fallback: float) -> float:
        """When ``step`` was committed in this node's slots (its last rank's commit); ``fallback`` (the persist's
        start, later than the commit) once every slot of that step was overwritten."""
        node_dir = self.node_dir
        infos = slotfile.inventory(node_dir.path, ("slots",)) if node_dir is not None else []
        times = [i.time for i in infos if i.step == step]
        return max(times) if times else fallback

