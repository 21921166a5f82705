"""elaunch: a drop-in replacement for torchrun, the PyTorch elastic launcher."""

__version__ = "0.1.0"
