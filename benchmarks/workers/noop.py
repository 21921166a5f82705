"""A no-op worker: the launch benchmark measures only the launcher's own cost."""
