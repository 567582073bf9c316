"""Security suite fixtures: the shared stack `looprl up` brings up (with the certificates it issues)."""

from tests.support.stack import stack  # noqa: F401 - fixture
