"""The per-node elastic agent (``import elaunch.agent`` must not import torch).

The names below load on first use (PEP 562), so a reader of one pure module of
this package (``elaunch.agent.ledger``, for ``elaunch status`` and ``elaunch
timeline``) does not import the whole agent.
"""

from __future__ import annotations

import importlib

_WHERE = {
    "DEFAULT_EXIT_BARRIER_TIMEOUT": "agent", "ElasticAgent": "agent", "SignalException": "agent",
    "Step": "decide", "Verdict": "decide", "judge": "decide", "next_step": "decide",
    "EnvOptions": "env", "worker_env": "env",
    "assign_ranks": "ranks",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'elaunch.agent' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"elaunch.agent.{_WHERE[name]}"), name)
    globals()[name] = value
    return value
