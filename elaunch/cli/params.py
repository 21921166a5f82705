"""The click side of torchrun's flags: the one ParamType applying each option's parser.

Each row of the option table (:data:`elaunch.config.options.OPTIONS`) names its
parser (from :mod:`elaunch.config.values`); :class:`Parsed` applies it with the right label: the env var name when the
value came from the environment, else the dash spelling of the flag. No torch
import here.
"""

from __future__ import annotations

from typing import Any

import click
from click.core import ParameterSource

from elaunch.config.options import OPTIONS
from elaunch.config.values import parse_pet_flag


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


class Parsed(click.ParamType):
    """The one ParamType of the value-taking options: the parser of the option's row in ``OPTIONS``.

    Errors name the env var when the value came from it, else the flag (:func:`label_for`).
    """

    name = "value"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if value is None or param is None:
            return value
        return OPTIONS[str(param.name)].parse(value, label_for(param, ctx))


class PetFlag(click.types.BoolParamType):
    """A boolean flag whose ``PET_<FLAG>`` fallback is read as torch's ``check_env`` (int, non-zero)."""

    def convert(self, value, param, ctx):
        return parse_pet_flag(value, label_for(param, ctx))


PARSED = Parsed()
