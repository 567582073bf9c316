"""chaos fixtures: a fresh stack per test (see tests/support/stack.py)."""

from tests.support.stack import fresh_stack, stack  # noqa: F401 - fixtures
