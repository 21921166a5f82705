"""``elaunch.launcher``: ``torch.distributed.launcher``'s API, run by elaunch's agent.

A drop-in for ``from torch.distributed.launcher.api import LaunchConfig, elastic_launch``
(what notebook and launcher helpers call)::

    from elaunch.launcher import LaunchConfig, elastic_launch

    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=2, rdzv_backend="c10d",
                          rdzv_endpoint="127.0.0.1:29400", start_method="fork")
    outputs = elastic_launch(config, train)(lr)   # {global_rank: train(lr) of that worker}

See :mod:`elaunch.launcher.api`.
"""

from elaunch.launcher.api import LaunchConfig, elastic_launch, launch_agent

__all__ = ["LaunchConfig", "elastic_launch", "launch_agent"]
