"""e2e fixtures: a shared stack for tests that start no run, a fresh one for each run."""

from tests.support.stack import fresh_stack, stack  # noqa: F401 - fixtures
