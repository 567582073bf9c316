"""`python -m services.environment_sandbox`: the environment-sandbox service (see services/kit/config/registry.py; --help lists its settings)."""

import sys

from services.kit.entrypoint import run_service

if __name__ == "__main__":
    sys.exit(run_service("environment-sandbox"))
