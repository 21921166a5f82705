"""Backend name -> handler factory, imported lazily (mirrors torch's rendezvous ``registry``).

Importing this module imports no backend: torch and etcd clients are loaded only
when their factory runs, so ``import elaunch.agent`` stays light.
"""

from __future__ import annotations

import importlib
import logging
from typing import Callable

from elaunch.rendezvous.api import RendezvousConfigError, RendezvousHandler, RendezvousParameters

Factory = Callable[[RendezvousParameters], RendezvousHandler]


def _lazy(module: str, attr: str = "create_handler") -> Factory:
    def factory(params: RendezvousParameters) -> RendezvousHandler:
        return getattr(importlib.import_module(module), attr)(params)

    return factory


#: elaunch's torch-free single-node backend: ``--standalone`` (and a single-node
#: static job without an endpoint) picks it; it is no ``--rdzv-backend`` value.
STANDALONE_BACKEND = "standalone"
#: Backends whose ``--rdzv-endpoint`` is a comma-separated list of etcd servers.
ENDPOINT_LIST_BACKENDS = frozenset({"etcd", "etcd-v2", "etcd-v3"})

_FACTORIES: dict[str, Factory] = {
    "static": _lazy("elaunch.rendezvous.static"),
    "c10d": _lazy("elaunch.rendezvous.c10d"),
    "etcd": _lazy("elaunch.rendezvous.etcd_v2"),
    "etcd-v2": _lazy("elaunch.rendezvous.etcd_v2"),
    "etcd-v3": _lazy("elaunch.rendezvous.etcd_v3"),
    STANDALONE_BACKEND: _lazy("elaunch.rendezvous.standalone"),
}


def backend_names() -> tuple[str, ...]:
    """Return the registered backend names, sorted."""
    return tuple(sorted(_FACTORIES))


def user_backend_names() -> tuple[str, ...]:
    """Return the names ``--rdzv-backend`` accepts, in registration order.

    Every registered backend but the internal :data:`STANDALONE_BACKEND`:
    ``("static", "c10d", "etcd", "etcd-v2", "etcd-v3")`` plus any registered later.
    """
    return tuple(name for name in _FACTORIES if name != STANDALONE_BACKEND)


def register(name: str, factory: Factory) -> None:
    """Register (or replace) the factory of backend ``name`` (for later backends and tests)."""
    _FACTORIES[name] = factory


def create_handler(params: RendezvousParameters) -> RendezvousHandler:
    """Build the handler of ``params.backend`` (torch: ``rendezvous_handler_registry.create_handler``).

    ``--rdzv-conf`` keys the backend does not read are accepted, as torch's backends
    ignore them, and named in one warning line (``--rdzv-conf: the c10d rendezvous
    does not use timeout; ignored``); the keys it reads keep their strict checks.

    Raises:
        RendezvousConfigError: unknown backend name (the message lists the known
            ones), or a parameter the backend rejects.
        RendezvousConnectionError: the backend could not be reached.
    """
    factory = _FACTORIES.get(params.backend)
    if factory is None:
        raise RendezvousConfigError(
            f"--rdzv-backend={params.backend}: unknown rendezvous backend (known: {', '.join(backend_names())})"
        )
    given = dict(params.config)
    handler = factory(params)
    unused = params.unused_keys(given)
    if unused:
        logging.getLogger("elaunch").warning(
            "--rdzv-conf: the %s rendezvous does not use %s; ignored", params.backend, ", ".join(unused))
    return handler
