"""The etcd rendezvous backends: ``etcd``/``etcd-v2`` (``v2``) and ``etcd-v3`` (``v3``).

``common`` holds the conf keys and the KV interface with endpoint fail-over,
``handler`` the dynamic rendezvous built on any KV, ``presence`` an etcd-v3
node's lease. Reach the backends through ``elaunch.rendezvous.registry``: they
import their etcd clients.
"""
