"""Which standard streams of a worker go where: ``Std`` and its parsing.

Mirrors ``torch.distributed.elastic.multiprocessing.api.Std`` / ``to_map``
(the values of ``--redirects`` and ``--tee``). Stdlib only.
"""

from __future__ import annotations

import enum
import re

_VALUE_RE = re.compile(r"^[0-3]$")
_MAPPING_RE = re.compile(r"^\d+:[0-3](,\d+:[0-3])*$")


class Std(enum.IntFlag):
    """A set of standard streams: NONE=0, OUT=1 (stdout), ERR=2 (stderr), ALL=3."""

    NONE = 0
    OUT = 1
    ERR = 2
    ALL = 3

    @classmethod
    def from_str(cls, s: str) -> "Std | dict[int, Std]":
        """Parse a ``--redirects``/``--tee`` value, as torch's ``Std.from_str``.

        ``"3"`` -> ``Std.ALL`` (every local rank); ``"0:1,1:2"`` -> ``{0: Std.OUT, 1: Std.ERR}``
        (local ranks not listed get ``Std.NONE``). Unlike torch, local ranks of more
        than one digit are accepted.

        Args:
            s: the value as given on the command line.

        Returns:
            One ``Std`` for every local rank, or a mapping local rank -> ``Std``.

        Raises:
            ValueError: ``s`` is neither form, or a local rank repeats; the message
                names the value.
        """
        text = str(s).strip()
        if _VALUE_RE.match(text):
            return cls(int(text))
        if _MAPPING_RE.match(text):
            out: dict[int, Std] = {}
            for item in text.split(","):
                rank, value = item.split(":")
                if int(rank) in out:
                    raise ValueError(f"{s!r}: local rank {int(rank)} is given twice")
                out[int(rank)] = cls(int(value))
            return out
        raise ValueError(
            f"{s!r} is not a stream selection: expected 0-3 (0=none, 1=stdout, 2=stderr, 3=both) "
            f"or a per-local-rank mapping like 0:1,1:2"
        )


def std_for(value: "Std | dict[int, Std]", local_rank: int) -> Std:
    """Return the streams selected for ``local_rank`` (torch's ``to_map(...)[local_rank]``).

    Args:
        value: one ``Std`` for all ranks, or a mapping (missing ranks -> ``Std.NONE``).
        local_rank: the worker's local rank (>= 0).
    """
    if isinstance(value, dict):
        return Std(value.get(local_rank, Std.NONE))
    return Std(value)


def to_map(value: "Std | dict[int, Std]", local_world_size: int) -> dict[int, Std]:
    """Expand ``value`` to a mapping for local ranks ``0 .. local_world_size-1`` (torch ``to_map``)."""
    return {lr: std_for(value, lr) for lr in range(local_world_size)}
