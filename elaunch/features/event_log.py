"""The ``--event-log-handler`` names torch knows (stdlib only; imports nothing of elaunch).

``elaunch.config`` checks the option against them; the agent's events
(:mod:`elaunch.agent.events`) pick the handler by name.
"""

#: torch 2.13's registered event handler names (``torch/distributed/elastic/events/handlers.py``).
EVENT_LOG_HANDLERS = ("console", "dynamic_rendezvous", "null")
