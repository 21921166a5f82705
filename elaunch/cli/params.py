"""Value parsers for torchrun's flags, and the click ParamTypes wrapping them.

Each ``parse_*`` function is pure: it takes the raw string and a ``label`` (the
flag, e.g. ``--nnodes``, or the env var it came from, e.g. ``PET_NNODES``) and
returns the typed value or raises ``elaunch.config.ConfigError`` whose message
reads ``<label>=<value>: <reason>``. The ParamTypes pass the right label: the
env var name when the value came from the environment, else the dash spelling
of the flag. No torch import here.
"""

from __future__ import annotations

import signal
from typing import Any

import click
from click.core import ParameterSource

from elaunch.config import NUMA_MODES, START_METHODS, ConfigError
from elaunch.rendezvous.registry import user_backend_names

NPROC_KEYWORDS = ("auto", "cpu", "gpu", "xpu")
_UNCATCHABLE = frozenset({"SIGKILL", "SIGSTOP"})


def _bad(label: str, value: Any, reason: str) -> ConfigError:
    return ConfigError(f"{label}={value}: {reason}")


def parse_nnodes(text: str, label: str = "--nnodes") -> tuple[int, int]:
    """Parse ``N`` or ``MIN:MAX`` (torch ``parse_min_max_nnodes``) into ``(min, max)``.

    Raises:
        ConfigError: not N / MIN:MAX integers, a bound < 1, or MIN > MAX.
    """
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


def parse_nproc(text: str, label: str = "--nproc-per-node") -> int | str:
    """Parse ``--nproc-per-node``: an int >= 1 or ``auto``/``cpu``/``gpu``/``xpu`` (kept as str).

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


def parse_int(text: str, label: str, minimum: int = 0, maximum: int | None = None) -> int:
    """Parse an integer in ``[minimum, maximum]``.

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


def parse_seconds(text: str, label: str, allow_zero: bool) -> float:
    """Parse a duration in seconds: > 0, or >= 0 when ``allow_zero``.

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


def parse_kv_list(text: str, label: str = "--rdzv-conf") -> dict[str, str]:
    """Parse ``k1=v1,k2=v2`` (torch ``_parse_rendezvous_config``): keys and values non-empty.

    Raises:
        ConfigError: an entry without ``=``, with an empty key or an empty value.
    """
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


def parse_std(text: str, label: str) -> Any:
    """Parse ``--redirects``/``--tee`` with ``Std.from_str`` (``3`` or ``0:1,1:2``).

    Raises:
        ConfigError: the value is neither form.
    """
    from elaunch.procs.std import Std

    try:
        return Std.from_str(str(text).strip())
    except ValueError:
        raise _bad(label, text, "expected 0-3 (0=none, 1=stdout, 2=stderr, 3=both) or LOCAL_RANK:0-3,...") from None


def parse_rank_set(text: str, label: str = "--local-ranks-filter") -> frozenset[int] | None:
    """Parse ``0,1,2`` into a frozenset of local ranks; ``""`` means all ranks (None).

    Raises:
        ConfigError: an entry is not an integer >= 0.
    """
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


def parse_comma_list(text: str) -> tuple[str, ...]:
    """Split on ``,`` with ``,,`` as an escaped comma (torch ``comma_separated_list``); drop empties."""
    placeholder = "\0"
    items = str(text).replace(",,", placeholder).split(",")
    return tuple(i.replace(placeholder, ",") for i in items if i)


def parse_signals(text: str, label: str = "--signals-to-handle", allow_empty: bool = False) -> tuple[str, ...]:
    """Parse ``SIGTERM,SIGUSR1`` into validated signal names (``TERM`` and lower case accepted).

    Args:
        text: comma-separated names; duplicates are dropped, order is kept.
        label: the flag or env var named in errors.
        allow_empty: accept ``""`` or ``none`` as the empty tuple (``--forward-signals``).

    Raises:
        ConfigError: an unknown name, SIGKILL/SIGSTOP (cannot be handled), or an
            empty list when ``allow_empty`` is false.
    """
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
        if name not in names:
            names.append(name)
    if not names:
        raise _bad(label, text, "expected comma-separated signal names, e.g. SIGTERM,SIGINT")
    return tuple(names)


def parse_pet_flag(text: str, label: str) -> bool:
    """Parse a ``PET_<FLAG>`` value as torch's ``check_env``: an integer, non-zero is True.

    Raises:
        ConfigError: not an integer.
    """
    try:
        return int(str(text).strip()) != 0
    except ValueError:
        raise _bad(label, text, "expected 1 or 0") from None


def label_for(param: click.Parameter | None, ctx: click.Context | None) -> str:
    """The name to put in error messages: the env var if the value came from it, else the flag."""
    if param is None:
        return "value"
    envvar = getattr(param, "envvar", None)
    if ctx is not None and isinstance(envvar, str):
        if ctx.get_parameter_source(param.name) is ParameterSource.ENVIRONMENT:
            return envvar
    longs = [o for o in param.opts if o.startswith("--")]
    return (longs or param.opts or [param.name or "value"])[0]


class _Parsed(click.ParamType):
    """A ParamType delegating to a ``parse_*(text, label)`` function; typed values pass through."""

    name = "text"
    passthrough: tuple[type, ...] = ()

    def parse(self, text: str, label: str) -> Any:  # pragma: no cover - overridden
        raise NotImplementedError

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if value is None or (self.passthrough and isinstance(value, self.passthrough)):
            return value
        return self.parse(value, label_for(param, ctx))


class NodeRange(_Parsed):
    """``--nnodes``: ``N`` or ``MIN:MAX`` -> ``(min, max)``."""

    name = "MIN:MAX"
    passthrough = (tuple,)

    def parse(self, text, label):
        return parse_nnodes(text, label)


class Nproc(_Parsed):
    """``--nproc-per-node``: int >= 1 or ``auto|cpu|gpu|xpu``."""

    name = "N|auto|cpu|gpu|xpu"

    def convert(self, value, param, ctx):
        if isinstance(value, int) and not isinstance(value, bool):
            return parse_nproc(str(value), label_for(param, ctx))
        return super().convert(value, param, ctx)

    def parse(self, text, label):
        return parse_nproc(text, label)


class IntRange(_Parsed):
    """An integer in ``[minimum, maximum]``."""

    def __init__(self, minimum: int = 0, maximum: int | None = None) -> None:
        self.minimum, self.maximum = minimum, maximum
        self.name = "INT"

    def parse(self, text, label):
        return parse_int(text, label, self.minimum, self.maximum)


class Seconds(_Parsed):
    """A duration in seconds (float); ``allow_zero`` admits 0."""

    name = "SECONDS"
    passthrough = (float,)

    def __init__(self, allow_zero: bool) -> None:
        self.allow_zero = allow_zero

    def parse(self, text, label):
        return parse_seconds(text, label, self.allow_zero)


class OneOf(_Parsed):
    """One of a fixed list of names (the error lists them; no click usage block)."""

    def __init__(self, choices: tuple[str, ...], what: str = "value") -> None:
        self.choices, self.what = choices, what
        self.name = "|".join(choices)

    def parse(self, text, label):
        return parse_choice(text, label, self.choices, self.what)


class KeyValues(_Parsed):
    """``--rdzv-conf``: ``k1=v1,k2=v2`` -> dict."""

    name = "K=V,..."
    passthrough = (dict,)

    def parse(self, text, label):
        return parse_kv_list(text, label)


class StdSpec(_Parsed):
    """``--redirects``/``--tee``: ``0-3`` or ``LOCAL_RANK:0-3,...`` -> Std or dict."""

    name = "0-3|R:0-3,..."

    def parse(self, text, label):
        return parse_std(text, label)


class RankSet(_Parsed):
    """``--local-ranks-filter``: ``0,1`` -> frozenset, ``""`` -> None."""

    name = "R,R,..."
    passthrough = (frozenset,)

    def parse(self, text, label):
        return parse_rank_set(text, label)


class CommaList(_Parsed):
    """A comma-separated list, ``,,`` escaping a comma -> tuple of str."""

    name = "A,B,..."
    passthrough = (tuple, list)

    def convert(self, value, param, ctx):
        return tuple(value) if isinstance(value, list) else super().convert(value, param, ctx)

    def parse(self, text, label):
        return parse_comma_list(text)


class SignalList(_Parsed):
    """``--signals-to-handle``/``--forward-signals``: ``SIGTERM,SIGINT`` -> tuple of names.

    ``allow_empty`` (``--forward-signals``) admits ``""`` and ``none`` as ``()``.
    """

    name = "SIG,SIG,..."
    passthrough = (tuple,)

    def __init__(self, allow_empty: bool = False) -> None:
        self.allow_empty = allow_empty

    def parse(self, text, label):
        return parse_signals(text, label, self.allow_empty)


class PetFlag(click.types.BoolParamType):
    """A boolean flag whose ``PET_<FLAG>`` fallback is read as torch's ``check_env`` (int, non-zero)."""

    def convert(self, value, param, ctx):
        if isinstance(value, bool):
            return value
        return parse_pet_flag(value, label_for(param, ctx))


BACKEND = OneOf(user_backend_names(), "rendezvous backend")
START_METHOD = OneOf(START_METHODS, "start method")
NUMA_MODE = OneOf(NUMA_MODES, "NUMA binding mode")
