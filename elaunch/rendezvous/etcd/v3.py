"""``etcd-v3`` rendezvous: the dynamic rendezvous over etcd's v3 gRPC API (etcd-sdk-python, ``pyetcd``).

New in elaunch (torchrun only speaks the v2 API, which etcd 3.6 removed): works
against an etcd serving v3 only. Same conf keys as ``etcd-v2`` plus ``user`` /
``password``. Compared with v2:

* compare-and-set is a transaction on the state key's ``mod_revision``;
* each node keeps a presence key ``{etcd_prefix}/{run_id}/nodes/{node_id}`` on its
  own lease (TTL = ``keep_alive_interval * keep_alive_max_attempt`` seconds, kept
  alive by a thread): when an agent dies its key expires and the others see it
  dead at their next read, without waiting for stale heartbeats;
* waiting agents watch the state key and wake on a change (``poll_interval``,
  default 1 s here, only bounds time-driven steps such as the last call); every
  round's completion notice, and every write of the state a running member's
  monitor must see, arrive on one standing watch (``etcd.standing``);
* the state and round keys are on a lease of ``ttl`` seconds (default 7200), so an
  abandoned run id is cleaned up by etcd.

The key-value client (gets, transactions, watches, fail-over) is ``etcd.v3_kv``.
Reach this module through ``elaunch.rendezvous.registry`` only: it imports grpc.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from collections.abc import Callable

from elaunch.rendezvous.contract import RendezvousParameters, RendezvousStateError
from elaunch.rendezvous.dynamic.backend import Token
from elaunch.rendezvous.dynamic.settings import RendezvousSettings
from elaunch.rendezvous.dynamic.stalls import beat_timeout
from elaunch.rendezvous.dynamic.state import RendezvousState
from elaunch.rendezvous.etcd.common import import_client, parse_conf
from elaunch.rendezvous.etcd.base import EtcdRendezvousHandler, EtcdStateBackend, build_handler
from elaunch.rendezvous.etcd.presence import Presence
from elaunch.rendezvous.etcd.v3_kv import RPC_TIMEOUT, EtcdV3KV

__all__ = ["DEFAULT_POLL_INTERVAL", "RPC_TIMEOUT", "EtcdV3KV", "EtcdV3StateBackend", "create_handler",
           "import_client"]

#: Default ``poll_interval`` of etcd-v3 (seconds): watches wake waiting agents on changes.
DEFAULT_POLL_INTERVAL = 1.0
#: A state read with the heartbeats of at most this many nodes reads their keys one by one
#: in its transaction (the monitor's: itself and its ring neighbours); more read the prefixes.
FEW_NODES = 4


class EtcdV3StateBackend(EtcdStateBackend):
    """The state key plus the presence keys: a node without a live presence key reads as dead.

    ``get_state`` reports the last heartbeat of such a node as 0 (the epoch), so the
    shared state machine prunes it at once; the stored bytes are untouched until a
    node writes. The token is the state key's ``mod_revision``.

    Also batched joins and heartbeat keys (``dynamic/batching.py``), under
    ``{base}``: ``heartbeat/{node}`` (a put, no compare-and-set), round r's intent
    log ``intents/r/{node}:{time}`` (its position is the newest create revision),
    ``combiner/r`` (written by the round's first join, in the same transaction)
    and the completion notice ``round/r/done``. Waiting is a watch.

    Args:
        kv: the client.
        key: the state key.
        nodes_prefix: ``{base}/nodes/``.
        beat_timeout: seconds one keep-alive heartbeat may take, fail-over included
            (``stalls.beat_timeout``), before it is given up for the next.
    """

    def __init__(self, kv: EtcdV3KV, key: str, nodes_prefix: str, beat_timeout: float = RPC_TIMEOUT) -> None:
        super().__init__(kv, key, "etcd-v3")
        self.nodes_prefix = nodes_prefix
        self.beat_timeout = beat_timeout
        self._base = nodes_prefix[: -len("nodes/")]

    @property
    def cheap_heartbeats(self) -> bool:
        return False  # every put is a raft write: heart-beat at keep_alive_interval only

    def put_heartbeat(self, node_id: str, at: float) -> None:
        assert isinstance(self.kv, EtcdV3KV)
        self.kv.put_many([(f"{self._base}heartbeat/{node_id}", repr(at).encode())])

    def beat(self, node_id: str, at: float) -> None:
        """The keep-alive's heartbeat: :meth:`put_heartbeat`, given up after ``beat_timeout`` seconds."""
        assert isinstance(self.kv, EtcdV3KV)
        self.kv.put_within(f"{self._base}heartbeat/{node_id}", repr(at).encode(), self.beat_timeout)

    def get_heartbeats(self, nodes) -> dict[str, float]:
        return self._read(None)[4]

    @property
    def written_key(self) -> str:
        """``{base}/round/state_written``: put with every write of the state, under the standing watch."""
        return f"{self._base}round/state_written"

    def _write_state(self, state: bytes, token: Token | None) -> Token | None:
        """A write of the state also puts :attr:`written_key` (a few bytes), in its transaction.

        Running members learn of the write from that key's event on the standing
        watch they already have: no watch of the 76 KB state (at 1,024 nodes) per
        agent and round, and a write sends each of them a few bytes, not the state.
        """
        assert isinstance(self.kv, EtcdV3KV)
        return self.kv.cas(self.key, state, token, also=((self.written_key, b""),))

    def watch_state(self, on_change: Callable[[], None]) -> Callable[[], None] | None:
        """``RendezvousBackend.watch_state``: ``on_change()`` on each event of :attr:`written_key`.

        Listens on the agent's standing watch (``EtcdV3KV.listen``): no request. None
        without one (a client without ``keep_watching``): the monitor then re-reads the
        state every ``poll_interval`` seconds, as it does while the watch is broken.
        """
        assert isinstance(self.kv, EtcdV3KV)
        return self.kv.listen(self.written_key, on_change)

    def get_state_and_heartbeats(self, nodes) -> tuple[bytes | None, Token, dict[str, float]]:
        if len(nodes) > FEW_NODES:
            data, token, _log, _pos, beats = self._read(None)
            return data, token, beats
        # a few nodes (the monitor's: itself and its ring neighbours): their presence and
        # heartbeat keys, not every node's; only those are judged by their presence
        assert isinstance(self.kv, EtcdV3KV)
        keys = {n: (f"{self.nodes_prefix}{n}", f"{self._base}heartbeat/{n}") for n in nodes}
        data, token, found = self.kv.read_keys(self.key, [k for pair in keys.values() for k in pair])
        alive = {n for n, (presence, _beat) in keys.items() if presence in found}
        beats: dict[str, float] = {}
        for n in alive:
            try:
                beats[n] = float(found[keys[n][1]])
            except (KeyError, ValueError):
                continue
        return self._zero_dead(data, alive, judged=set(nodes)), token, beats

    @property
    def supports_intents(self) -> bool:
        return True

    def post_intent(self, round: int, intent: bytes) -> bool:
        assert isinstance(self.kv, EtcdV3KV)
        doc = json.loads(intent)
        item = (f"{self._base}intents/{round}/{doc['node']}:{doc['at']!r}", intent)
        return self.kv.put_many([item, (f"{self._base}combiner/{round}", intent)],
                                unless_exists=f"{self._base}combiner/{round}", otherwise=[item])

    def get_state_and_intents(self, round: int, nodes=()) -> tuple[bytes | None, Token, bytes, int, dict[str, float]]:
        return self._read(round)

    def wait_for_arrival(self, round: int, position: int, timeout: float) -> bool:
        assert isinstance(self.kv, EtcdV3KV)
        return self.kv.watch(f"{self._base}intents/{round}/", timeout, prefix=True, start_revision=position + 1)

    def notify_round(self, round: int) -> None:
        assert isinstance(self.kv, EtcdV3KV)
        self.kv.put_many([(f"{self._base}round/{round}/done", b"1"), (f"{self._base}intents/{round}/~notice", b"")])

    def wait_for_round(self, round: int, timeout: float) -> bool:
        assert isinstance(self.kv, EtcdV3KV)
        return self.kv.watch(f"{self._base}round/{round}/done", timeout, exists=True)

    def _read(self, round: int | None) -> tuple[bytes | None, Token, bytes, int, dict[str, float]]:
        """State (dead nodes zeroed), intent log of ``round``, its position and live nodes' heartbeats."""
        assert isinstance(self.kv, EtcdV3KV)
        prefixes = [self.nodes_prefix, f"{self._base}heartbeat/"]
        if round is not None:
            prefixes.append(f"{self._base}intents/{round}/")
        data, token, (alive, beats, *log_items) = self.kv.read_many(self.key, prefixes)
        names = {name for name, *_rest in alive}
        heartbeats: dict[str, float] = {}
        for name, value, *_revs in beats:
            if name in names:  # a node without presence is dead, whatever its last beat says
                try:
                    heartbeats[name] = float(value)
                except ValueError:
                    continue
        items = sorted(log_items[0], key=lambda item: item[2]) if log_items else []  # by creation
        log_bytes = b"".join(v if v.endswith(b"\n") else v + b"\n" for _n, v, _c, _m in items if v)
        position = max((mod for *_rest, mod in items), default=0)
        return self._zero_dead(data, names), token, log_bytes, position, heartbeats

    def get_state(self) -> tuple[bytes | None, Token]:
        assert isinstance(self.kv, EtcdV3KV)
        data, token, alive = self.kv.get_with_prefix(self.key, self.nodes_prefix)
        return self._zero_dead(data, alive), token

    def get_stored_state(self) -> tuple[bytes | None, Token]:
        return super().get_state()  # the state key alone: no presence keys, no decode here

    def get_state_token(self) -> Token:
        assert isinstance(self.kv, EtcdV3KV)
        return self.kv.revision(self.key)  # the revision alone: ~100 bytes, not the ~70 KB state at 1024

    @staticmethod
    def _zero_dead(data: bytes | None, alive: set[str], judged: set[str] | None = None) -> bytes | None:
        """The state with the heartbeat of each node (of ``judged``; None: all) not in ``alive`` set to 0."""
        if data is None or (judged is not None and not judged):
            return data  # no one to judge: no decode
        try:
            state = RendezvousState.from_bytes(data)
        except RendezvousStateError:
            return data  # not a state: the executor reports it when it decodes it
        gone = [n for n in state.last_heartbeats if n not in alive and (judged is None or n in judged)]
        if not gone:
            return data
        for node in gone:
            state.last_heartbeats[node] = 0.0  # ANY -> DEAD: its lease expired or was revoked
        return state.to_bytes()


def create_handler(params: RendezvousParameters, supervisor=None) -> EtcdRendezvousHandler:
    """Build an ``etcd-v3`` dynamic rendezvous handler and register this node's presence lease.

    Conf keys: those of ``etcd-v2`` (endpoints, ``protocol``, ``ca_cert``,
    ``ssl_cert``, ``ssl_cert_key``, ``read_timeout``, ``etcd_prefix``, ``ttl``),
    ``user``/``password``, and the dynamic rendezvous' timeouts;
    ``poll_interval`` defaults to 1 s (watches wake agents on changes). ``supervisor``: the
    launch's ``elaunch.supervision.Supervisor``, which runs the keep-alive thread (None: the handler's own).

    Raises:
        RendezvousConfigError: bad conf value, wrong credentials, or etcd-sdk-python
            missing (``pip install 'elaunch[etcd]'``).
        RendezvousConnectionError: no endpoint answered within ``read_timeout`` seconds.
    """
    config = dict(params.config)
    config.setdefault("poll_interval", str(DEFAULT_POLL_INTERVAL))
    if params.get("timeout") is not None and "join_timeout" not in config:
        config["join_timeout"] = config["timeout"]
    params = replace(params, config=config)
    conf = parse_conf(params)
    settings = RendezvousSettings.from_params(params)
    base = f"{conf.prefix}/{params.run_id}"
    kv = EtcdV3KV(conf)
    backend = EtcdV3StateBackend(kv, f"{base}/state", f"{base}/nodes/", beat_timeout(settings))
    holder: list[Presence] = []
    handler = build_handler(params, conf, kv, "etcd-v3", backend=backend, settings=settings,
                            on_close=(lambda: holder and holder[0].stop(),), supervisor=supervisor)
    presence = Presence(EtcdV3KV(conf), f"{base}/nodes/{handler.node_id}", math.ceil(settings.dead_after))
    try:
        kv.grant_key_lease()  # now, not in the round: a join's first write would wait for it
        presence.start()
    except BaseException:
        kv.close()
        presence.kv.close()
        raise
    holder.append(presence)
    # every round's completion notice and workers' address are waited for on one watch,
    # opened now (etcd answered)
    kv.keep_watching(f"{base}/round/")
    kv.start_opener()  # a broken watch is opened again there: no round starts a thread
    return handler
