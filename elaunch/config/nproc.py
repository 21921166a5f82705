"""``--nproc-per-node`` to a worker count (torch ``determine_local_world_size``).

torch is imported here, lazily, and only for ``gpu``, ``xpu`` and ``auto``.
"""

from __future__ import annotations

import os

from elaunch.config.errors import ConfigError
from elaunch.config.values import parse_nproc


def _device_count(kind: str) -> int:
    """Return how many devices of ``kind`` this host has (0 when unavailable).

    Args:
        kind: ``cpu`` (CPUs this process may run on), ``gpu`` (CUDA), ``xpu`` or
            ``accelerator`` (torch's current accelerator, whatever its type).

    torch is imported here, lazily, and only for the device kinds.
    """
    if kind == "cpu":
        try:
            return len(os.sched_getaffinity(0))
        except AttributeError:  # not Linux
            return os.cpu_count() or 1
    import torch

    if kind == "gpu":
        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    if kind == "xpu":
        return torch.xpu.device_count() if torch.xpu.is_available() else 0
    if kind == "accelerator":
        acc = getattr(torch, "accelerator", None)
        if acc is not None and acc.is_available():
            return acc.device_count()
        return 0
    raise ValueError(f"unknown device kind {kind!r}")


def resolve_nproc(spec: int | str, label: str = "--nproc-per-node") -> int:
    """Turn an ``--nproc-per-node`` value into a worker count (torch ``determine_local_world_size``).

    Args:
        spec: an int >= 1 (or its text), or ``cpu``, ``gpu``, ``xpu``, ``auto``
            (accelerators if any, else CPUs); checked by ``values.parse_nproc``.
        label: the flag or env var named in errors.

    Raises:
        ConfigError: not an int >= 1 nor a known keyword, or no device of the requested kind.
    """
    spec = parse_nproc(spec, label)
    if isinstance(spec, int):
        return spec
    if spec == "cpu":
        return max(1, _device_count("cpu"))
    if spec == "auto":
        count = _device_count("accelerator")
        return count if count > 0 else max(1, _device_count("cpu"))
    count = _device_count(spec)  # gpu, xpu
    if count < 1:
        kind = "CUDA" if spec == "gpu" else "XPU"
        raise ConfigError(f"{label}={spec}: no {kind} device is available")
    return count
