"""Rendezvous handlers registered for torchrun (``torchrun.handlers``), as torch 2.13 loads them.

Each entry point's object is called with no argument and returns the creator
``(RendezvousParameters) -> RendezvousHandler``.

* ``elaunch-test-c10d``: torch's own c10d dynamic rendezvous under a new name.
* ``elaunch-test-misnamed``: torch's c10d handler whose ``get_backend()`` is not the
  registered name (torchrun's registry rejects it).
"""

from __future__ import annotations

from torch.distributed.elastic.rendezvous import RendezvousHandler
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import create_backend
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler


class Renamed(RendezvousHandler):
    """A torch handler answering ``get_backend()`` with ``name``; everything else is the wrapped one's."""

    def __init__(self, handler, name):
        self._handler = handler
        self._name = name

    def get_backend(self):
        return self._name

    @property
    def use_agent_store(self):
        return self._handler.use_agent_store

    def next_rendezvous(self):
        return self._handler.next_rendezvous()

    def is_closed(self):
        return self._handler.is_closed()

    def set_closed(self):
        self._handler.set_closed()

    def num_nodes_waiting(self):
        return self._handler.num_nodes_waiting()

    def get_run_id(self):
        return self._handler.get_run_id()

    def shutdown(self):
        return self._handler.shutdown()

    def __getattr__(self, name):
        return getattr(self._handler, name)


def _c10d(params):
    backend, store = create_backend(params)
    return create_handler(store, backend, params)


def c10d_creator():
    return lambda params: Renamed(_c10d(params), "elaunch-test-c10d")


def misnamed_creator():
    return _c10d
