"""`python -m services.rollout_packer`: the rollout-packer service process.

Config is parsed before anything heavy is imported, so a bad setting fails in milliseconds.
"""

from __future__ import annotations

import asyncio
import sys

from services.kit.config import ConfigError, load_config
from services.rollout_packer.config import PackerConfig


def main() -> int:
    try:
        cfg = load_config(PackerConfig, "PACKER")
    except ConfigError as exc:
        print(f"rollout-packer: configuration error: {exc}", file=sys.stderr)
        return 2
    from services.rollout_packer.service import serve

    asyncio.run(serve(cfg))
    return 0


if __name__ == "__main__":
    sys.exit(main())
