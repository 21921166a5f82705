"""Rendezvous endpoints: the one ``host[:port]`` parser (stdlib only).

Every place that reads an endpoint uses :func:`parse_endpoint` (one address) or
:func:`parse_endpoints` (an etcd server list): the ``--rdzv-endpoint`` check in
``elaunch.config``, the static and c10d backends, and the etcd backends. The
callers differ only in what they allow, named by the keyword arguments: the
command line wants a port in 1-65535 and brackets around an IPv6 address
(``::1:29400`` is ambiguous), a backend also takes port 0 (any free port) and a
bare IPv6 address, as torch's ``parse_rendezvous_endpoint``.
"""

from __future__ import annotations

import re

from elaunch.rendezvous.contract import RendezvousConfigError

__all__ = ["parse_endpoint", "parse_endpoints"]

_HOST_RE = re.compile(r"[\w.-]+")
_BARE_IPV6_RE = re.compile(r"[\w.:-]+")
_BRACKETED_IPV6_RE = re.compile(r"[0-9A-Za-z:.%_-]+")
_PORT_RE = re.compile(r"[0-9]+")
_SCHEMES = ("http://", "https://")


def parse_endpoint(
    text: str,
    default_port: int | None = None,
    *,
    label: str = "--rdzv-endpoint",
    allow_zero: bool = False,
    bare_ipv6: bool = False,
) -> tuple[str, int | None]:
    """Split one ``host[:port]`` (IPv6 as ``[::1]:29400`` or ``[::1]``) into host and port.

    Mirrors torch's ``parse_rendezvous_endpoint``: an empty endpoint is
    ``("localhost", default_port)``.

    Args:
        text: the endpoint; surrounding blanks are ignored.
        default_port: the port when ``text`` names none (None: no port).
        label: the flag named in errors.
        allow_zero: accept port 0 ("pick a free port").
        bare_ipv6: take an unbracketed address with more than one ``:`` as a host
            without a port (``::1``); otherwise it is an error.

    Returns:
        ``(host, port)``; IPv6 hosts without brackets; ``port`` is ``default_port``
        when ``text`` has none.

    Raises:
        RendezvousConfigError: a malformed bracket, an invalid or empty host, extra
            colons (unless ``bare_ipv6``), or a port that is not an integer in
            1-65535 (0-65535 with ``allow_zero``); the message names ``label=text``.
    """
    ep = (text or "").strip()
    if not ep:
        return "localhost", default_port
    if ep.startswith("["):
        close = ep.find("]")
        host, rest = ep[1:close], ep[close + 1 :]
        if close < 0 or not _BRACKETED_IPV6_RE.fullmatch(host) or (rest and not rest.startswith(":")):
            raise RendezvousConfigError(f"{label}={text}: malformed IPv6 endpoint (expected [addr]:port)")
        port_text = rest[1:] if rest else None
    elif ep.count(":") > 1:
        if not bare_ipv6:
            raise RendezvousConfigError(f"{label}={text}: expected host:port (bracket IPv6 addresses: [::1]:29400)")
        if not _BARE_IPV6_RE.fullmatch(ep):
            raise RendezvousConfigError(f"{label}={text}: invalid host {ep!r}")
        host, port_text = ep, None
    else:
        host, colon, port_text = ep.partition(":")
        port_text = port_text if colon else None
        if not _HOST_RE.fullmatch(host):
            raise RendezvousConfigError(f"{label}={text}: invalid host {host!r}")
    if port_text is None:
        return host, default_port
    lowest = 0 if allow_zero else 1
    if not _PORT_RE.fullmatch(port_text) or not lowest <= int(port_text) <= 65535:
        raise RendezvousConfigError(f"{label}={text}: port {port_text!r} must be an integer in {lowest}-65535")
    return host, int(port_text)


def parse_endpoints(
    text: str, default_port: int | None = None, *, label: str = "--rdzv-endpoint", bare_ipv6: bool = False
) -> tuple[tuple[str, int | None], ...]:
    """Parse an etcd server list ``host[:port][,host[:port]...]``, each maybe ``http(s)://``.

    Each entry is read by :func:`parse_endpoint` (port 1-65535) after its scheme
    and one trailing ``/`` are dropped.

    Args:
        text: the comma-separated list.
        default_port: the port of an entry that names none.
        label: the flag named in errors.
        bare_ipv6: as :func:`parse_endpoint`.

    Returns:
        ``((host, port), ...)`` in the order given (the fail-over order).

    Raises:
        RendezvousConfigError: a blank list, an empty entry (``a:1,,b:2``), or an
            entry :func:`parse_endpoint` rejects; the message names ``label=text``.
    """
    if not (text or "").strip():
        raise RendezvousConfigError(f"{label}={text!r}: an etcd backend needs host[:port][,host[:port]...]")
    out = []
    for raw in text.split(","):
        item = raw.strip()
        for scheme in _SCHEMES:
            if item.startswith(scheme):
                item = item[len(scheme) :]
        item = item[:-1] if item.endswith("/") else item
        if not item:
            raise RendezvousConfigError(f"{label}={text}: empty endpoint in the list")
        host, port = parse_endpoint(item, default_port, label=label, bare_ipv6=bare_ipv6)
        out.append((host, port))
    return tuple(out)
