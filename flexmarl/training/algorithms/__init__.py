"""Training algorithms, one per file."""
