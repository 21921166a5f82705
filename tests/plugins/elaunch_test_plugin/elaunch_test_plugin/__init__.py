"""torchrun plugins for elaunch's tests: a LogsSpecs and rendezvous handlers (see pyproject.toml)."""
