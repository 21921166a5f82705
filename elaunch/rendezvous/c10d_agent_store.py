"""The c10d rendezvous' agent store: hosted by the agent whose address matches the endpoint, reached by the others.

Split from ``c10d.py`` (which keeps the rendezvous backend on that store). torch is
imported where a store is made: :class:`AgentStore` can make it in a background thread, so
torch's import (about a second of CPU) overlaps what the agent does before its first
rendezvous, above all starting its first warm spares (``--warm-start``).
"""

from __future__ import annotations

import datetime
import ipaddress
import logging
import socket
import threading
from collections.abc import Callable
from typing import Any

from elaunch.rendezvous.contract import RendezvousConfigError
from elaunch.rendezvous.c10d_store import _STORE_ERRORS, _translated

log = logging.getLogger("elaunch.rendezvous.c10d")  # the c10d rendezvous' one logger, as before the split


def is_this_machine(host: str, local_addr: str | None = None) -> bool:
    """Return True when ``host`` names this machine (torch ``_matches_machine_hostname``).

    Compares ``host`` and its resolved IPs with the hostname, the FQDN,
    ``local_addr`` and the addresses of the local network interfaces.
    """
    try:
        if host == "localhost" or ipaddress.ip_address(host).is_loopback:
            return True
    except ValueError:
        pass
    names = {socket.gethostname(), socket.getfqdn()} | ({local_addr} if local_addr else set())
    if host in names:
        return True
    host_ips = _resolve(host)
    if not host_ips:
        return False
    mine: set[str] = set()
    for name in names:
        mine |= _resolve(name)
    try:
        import psutil

        mine |= {a.address.split("%")[0] for addrs in psutil.net_if_addrs().values() for a in addrs}
    except Exception:  # noqa: BLE001 - interface listing is a best-effort extra
        pass
    return bool(host_ips & mine)


def _resolve(name: str) -> set[str]:
    try:
        return {info[4][0] for info in socket.getaddrinfo(name, None, proto=socket.IPPROTO_TCP)}
    except (OSError, UnicodeError):
        return set()


def make_agent_store(host: str, port: int, is_host: bool | None, local_addr: str, read_timeout: float,
                     use_libuv: bool) -> tuple[Any, bool]:
    """Host or join the agents' TCPStore; returns ``(store, hosting)``."""
    from torch.distributed import TCPStore

    endpoint = f"{host}:{port}"
    hosting = is_host if is_host is not None else is_this_machine(host, local_addr)
    timeout = datetime.timedelta(seconds=read_timeout)
    if port == 0 and not hosting:
        raise RendezvousConfigError(f"--rdzv-endpoint={endpoint}: port 0 is only allowed on the node hosting the store")
    if hosting:
        try:
            store = TCPStore(host, port, is_master=True, multi_tenant=True, wait_for_workers=False,
                             timeout=timeout, use_libuv=use_libuv)
            log.info("hosting the c10d rendezvous store at %s:%d", host, store.port)
            return store, True
        except _STORE_ERRORS as exc:
            if is_host:
                with _translated(endpoint, "hosting (is_host=true)"):
                    raise
            log.info("could not host the c10d store at %s (%s); connecting as a client", endpoint, exc)
    with _translated(endpoint, f"connecting within read_timeout={read_timeout:g} s"):
        store = TCPStore(host, port, is_master=False, timeout=timeout, use_libuv=use_libuv)
    return store, False


class AgentStore:
    """The agents' store and whether this agent hosts it; a store's interface (every attribute is the store's).

    Made in the caller's thread (``background=False``: an error is raised here, torch's
    contract for ``create_handler``) or in a background thread (the agent's own launch:
    torch's import and the connection overlap what the agent does before its first
    rendezvous). In the background, an error making it (``RendezvousConfigError``,
    ``RendezvousConnectionError``) is raised at each use instead, and a use waits for it;
    the wait can be interrupted by a signal.

    Args:
        make: returns ``(store, hosting)`` (:func:`make_agent_store`, or a file store and False).
        after: when given, ``after(store)`` runs next, in the same thread (the state key's first write).
        background: make it in a background thread.
    """

    def __init__(self, make: Callable[[], tuple[Any, bool]], after: Callable[[Any], None] | None = None,
                 background: bool = False) -> None:
        self._done = threading.Event()
        self._value: tuple[Any, bool] | None = None
        self._error: BaseException | None = None
        if background:
            threading.Thread(target=self._run, args=(make, after), name="elaunch-c10d-store", daemon=True).start()
        else:
            self._run(make, after)
            self.result()  # its error, raised here

    def _run(self, make: Callable[[], tuple[Any, bool]], after: Callable[[Any], None] | None) -> None:
        try:
            value = make()
            if after is not None:
                after(value[0])
            self._value = value
        except BaseException as exc:  # noqa: BLE001 - raised in the thread that uses the store
            self._error = exc
        finally:
            self._done.set()

    def result(self) -> tuple[Any, bool]:
        """``(store, hosting)``, waiting for them.

        Raises:
            RendezvousConfigError, RendezvousConnectionError: making the store failed.
        """
        self._done.wait()
        if self._error is not None:
            raise self._error
        assert self._value is not None
        return self._value

    @property
    def made(self) -> bool:
        """True once the store is made (never waits)."""
        return self._done.is_set() and self._error is None

    @property
    def store(self) -> Any:
        """The torch store (waits for it)."""
        return self.result()[0]

    @property
    def hosting(self) -> bool:
        """True when this agent hosts the store (waits for it)."""
        return self.result()[1]

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)
