"""`python -m services.weight_sync`: the weight-sync service process (config parsed before anything heavy)."""

import sys

from services.kit.entrypoint import run_service
from services.weight_sync.config import WeightSyncConfig


def main() -> int:
    return run_service("weight-sync", WeightSyncConfig, "WEIGHTSYNC", "services.weight_sync.service:serve")


if __name__ == "__main__":
    sys.exit(main())
