"""Read a job's rendezvous without joining it: the state, the agents' records, stacks on request.

Builds a read-only :class:`~elaunch.rendezvous.dynamic.backend.RendezvousBackend`
of the ``c10d``, ``etcd``/``etcd-v2`` or ``etcd-v3`` rendezvous from the same
``--rdzv-*`` values the job was started with. It joins nothing: no node id, no
heartbeat, no presence lease, no state write, except the one compare-and-set
of :func:`request_stacks` (``dump_id`` + 1, no ``dump_by``), which changes no
round. This module is the one place that imports the rendezvous' internals.
"""

from __future__ import annotations

import datetime
import json
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from elaunch.rendezvous.contract import RendezvousError, RendezvousParameters
from elaunch.rendezvous.dynamic import job_ops
from elaunch.rendezvous.dynamic.backend import RendezvousBackend
# the one import of the state reader (it may move with the executor: change this line only)
from elaunch.rendezvous.dynamic.reading import read_state
from elaunch.rendezvous.dynamic.settings import RendezvousSettings
from elaunch.rendezvous.dynamic.state import RendezvousState

#: The rendezvous backends ``elaunch status`` reads (the dynamic ones; static keeps no shared state).
BACKENDS = ("c10d", "etcd", "etcd-v2", "etcd-v3")
#: Default ``read_timeout`` of a status read, seconds (the launch default is 60: a person is waiting here).
STATUS_READ_TIMEOUT = 10.0


class StatusError(Exception):
    """A status read that cannot answer: unreachable endpoint, no such run id, corrupt state (exit 1)."""


@dataclass
class Reader:
    """A read-only view of one run id's rendezvous.

    Attributes:
        backend: the state backend (never used to join).
        where: the endpoint as messages name it (``c10d store at host:port``, ``etcd at ...``).
        endpoint: the endpoint alone (``host:port``, or the etcd list).
        run_id: the job id.
        settings: the dynamic rendezvous' settings from ``--rdzv-conf`` (``dead_after`` in seconds).
        read_timeout: seconds a read may take.
        close: releases the client.
        exists: checks that the state key exists, where a read of a missing key blocks (c10d), or None.
    """

    backend: RendezvousBackend
    where: str
    endpoint: str
    run_id: str
    settings: RendezvousSettings
    read_timeout: float
    close: Callable[[], None] = field(default=lambda: None)
    exists: Callable[[], bool] | None = None


def _bounded(fn: Callable[[], Any], timeout: float, what: str) -> Any:
    """Run ``fn()`` on a daemon thread; StatusError when it takes more than ``timeout`` seconds (read_timeout).

    A client stuck on a silent server is left to the thread (the command exits soon after).
    """
    out: list = []
    done = threading.Event()

    def run() -> None:
        try:
            out.append((True, fn()))
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller
            out.append((False, exc))
        finally:
            done.set()

    threading.Thread(target=run, name="elaunch-status", daemon=True).start()
    if not done.wait(timeout):
        raise StatusError(f"{what} within read_timeout={timeout:g} s: no answer")
    ok, value = out[0]
    if not ok:
        raise value
    return value


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return " ".join(text.splitlines()[0].split()) if text else type(exc).__name__


def open_reader(backend: str, endpoint: str, run_id: str, conf: dict[str, str]) -> Reader:
    """Connect to the rendezvous of ``run_id`` read-only.

    Args:
        backend: one of :data:`BACKENDS`.
        endpoint: ``--rdzv-endpoint`` (c10d: ``host[:port]``, default port 29400; etcd: a list).
        conf: ``--rdzv-conf``; ``read_timeout`` (seconds) defaults to :data:`STATUS_READ_TIMEOUT`.

    Raises:
        RendezvousConfigError: a bad endpoint or conf value (the message names it).
        StatusError: the endpoint cannot be reached within ``read_timeout`` seconds.
    """
    conf = {"read_timeout": str(STATUS_READ_TIMEOUT), **conf}
    params = RendezvousParameters(backend=backend, endpoint=endpoint, run_id=run_id, min_nodes=1, max_nodes=1,
                                  config=conf)
    settings = RendezvousSettings.from_params(params)
    read_timeout = params.get_as_seconds("read_timeout", STATUS_READ_TIMEOUT)
    if backend == "c10d":
        return _c10d(params, settings, read_timeout)
    return _etcd(params, settings, read_timeout)


def _c10d(params: RendezvousParameters, settings: RendezvousSettings, read_timeout: float) -> Reader:
    # before torch loads: its C++ connect errors (with stack frames) would bury the one line we print;
    # set, not defaulted: an environment inherited from a process that imported elaunch's c10d
    # backend already says ERROR
    os.environ["TORCH_CPP_LOG_LEVEL"] = "FATAL"
    from elaunch.rendezvous.c10d import DEFAULT_PORT, C10dBackend
    from elaunch.rendezvous.c10d_store import BoundedStore
    from elaunch.rendezvous.endpoint import parse_endpoint
    from torch.distributed import TCPStore

    host, port = parse_endpoint(params.endpoint, DEFAULT_PORT, bare_ipv6=True)
    where = f"c10d store at {host}:{port}"
    use_libuv = bool(params.get_as_bool("use_libuv", True))
    try:
        # a plain client: wait_for_workers=False adds nothing to the store's worker count
        store = _bounded(lambda: TCPStore(host, port, is_master=False, wait_for_workers=False,
                                          timeout=datetime.timedelta(seconds=read_timeout), use_libuv=use_libuv),
                         read_timeout, f"cannot reach the {where}")
    except StatusError:
        raise
    except Exception as exc:  # noqa: BLE001 - torch's DistError/RuntimeError: one line, the endpoint named
        raise StatusError(f"cannot reach the {where} within read_timeout={read_timeout:g} s: "
                          f"{_first_line(exc)}") from exc
    bounded = BoundedStore(store, f"{host}:{port}", read_timeout)
    backend = C10dBackend(bounded, params.run_id, f"{host}:{port}", create=False)
    return Reader(backend, where, f"{host}:{port}", params.run_id, settings, read_timeout, exists=backend.exists)


def _etcd(params: RendezvousParameters, settings: RendezvousSettings, read_timeout: float) -> Reader:
    from elaunch.rendezvous.etcd.common import parse_conf

    conf = parse_conf(params)
    base = f"{conf.prefix}/{params.run_id}"
    where = f"etcd at {conf.endpoint_str}"
    if params.backend == "etcd-v3":
        from elaunch.rendezvous.etcd.v3 import EtcdV3KV, EtcdV3StateBackend

        kv: Any = EtcdV3KV(conf)
        backend: RendezvousBackend = EtcdV3StateBackend(kv, f"{base}/state", f"{base}/nodes/")
    else:
        from elaunch.rendezvous.etcd.v2 import EtcdV2KV, EtcdV2StateBackend

        kv = EtcdV2KV(conf, params.backend)
        backend = EtcdV2StateBackend(kv, f"{base}/state", params.backend)
    return Reader(backend, where, conf.endpoint_str, params.run_id, settings, read_timeout, close=kv.close)


@dataclass
class Snapshot:
    """One read of the job: the state (heartbeat keys folded in) and the agents' records.

    Attributes:
        state: the rendezvous state.
        agents: node id -> its ``agent`` record (``elaunch.agent.published``), where one was published.
        read_at: seconds since the epoch of the read.
        checkpoints: node id -> its ``checkpoint`` record (the in-memory checkpoints' newest step, its
            time, bytes held: ``elaunch.checkpoint.keeper``), where one was published.
        node_checks: node id -> its ``node_check`` record (``--node-check``'s last verdicts:
            ``elaunch.agent.node_check``), where one was published.
        stragglers: node id -> its ``straggler`` record (the straggler watch's named ranks:
            ``elaunch.agent.straggler_watch``), where one was published.
    """

    state: RendezvousState
    agents: dict[str, dict]
    read_at: float
    checkpoints: dict[str, dict] = field(default_factory=dict)
    node_checks: dict[str, dict] = field(default_factory=dict)
    stragglers: dict[str, dict] = field(default_factory=dict)


def _decode_docs(raw: dict[str, bytes]) -> dict[str, dict]:
    out = {}
    for node, data in raw.items():
        try:
            doc = json.loads(data)
        except (ValueError, UnicodeDecodeError):
            continue  # not ours to judge: shown as unknown
        if isinstance(doc, dict):
            out[node] = doc
    return out


def _nodes(state: RendezvousState) -> list[str]:
    return sorted(set(state.participants) | state.wait_list | state.redundancy_list)


def snapshot(reader: Reader) -> Snapshot:
    """Read the state and the agents' records of its nodes.

    Raises:
        StatusError: no rendezvous of this run id at the endpoint, the endpoint is
            unreachable (after ``read_timeout`` seconds), or the state is corrupt.
    """
    what = f"reading rendezvous {reader.run_id!r} from the {reader.where}"
    try:
        if reader.exists is not None and not _bounded(reader.exists, reader.read_timeout, what):
            raise StatusError(f"no rendezvous {reader.run_id!r} at the {reader.where} (wrong --rdzv-id?)")
        state, _token = _bounded(lambda: read_state(reader.backend), reader.read_timeout, what)
        read_at = time.time()
        if state == RendezvousState():  # nothing stored (etcd: no key; c10d: only the empty marker)
            raise StatusError(f"no rendezvous {reader.run_id!r} at the {reader.where} (wrong --rdzv-id, "
                              f"or the job's state expired?)")
        agents = _decode_docs(reader.backend.get_node_keys("agent", _nodes(state)))
        checkpoints = _decode_docs(reader.backend.get_node_keys("checkpoint", sorted(state.participants)))
        node_checks = _decode_docs(reader.backend.get_node_keys("node_check", _nodes(state)))
        stragglers = _decode_docs(reader.backend.get_node_keys("straggler", sorted(state.participants)))
    except RendezvousError as exc:
        raise StatusError(_first_line(exc)) from exc
    return Snapshot(state, agents, read_at, checkpoints, node_checks, stragglers)


@dataclass
class StacksAnswer:
    """What the agents answered to one stack-dump request.

    Attributes:
        dump_id: the request's id (``RendezvousState.dump_id``).
        docs: node id -> its ``stacks`` record for this request.
        missing: the asked nodes that did not answer in time (sorted).
    """

    dump_id: int
    docs: dict[str, dict]
    missing: list[str]


def request_stacks(reader: Reader, nodes: list[str], timeout: float,
                   sleep: Callable[[float], None] = time.sleep) -> StacksAnswer:
    """Ask every agent for its workers' stacks and wait up to ``timeout`` seconds for ``nodes``' answers.

    The request is one compare-and-set of the state: ``dump_id`` + 1 with no
    ``dump_by`` (``job_ops.request_dump(state, None)``), which agents answer as a
    person's request, not a hang. Answers are the agents' ``stacks`` keys.

    Raises:
        StatusError: the request could not be written (unreachable, no state).
    """
    backend = reader.backend
    deadline = time.monotonic() + reader.read_timeout
    try:
        while True:
            data, token = backend.get_state()
            if data is None:
                raise StatusError(f"no rendezvous {reader.run_id!r} at the {reader.where}")
            state = job_ops.request_dump(RendezvousState.from_bytes(data), None)
            result = backend.set_state(state.to_bytes(), token)
            if result is not None and result[2]:
                break
            if time.monotonic() > deadline:
                raise StatusError(f"could not write the stack-dump request to the {reader.where} within "
                                  f"read_timeout={reader.read_timeout:g} s")
            sleep(0.01)
        dump_id = state.dump_id
        docs: dict[str, dict] = {}
        end = time.monotonic() + timeout
        while True:
            left = [n for n in nodes if n not in docs]
            found = _decode_docs(backend.get_node_keys("stacks", left)) if left else {}
            docs.update({n: d for n, d in found.items() if d.get("dump_id") == dump_id})
            if len(docs) == len(nodes) or time.monotonic() >= end:
                return StacksAnswer(dump_id, docs, sorted(set(nodes) - set(docs)))
            sleep(0.2)
    except RendezvousError as exc:
        raise StatusError(_first_line(exc)) from exc
