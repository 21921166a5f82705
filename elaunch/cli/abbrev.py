"""Abbreviated long options, resolved as torchrun's argparse parser resolves them (stdlib only).

torchrun parses its flags with ``argparse`` (``allow_abbrev=True``), so
``--redirect=3`` means ``--redirects=3`` and ``--nproc-per=2`` means
``--nproc-per-node=2``. argparse (Python 3.11) counts *option strings*, not
options: a prefix that matches both spellings of one flag (``--nproc`` matches
``--nproc-per-node`` and ``--nproc_per_node``) is "ambiguous" and rejected with
exit status 2. :func:`expand_abbreviations` applies that rule to torchrun's
option strings only, so elaunch accepts and rejects exactly the abbreviations
torchrun does; elaunch's own flags (``--warm-start``, ``--hang-timeout``,
``--forward-signals``, ``--version``, ...) must be spelled in full, which keeps
every torchrun abbreviation meaning what it means under torchrun.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

__all__ = ["AmbiguousOptionError", "expand_abbreviations"]


class AmbiguousOptionError(ValueError):
    """A long-option prefix matches more than one of torchrun's option strings.

    The message is argparse's: ``ambiguous option: --no could match --no-python, ...``.
    """


def expand_abbreviations(
    argv: Sequence[str],
    torchrun_options: Sequence[str],
    known_options: Collection[str],
    takes_value: Collection[str],
) -> list[str]:
    """Return ``argv`` with each abbreviated long option replaced by its full spelling.

    Mirrors argparse's ``allow_abbrev`` lookup (``_parse_optional`` in Python 3.11):
    a token ``--pre[=value]`` that is not an option itself and is a prefix of exactly
    one option string in ``torchrun_options`` becomes that string (``=value`` kept).
    Scanning stops at ``--`` and at the first positional token (the training script;
    everything after it belongs to the script), and skips the value token of an
    option that takes one. A prefix matching nothing is left for the parser to
    reject as an unknown option.

    Args:
        argv: the command line without the program name.
        torchrun_options: torchrun's long option strings, both spellings
            (``--nproc-per-node``, ``--nproc_per_node``) and ``--help``.
        known_options: every option string the parser accepts in full (short ones too).
        takes_value: the option strings that consume a value (``--nnodes``, ``-r``).

    Returns:
        A new list; ``argv`` is not modified.

    Raises:
        AmbiguousOptionError: a prefix matches two or more of ``torchrun_options``.
    """
    out = list(argv)
    i = 0
    while i < len(out):
        token = out[i]
        if token == "--" or not token.startswith("-") or token == "-":
            break  # the script (or a lone "-") and everything after it are the script's
        if token.startswith("--"):
            name, eq, value = token.partition("=")
            if name not in known_options:
                matches = [o for o in torchrun_options if o.startswith(name)]
                if len(matches) > 1:
                    raise AmbiguousOptionError(f"ambiguous option: {name} could match {', '.join(matches)}")
                if matches:
                    name = matches[0]
                    out[i] = name + eq + value
            if name in takes_value and not eq:
                i += 1  # its value, even one that starts with "-"
        elif token in takes_value:
            i += 1  # "-r 3"; "-r3" carries its value
        elif token[:2] in takes_value and token[2:3] == "=":
            out[i] = token[:2] + token[3:]  # "-r=3": argparse splits a short option at "=" too; "-r3" for click
        i += 1
    return out
