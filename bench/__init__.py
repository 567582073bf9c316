"""Benchmarks: each runs a baseline beside the measured path in the same run (python -m bench.<name>)."""

import os

# Benches that build servers and clients in-process do so without certificates, as the in-process
# tests do; the ones that bring a stack up with `looprl up` (loop_harness) always run mutual TLS.
os.environ.setdefault("LOOPRL_INSECURE_PLAINTEXT", "true")
