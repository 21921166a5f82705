"""torch's out-of-tree rendezvous handlers (the ``torchrun.handlers`` entry points) under elaunch.

A package registers a torchrun rendezvous backend as torch 2.13's
``_register_out_of_tree_handlers`` reads it: an entry point in the
``torchrun.handlers`` group whose object, called with no argument, returns the
handler creator ``(torch RendezvousParameters) -> torch RendezvousHandler``::

    [project.entry-points."torchrun.handlers"]
    my-backend = "my_pkg.rdzv:get_creator"

:func:`plugin_factory` turns such an entry point into an elaunch registry factory:
it builds torch's ``RendezvousParameters`` from elaunch's, calls the creator and
wraps the torch handler in :class:`TorchHandlerAdapter`, elaunch's
``RendezvousHandler``. Imports torch: reached only through
``elaunch.rendezvous.registry``, for a backend name that is not built in.
"""

from __future__ import annotations

import json
import logging
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Callable

import torch.distributed as dist
from torch.distributed.elastic.rendezvous import api as tapi
from torch.distributed.elastic.utils import store as store_util

from elaunch.rendezvous.contract import (
    NodeInfo,
    RendezvousClosedError,
    RendezvousConfigError,
    RendezvousConnectionError,
    RendezvousError,
    RendezvousGracefulExitError,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStateError,
    RendezvousTimeoutError,
)

log = logging.getLogger(__name__)

#: torch's default rendezvous timeout in seconds: its ``LaunchConfig`` adds
#: ``rdzv_configs["timeout"] = 900`` when the user gave none, so creators see it.
DEFAULT_TIMEOUT = 900
#: Where each node publishes its NodeInfo in the round's store (torch's agent
#: publishes its role info under ``torchelastic/role_info/<group rank>`` the same way).
NODE_INFO_PREFIX = "elaunch/node_info/"
#: The exit barrier's key prefix (torch's agent: ``torchelastic/agent/terminal_state``).
EXIT_BARRIER_PREFIX = "torchelastic/agent/terminal_state"

#: torch's rendezvous errors -> elaunch's, most specific first (one table, at the boundary).
_ERRORS: tuple[tuple[type[BaseException], type[RendezvousError]], ...] = (
    (tapi.RendezvousGracefulExitError, RendezvousGracefulExitError),
    (tapi.RendezvousClosedError, RendezvousClosedError),
    (tapi.RendezvousTimeoutError, RendezvousTimeoutError),
    (tapi.RendezvousConnectionError, RendezvousConnectionError),
    (tapi.RendezvousStateError, RendezvousStateError),
    (tapi.RendezvousError, RendezvousError),
    (dist.DistNetworkError, RendezvousConnectionError),
    (dist.DistStoreError, RendezvousConnectionError),
)


@contextmanager
def _translated(backend: str, doing: str) -> Iterator[None]:
    """Re-raise torch's rendezvous and store errors as elaunch's, naming the backend, ``from`` the original."""
    try:
        yield
    except RendezvousError:
        raise
    except Exception as exc:
        for theirs, ours in _ERRORS:
            if isinstance(exc, theirs):
                raise ours(f"--rdzv-backend={backend}: {doing}: {exc}") from exc
        raise


def torch_parameters(params: RendezvousParameters) -> Any:
    """Return torch's ``RendezvousParameters`` for elaunch's ``params``, as torchrun builds them.

    The ``--rdzv-conf`` entries become its keyword arguments (string values, as
    torchrun parses them) plus ``timeout=900`` when not given (torch's
    ``LaunchConfig`` default). Every key counts as read: the creator gets them all.

    Raises:
        RendezvousConfigError: torch rejects the parameters (a ValueError).
    """
    config = {key: params.get(key) for key in params.config}
    config.setdefault("timeout", DEFAULT_TIMEOUT)
    try:
        return tapi.RendezvousParameters(
            backend=params.backend, endpoint=params.endpoint, run_id=params.run_id,
            min_nodes=params.min_nodes, max_nodes=params.max_nodes, local_addr=params.local_addr, **config,
        )
    except ValueError as exc:
        raise RendezvousConfigError(f"--rdzv-backend={params.backend}: {exc}") from exc


class TorchHandlerAdapter(RendezvousHandler):
    """elaunch's ``RendezvousHandler`` over a torch ``RendezvousHandler`` (a torchrun plugin's).

    Rounds are numbered by this node's calls to :meth:`next_rendezvous` (torch's
    handlers have no round number). Each round, every node publishes its
    :class:`NodeInfo` in the round's store and reads the others', as torch's agent
    shares its role info there, so nodes with a different ``--nproc-per-node`` get
    torch's global ranks. ``MASTER_ADDR``/``MASTER_PORT`` and
    ``TORCHELASTIC_USE_AGENT_STORE`` are what the torch handler gives
    (``bootstrap_store_info``, ``use_agent_store``). Its job channel is the base
    class's ``LocalJobChannel`` (no job state: each agent counts its own restarts,
    as under torchrun); ``can_reform`` is True: a torch handler may admit waiting
    nodes (its ``num_nodes_waiting``).

    Args:
        handler: the torch handler.
        params: elaunch's parameters it was built from (backend name, role, local world size).
    """

    can_reform = True

    def __init__(self, handler: Any, params: RendezvousParameters) -> None:
        self.handler = handler
        self._backend = params.backend
        self._me = NodeInfo(params.local_addr or socket.getfqdn(), params.role, params.local_world_size)
        self._round = -1
        self._store: Any = None
        self._world_size = 0

    def get_backend(self) -> str:
        """Return the registered name (``--rdzv-backend``)."""
        return self._backend

    def next_rendezvous(self) -> RendezvousInfo:
        """Join the torch handler's next round, then exchange NodeInfos through its store.

        Raises:
            RendezvousClosedError, RendezvousTimeoutError, RendezvousConnectionError,
            RendezvousStateError, RendezvousGracefulExitError: translated from torch's.
        """
        with _translated(self._backend, "joining the rendezvous"):
            info = self.handler.next_rendezvous()
            store, rank, world_size = info.store, info.rank, info.world_size
            boot = info.bootstrap_store_info
            store.set(f"{NODE_INFO_PREFIX}{rank}", json.dumps(
                [self._me.addr, self._me.role, self._me.local_world_size]).encode())
            raw = store.multi_get([f"{NODE_INFO_PREFIX}{r}" for r in range(world_size)])
        nodes = tuple(NodeInfo(addr, role, int(size)) for addr, role, size in (json.loads(bytes(b)) for b in raw))
        self._round += 1
        self._store, self._world_size = store, world_size
        use_agent_store = bool(getattr(self.handler, "use_agent_store", False))
        return RendezvousInfo(
            round=self._round, rank=rank, world_size=world_size,
            master_addr=boot.master_addr if boot is not None else self._me.addr,
            master_port=boot.master_port if boot is not None else 0,
            use_agent_store=use_agent_store, nodes=nodes, store=store,
        )

    def is_closed(self) -> bool:
        with _translated(self._backend, "reading the rendezvous state"):
            return bool(self.handler.is_closed())

    def set_closed(self) -> None:
        with _translated(self._backend, "closing the rendezvous"):
            self.handler.set_closed()

    def num_nodes_waiting(self) -> int:
        with _translated(self._backend, "reading the rendezvous state"):
            return int(self.handler.num_nodes_waiting())

    def get_run_id(self) -> str:
        return str(self.handler.get_run_id())

    def shutdown(self) -> bool:
        with _translated(self._backend, "shutting down"):
            return bool(self.handler.shutdown())

    def exit_barrier(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for every node of the round, in its store, as torch's agent does.

        A barrier that times out or fails is logged, not raised (torch's agent does the same).
        """
        if self._store is None:
            return
        try:
            store_util.barrier(self._store, self._world_size, key_prefix=EXIT_BARRIER_PREFIX,
                               barrier_timeout=timeout)
        except Exception as exc:  # noqa: BLE001 - torch's agent logs and goes on too
            log.warning("exit barrier of the %s rendezvous: %s", self._backend, exc)


def plugin_factory(name: str, entry_point: Any) -> Callable[[RendezvousParameters], RendezvousHandler]:
    """Return the registry factory of the ``torchrun.handlers`` entry point ``name``.

    As torch's ``_register_out_of_tree_handlers``: the entry point's object is
    loaded and called with no argument; the result is the creator. This happens
    once, on the first handler built; the creator then runs for each handler.

    Raises (from the returned factory):
        RendezvousConfigError: the entry point fails to load or to return a creator,
            the creator rejects the parameters (ValueError), or its handler's
            ``get_backend()`` is not ``name`` (torch raises RuntimeError there).
    """
    return _factory(name, lambda: entry_point.load()(), f"the {entry_point.group} entry point {entry_point.value}")


def registered_creator(name: str) -> Callable[[Any], Any] | None:
    """The creator a program registered as ``name`` in torch's ``rendezvous_handler_registry`` at run time
    (``rendezvous_handler_registry.register(name, creator)``, as torch's docs show), or None."""
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry

    return getattr(rendezvous_handler_registry, "_registry", {}).get(name)


def registered_factory(name: str, creator: Callable[[Any], Any]) -> Callable[[RendezvousParameters], RendezvousHandler]:
    """Return the registry factory of a creator registered in torch's registry (:func:`registered_creator`).

    Raises (from the returned factory): as :func:`plugin_factory`'s, but for loading.
    """
    return _factory(name, lambda: creator, "torch's rendezvous_handler_registry")


def _factory(name: str, load: Callable[[], Callable[[Any], Any]], origin: str
             ) -> Callable[[RendezvousParameters], RendezvousHandler]:
    """The registry factory of torch handler creator ``load()`` (loaded once, on the first handler built)."""
    creators: list[Callable[[Any], Any]] = []

    def factory(params: RendezvousParameters) -> RendezvousHandler:
        if not creators:
            try:
                creators.append(load())
            except Exception as exc:  # a broken plugin: one line naming it, as a config error
                raise RendezvousConfigError(
                    f"--rdzv-backend={name}: {origin} failed to load: {type(exc).__name__}: {exc}") from exc
        tparams = torch_parameters(params)
        with _translated(name, "creating the handler"):
            try:
                handler = creators[0](tparams)
            except ValueError as exc:
                raise RendezvousConfigError(f"--rdzv-backend={name}: {exc}") from exc
        if handler.get_backend() != name:
            raise RendezvousConfigError(
                f"--rdzv-backend={name}: the handler's get_backend() is {handler.get_backend()!r}, "
                f"not {name!r} (torchrun rejects it too)")
        return TorchHandlerAdapter(handler, params)

    return factory
