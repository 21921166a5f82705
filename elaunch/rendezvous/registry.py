"""Backend name -> handler factory, imported lazily (mirrors torch's rendezvous ``registry``).

Importing this module imports no backend: torch and etcd clients are loaded only
when their factory runs, so ``import elaunch.agent`` stays light.

Besides the built-in backends, a name registered in the ``torchrun.handlers``
entry-point group (torch's out-of-tree rendezvous plugins) is a backend too: it is
looked up only when a name is not built in (start-up never scans entry points for
``c10d`` or ``static``), and its torch handler runs behind an adapter
(:mod:`elaunch.rendezvous.torch_handlers`). So is a creator a program registered in torch's
``rendezvous_handler_registry`` before it called elaunch's Python API, as torch's launcher would use it.
"""

from __future__ import annotations

import importlib
import logging
import sys
from typing import Any, Callable

from elaunch.rendezvous.contract import RendezvousConfigError, RendezvousHandler, RendezvousParameters

Factory = Callable[[RendezvousParameters], RendezvousHandler]


def _lazy(module: str, attr: str = "create_handler", background: bool = False, supervised: bool = False) -> Factory:
    def factory(params: RendezvousParameters, **kw) -> RendezvousHandler:
        return getattr(importlib.import_module(module), attr)(params, **kw)

    factory.store_in_background = background  # type: ignore[attr-defined]
    factory.supervised = supervised  # type: ignore[attr-defined]  # takes supervisor=: its threads run there
    return factory


#: elaunch's torch-free single-node backend: ``--standalone`` (and a single-node
#: static job without an endpoint) picks it; it is no ``--rdzv-backend`` value.
STANDALONE_BACKEND = "standalone"
#: Backends whose ``--rdzv-endpoint`` is a comma-separated list of etcd servers.
ENDPOINT_LIST_BACKENDS = frozenset({"etcd", "etcd-v2", "etcd-v3"})

_FACTORIES: dict[str, Factory] = {
    "static": _lazy("elaunch.rendezvous.static"),
    "c10d": _lazy("elaunch.rendezvous.c10d", background=True, supervised=True),
    "etcd": _lazy("elaunch.rendezvous.etcd.v2", supervised=True),
    "etcd-v2": _lazy("elaunch.rendezvous.etcd.v2", supervised=True),
    "etcd-v3": _lazy("elaunch.rendezvous.etcd.v3", supervised=True),
    STANDALONE_BACKEND: _lazy("elaunch.rendezvous.standalone"),
}


#: torch's entry-point group of out-of-tree rendezvous handlers (``torchrun.handlers``).
HANDLERS_GROUP = "torchrun.handlers"
#: The built-in backends: a name registered later (``register``, a plugin) is not one of them.
_BUILTIN = frozenset(_FACTORIES)


def _entry_point(name: str) -> Any:
    """Return the ``torchrun.handlers`` entry point called ``name``, or None (scans the installed packages)."""
    from importlib.metadata import entry_points  # only for a name that is not built in

    found = entry_points(group=HANDLERS_GROUP).select(name=name)
    return next(iter(found), None)


def plugin_backend_names() -> tuple[str, ...]:
    """Return the names in the ``torchrun.handlers`` entry-point group that are not built in, sorted.

    Scans the installed packages' metadata (tens of milliseconds): used for messages only.
    """
    from importlib.metadata import entry_points

    return tuple(sorted({ep.name for ep in entry_points(group=HANDLERS_GROUP)} - set(_FACTORIES)))


def is_builtin(name: str) -> bool:
    """Return True when ``name`` is one of elaunch's own backends (no entry point consulted)."""
    return name in _BUILTIN


def is_user_backend(name: str) -> bool:
    """Return True when ``--rdzv-backend`` accepts ``name``.

    A registered backend other than the internal :data:`STANDALONE_BACKEND`, a
    name of the ``torchrun.handlers`` entry-point group (looked up only for a name
    not registered, as torchrun's out-of-tree handlers), or a name a program
    registered in torch's ``rendezvous_handler_registry``.
    """
    if name == STANDALONE_BACKEND:
        return False
    return name in _FACTORIES or _entry_point(name) is not None or _torch_creator(name) is not None


def _torch_creator(name: str) -> Callable[[Any], Any] | None:
    """The creator a program registered as ``name`` in torch's ``rendezvous_handler_registry``, or None (looked
    at only when torch's rendezvous package is imported: a program that registered one has imported it)."""
    if "torch.distributed.elastic.rendezvous" not in sys.modules:
        return None
    from elaunch.rendezvous.torch_handlers import registered_creator

    return registered_creator(name)


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


def _torch_factory(name: str) -> Factory | None:
    """The factory of a torch handler registered as ``name`` outside elaunch: a ``torchrun.handlers`` entry
    point (registered here once found), else (when the caller has imported torch's rendezvous package, as a
    program that registered one has) a creator in torch's ``rendezvous_handler_registry``. None: neither."""
    entry_point = _entry_point(name)
    if entry_point is not None:
        from elaunch.rendezvous.torch_handlers import plugin_factory

        factory = plugin_factory(name, entry_point)
        register(name, factory)  # an installed package's: it stays
        return factory
    creator = _torch_creator(name)  # looked up again each time: the program may register another one
    if creator is None:
        return None
    from elaunch.rendezvous.torch_handlers import registered_factory

    return registered_factory(name, creator)


def create_handler(params: RendezvousParameters, store_in_background: bool = False,
                   supervisor=None) -> RendezvousHandler:
    """Build the handler of ``params.backend`` (torch: ``rendezvous_handler_registry.create_handler``).

    ``store_in_background``: the agent's own launch (``elaunch.launch``). A backend that
    can (c10d with a port) then makes its store in a background thread, and reports its
    connection errors at the handler's first use instead of here; torch's import
    overlaps the agent's start (its first warm spares). Ignored by the others.

    ``supervisor``: the launch's ``elaunch.supervision.Supervisor``; a backend whose handler
    keeps threads of its own (the dynamic ones: c10d, etcd, etcd-v2, etcd-v3; their keep-alive)
    declares them on it. Ignored by the others; None: a handler runs them on a supervisor of its own.

    ``--rdzv-conf`` keys the backend does not read are accepted, as torch's backends
    ignore them, and named in one warning line (``--rdzv-conf: the c10d rendezvous
    does not use timeout; ignored``); the keys it reads keep their strict checks.

    A name not built in is looked up in the ``torchrun.handlers`` entry-point group, then
    in torch's ``rendezvous_handler_registry`` (a creator a program registered at run time);
    its torch handler is wrapped (:mod:`elaunch.rendezvous.torch_handlers`).

    Raises:
        RendezvousConfigError: unknown backend name (the message lists the known
            ones, entry points included), a parameter the backend rejects, or a
            ``torchrun.handlers`` entry point that fails to load.
        RendezvousConnectionError: the backend could not be reached.
    """
    factory = _FACTORIES.get(params.backend)
    if factory is None and params.backend != STANDALONE_BACKEND:
        factory = _torch_factory(params.backend)
    if factory is None:
        known = (*user_backend_names(), *plugin_backend_names())
        raise RendezvousConfigError(
            f"--rdzv-backend={params.backend}: unknown rendezvous backend (known: {', '.join(known)})"
        )
    given = dict(params.config)
    kw: dict[str, Any] = {}
    if store_in_background and getattr(factory, "store_in_background", False):
        kw["store_in_background"] = True
    if supervisor is not None and getattr(factory, "supervised", False):
        kw["supervisor"] = supervisor
    handler = factory(params, **kw)
    unused = params.unused_keys(given)
    if unused:
        logging.getLogger("elaunch").warning(
            "--rdzv-conf: the %s rendezvous does not use %s; ignored", params.backend, ", ".join(unused))
    return handler
