"""`python -m services.trainer`: the trainer service process (config parsed before anything heavy)."""

import sys

from services.kit.entrypoint import run_service
from services.trainer.config import TrainerConfig


def main() -> int:
    return run_service("trainer", TrainerConfig, "TRAINER", "services.trainer.service:serve")


if __name__ == "__main__":
    sys.exit(main())
