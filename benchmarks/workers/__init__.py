"""Worker scripts the benchmark launches (run as files, not imported)."""
