"""What more than one top-level package knows of a feature: its settings and their parsing, names, schedules.

Pure and stdlib only; imports nothing of elaunch, so that ``config/`` (which resolves
every option), ``agent/`` and ``procs/`` can all import it without importing each other:

- :mod:`~elaunch.features.stragglers`: the straggler watch's ``--rdzv-conf`` settings;
- :mod:`~elaunch.features.node_check`: the node check's pairing schedule and slow factor;
- :mod:`~elaunch.features.event_log`: the ``--event-log-handler`` names.

A feature's decisions and its running parts stay with the feature (``agent/``, ``procs/``,
``checkpoint/``); only what several packages share comes here.
"""
