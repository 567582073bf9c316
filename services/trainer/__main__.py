"""`python -m services.trainer`: the trainer service process.

Config is parsed before torch or Ray is imported, so a bad setting fails in milliseconds.
"""

from __future__ import annotations

import asyncio
import sys

from services.kit.config import ConfigError, load_config
from services.trainer.config import TrainerConfig


def main() -> int:
    try:
        cfg = load_config(TrainerConfig, "TRAINER")
        if cfg.ack_policy not in ("checkpoint", "step"):
            raise ConfigError(
                f"LOOPRL_TRAINER_ACK_POLICY: must be 'checkpoint' or 'step', got {cfg.ack_policy!r}"
            )
    except ConfigError as exc:
        print(f"trainer: configuration error: {exc}", file=sys.stderr)
        return 2
    from services.trainer.service import serve

    asyncio.run(serve(cfg))
    return 0


if __name__ == "__main__":
    sys.exit(main())
