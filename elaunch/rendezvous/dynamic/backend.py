"""The one interface a storage backend implements for the dynamic rendezvous.

Mirrors torch's ``RendezvousBackend`` (``dynamic_rendezvous.py``): an opaque
blob read and written with compare-and-set. c10d (TCPStore) implements it now;
etcd v2/v3 later. Stdlib only.
"""

from __future__ import annotations

import abc
from typing import Any

#: Opaque version marker of a stored state: whatever the backend compares on
#: (c10d: the stored bytes themselves; etcd: a revision / modified index).
Token = Any


class RendezvousBackend(abc.ABC):
    """Stores one run id's rendezvous state blob with compare-and-set."""

    @property
    @abc.abstractmethod
    def name(self) -> str:
        """The backend's registry name (``"c10d"``, ...)."""

    @abc.abstractmethod
    def get_state(self) -> tuple[bytes | None, Token]:
        """Return the stored state and its token; ``(None, token)`` when none was written yet.

        Raises:
            RendezvousConnectionError: the backend cannot be reached.
        """

    @abc.abstractmethod
    def set_state(self, state: bytes, token: Token | None) -> tuple[bytes, Token, bool] | None:
        """Write ``state`` if the stored one still has ``token`` (None: nothing stored yet).

        Returns:
            ``(current_state, current_token, written)``: what is stored after the
            attempt and whether it is ours; or None when the backend cannot tell
            (the caller reads again).

        Raises:
            RendezvousConnectionError: the backend cannot be reached.
        """
