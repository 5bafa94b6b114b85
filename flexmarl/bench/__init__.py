"""Benchmarks that print figures (speed is shown side by side, never by timed tests)."""
