"""Benchmarks: each runs a baseline beside the measured path in the same run (python -m bench.<name>)."""
