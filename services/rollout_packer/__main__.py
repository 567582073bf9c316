"""`python -m services.rollout_packer`: the rollout-packer service process (config parsed before anything heavy)."""

import sys

from services.kit.entrypoint import run_service
from services.rollout_packer.config import PackerConfig


def main() -> int:
    return run_service("rollout-packer", PackerConfig, "PACKER", "services.rollout_packer.service:serve")


if __name__ == "__main__":
    sys.exit(main())
