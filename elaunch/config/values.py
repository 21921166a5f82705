"""Value parsers for torchrun's flags: text (or an already typed value) to a checked typed value.

Each ``parse_*`` function is pure: it takes the raw string and a ``label`` (the
flag, e.g. ``--nnodes``, or the env var it came from, e.g. ``PET_NNODES``) and
returns the typed value or raises :class:`~elaunch.config.errors.ConfigError`
whose message reads ``<label>=<value>: <reason>``; given a value already typed
(as argparse, ``click`` or a caller produces it), it checks it the same way, so
parsing twice is harmless. Each row of the option table
(:data:`elaunch.config.options.OPTIONS`) names its parser; the click command
(``elaunch.cli.params.Parsed``) and ``LaunchOptions`` both apply it. Stdlib only, no torch.
"""

from __future__ import annotations

import ipaddress
import re
import signal
from typing import Any

from elaunch.config.errors import ConfigError
from elaunch.rendezvous import registry

NPROC_KEYWORDS = ("auto", "cpu", "gpu", "xpu")
_UNCATCHABLE = frozenset({"SIGKILL", "SIGSTOP"})
#: Signals the agent receives in the normal course of a job: SIGCHLD at each child's exit
_AGENTS_OWN = frozenset({"SIGCHLD"})


def _bad(label: str, value: Any, reason: str) -> ConfigError:
    return ConfigError(f"{label}={value}: {reason}")


_HOST_NAME = re.compile(r"[A-Za-z0-9_](?:[A-Za-z0-9_.-]*[A-Za-z0-9_])?\.?")  # a fully qualified name may end in "."


def parse_host(text: str, label: str) -> str:
    """Check a host name or address (``--local-addr``, ``--master-addr``): a name of letters, digits, ``.``,
    ``-`` and ``_`` (a final ``.`` too), or an IPv4 or IPv6 address (bracketed or not); returned as given.
    Not resolved here: a name that does not resolve fails where it is used, as under torchrun.

    Raises:
        ConfigError: anything else (``bad!host``, spaces), which torch's C++ store would
            otherwise try to reach for minutes, deaf to SIGINT and SIGTERM.
    """
    host = str(text)
    if not host:
        return host  # as before, and as torch takes it: the option's default applies where it is read
    bare = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    try:
        ipaddress.ip_address(bare.split("%", 1)[0])
        return host  # as given: where it goes (MASTER_ADDR, the store's host) takes what torch takes
    except ValueError:
        pass
    if not _HOST_NAME.fullmatch(host):
        raise _bad(label, text, "expected a host name or an IP address")
    return host


def parse_nnodes(text: str | tuple[int, int], label: str = "--nnodes") -> tuple[int, int]:
    """Parse ``N`` or ``MIN:MAX`` (torch ``parse_min_max_nnodes``), or check ``(min, max)``.

    Raises:
        ConfigError: not N / MIN:MAX integers, a bound < 1, or MIN > MAX.
    """
    if isinstance(text, (tuple, list)):
        text = ":".join(str(b) for b in text)
    parts = str(text).strip().split(":")
    if len(parts) > 2:
        raise _bad(label, text, "expected N or MIN:MAX")
    try:
        bounds = [int(p) for p in parts]
    except ValueError:
        raise _bad(label, text, "expected N or MIN:MAX with integer N, MIN, MAX") from None
    lo, hi = bounds[0], bounds[-1]
    if lo < 1 or hi < 1:
        raise _bad(label, text, "node counts must be >= 1")
    if lo > hi:
        raise _bad(label, text, f"MIN ({lo}) must be <= MAX ({hi})")
    return lo, hi


def parse_nproc(text: str | int, label: str = "--nproc-per-node") -> int | str:
    """Parse ``--nproc-per-node``: an int >= 1 or ``auto``/``cpu``/``gpu``/``xpu`` (kept as str).

    An int is checked as its decimal text.

    Raises:
        ConfigError: anything else.
    """
    value = str(text).strip()
    if value in NPROC_KEYWORDS:
        return value
    try:
        count = int(value)
    except ValueError:
        raise _bad(label, text, f"expected an integer >= 1 or one of {', '.join(NPROC_KEYWORDS)}") from None
    if count < 1:
        raise _bad(label, text, "must be >= 1")
    return count


def parse_int(text: str | int, label: str, minimum: int = 0, maximum: int | None = None) -> int:
    """Parse (or check) an integer in ``[minimum, maximum]``.

    Raises:
        ConfigError: not an integer, or out of range.
    """
    try:
        value = int(str(text).strip())
    except ValueError:
        raise _bad(label, text, "expected an integer") from None
    if value < minimum or (maximum is not None and value > maximum):
        bound = f"in {minimum}-{maximum}" if maximum is not None else f">= {minimum}"
        raise _bad(label, text, f"must be {bound}")
    return value


def parse_seconds(text: str | float, label: str, allow_zero: bool) -> float:
    """Parse (or check) a duration in seconds: finite and > 0, or >= 0 when ``allow_zero``.

    Raises:
        ConfigError: not a number, or out of range.
    """
    try:
        value = float(str(text).strip())
    except ValueError:
        raise _bad(label, text, "expected seconds (a number)") from None
    if not (value >= 0 if allow_zero else value > 0) or value == float("inf"):
        raise _bad(label, text, f"must be {'>= 0' if allow_zero else '> 0'} seconds")
    return value


def parse_choice(text: str, label: str, choices: tuple[str, ...], what: str = "value") -> str:
    """Return ``text`` if it is one of ``choices``.

    Raises:
        ConfigError: it is not; the message lists the choices.
    """
    value = str(text).strip()
    if value not in choices:
        raise _bad(label, text, f"unknown {what} (known: {', '.join(choices)})")
    return value


def parse_backend(text: str, label: str = "--rdzv-backend") -> str:
    """Return ``text`` if the rendezvous registry offers it to ``--rdzv-backend``.

    A built-in backend, or a name of the ``torchrun.handlers`` entry-point group
    (``registry.is_user_backend``; the entry points are read only for a name that
    is not built in).

    Raises:
        ConfigError: it does not; the message lists the built-in and registered names.
    """
    value = str(text).strip()
    if not registry.is_user_backend(value):
        known = (*registry.user_backend_names(), *registry.plugin_backend_names())
        raise _bad(label, text, f"unknown rendezvous backend (known: {', '.join(known)})")
    return value


def parse_kv_list(text: str | dict[str, str], label: str = "--rdzv-conf") -> dict[str, str]:
    """Parse ``k1=v1,k2=v2`` (torch ``_parse_rendezvous_config``): keys and values non-empty.

    A dict is returned as a copy.

    Raises:
        ConfigError: an entry without ``=``, with an empty key or an empty value.
    """
    if isinstance(text, dict):
        return dict(text)
    out: dict[str, str] = {}
    text = str(text).strip()
    if not text:
        return out
    for entry in text.split(","):
        key, sep, value = entry.partition("=")
        key, value = key.strip(), value.strip()
        if not sep:
            raise _bad(label, text, f"entry {entry!r} is not key=value")
        if not key:
            raise _bad(label, text, f"entry {entry!r} has an empty key")
        if not value:
            raise _bad(label, text, f"entry {entry!r} has no value")
        out[key] = value
    return out


def parse_std(text: Any, label: str) -> Any:
    """Parse ``--redirects``/``--tee`` with ``Std.from_str`` (``3`` or ``0:1,1:2``).

    A ``Std`` or a ``{local_rank: Std}`` dict is returned as it is.

    Raises:
        ConfigError: the value is neither form.
    """
    from elaunch.procs.std import Std

    if isinstance(text, (Std, dict)):
        return text
    try:
        return Std.from_str(str(text).strip())
    except ValueError:
        raise _bad(label, text, "expected 0-3 (0=none, 1=stdout, 2=stderr, 3=both) or LOCAL_RANK:0-3,...") from None


def parse_rank_set(text: Any, label: str = "--local-ranks-filter") -> frozenset[int] | None:
    """Parse ``0,1,2`` (or check a set of ints) into a frozenset of local ranks; empty means all (None).

    Raises:
        ConfigError: an entry is not an integer >= 0.
    """
    if isinstance(text, (set, frozenset, tuple, list)):
        text = ",".join(str(r) for r in sorted(text))
    text = str(text).strip()
    if not text:
        return None
    try:
        ranks = frozenset(int(r) for r in text.split(","))
    except ValueError:
        raise _bad(label, text, "expected comma-separated local ranks, e.g. 0,1,2") from None
    if any(r < 0 for r in ranks):
        raise _bad(label, text, "local ranks must be >= 0")
    return ranks


def parse_comma_list(text: str | tuple[str, ...] | list[str], label: str = "") -> tuple[str, ...]:
    """Split on ``,`` with ``,,`` as an escaped comma (torch ``comma_separated_list``); drop empties.

    A list or tuple (argparse's value) is returned as a tuple; ``label`` is unused (nothing is rejected).
    """
    if isinstance(text, (tuple, list)):
        return tuple(text)
    placeholder = "\0"
    items = str(text).replace(",,", placeholder).split(",")
    return tuple(i.replace(placeholder, ",") for i in items if i)


def parse_signals(text: str, label: str = "--signals-to-handle", allow_empty: bool = False) -> tuple[str, ...]:
    """Parse ``SIGTERM,SIGUSR1`` into validated signal names (``TERM`` and lower case accepted).

    Args:
        text: comma-separated names (or a tuple of them); duplicates are dropped, order is kept.
        label: the flag or env var named in errors.
        allow_empty: accept ``""`` or ``none`` as the empty tuple (``--forward-signals``).

    Raises:
        ConfigError: an unknown name, SIGKILL/SIGSTOP (cannot be handled), SIGCHLD (each
            worker's exit sends it), or an empty list when ``allow_empty`` is false.
    """
    if isinstance(text, (tuple, list)):
        text = ",".join(text)
    if allow_empty and str(text).strip().lower() in ("", "none"):
        return ()
    names = []
    for raw in str(text).split(","):
        name = raw.strip().upper()
        if not name:
            continue
        if not name.startswith("SIG"):
            name = "SIG" + name
        if name not in signal.Signals.__members__:
            raise _bad(label, text, f"unknown signal {raw.strip()!r}")
        if name in _UNCATCHABLE:
            raise _bad(label, text, f"{name} cannot be handled")
        if name in _AGENTS_OWN:
            raise _bad(label, text, f"{name} is the agent's own (each worker's exit sends it): handling it would "
                                    f"stop every job")
        if name not in names:
            names.append(name)
    if not names:
        raise _bad(label, text, "expected comma-separated signal names, e.g. SIGTERM,SIGINT")
    return tuple(names)


def parse_pet_flag(text: str | bool, label: str) -> bool:
    """Parse a ``PET_<FLAG>`` value as torch's ``check_env``: an integer, non-zero is True.

    A bool is returned as it is.

    Raises:
        ConfigError: not an integer.
    """
    if isinstance(text, bool):
        return text
    try:
        return int(str(text).strip()) != 0
    except ValueError:
        raise _bad(label, text, "expected 1 or 0") from None
