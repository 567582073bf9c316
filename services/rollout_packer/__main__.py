"""`python -m services.rollout_packer`: the rollout-packer service (see services/kit/config/registry.py; --help lists its settings)."""

import sys

from services.kit.entrypoint import run_service

if __name__ == "__main__":
    sys.exit(run_service("rollout-packer"))
