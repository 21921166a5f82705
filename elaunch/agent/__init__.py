"""The per-node elastic agent (``import elaunch.agent`` must not import torch)."""

from elaunch.agent.agent import DEFAULT_EXIT_BARRIER_TIMEOUT, ElasticAgent, SignalException
from elaunch.agent.decide import Step, Verdict, judge, next_step
from elaunch.agent.env import EnvOptions, worker_env
from elaunch.agent.ranks import assign_ranks

__all__ = [
    "DEFAULT_EXIT_BARRIER_TIMEOUT",
    "ElasticAgent",
    "EnvOptions",
    "SignalException",
    "Step",
    "Verdict",
    "assign_ranks",
    "judge",
    "next_step",
    "worker_env",
]
