"""In-memory checkpoints (filled in by the worker API)."""
