"""Base of the handlers that decide a round alone, with no store (standalone, static).

Stdlib only. Such a handler never has nodes waiting, counts rounds by calls to
``next_rendezvous`` and is closed only by its own node.
"""

from __future__ import annotations

from elaunch.rendezvous.contract import RendezvousClosedError, RendezvousHandler


class LocalRendezvous(RendezvousHandler):
    """Round counting and closing for handlers that need no other node to form a round.

    Args:
        backend: the registry name reported by ``get_backend``.
        run_id: the job id (``TORCHELASTIC_RUN_ID``).
    """

    def __init__(self, backend: str, run_id: str) -> None:
        self._backend = backend
        self._run_id = run_id
        self._round = -1
        self._closed = False

    def _next_round(self) -> int:
        """Return the next round number (0 on the first call).

        Raises:
            RendezvousClosedError: ``set_closed`` was called.
        """
        if self._closed:
            raise RendezvousClosedError(f"rendezvous {self._run_id!r} is closed")
        self._round += 1
        return self._round

    def get_backend(self) -> str:
        return self._backend

    def get_run_id(self) -> str:
        return self._run_id

    def is_closed(self) -> bool:
        return self._closed

    def set_closed(self) -> None:
        self._closed = True

    def num_nodes_waiting(self) -> int:
        return 0
