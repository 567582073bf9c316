"""`python -m services.weight_sync`: the weight-sync service process.

Config is parsed before anything heavy is imported, so a bad setting fails in milliseconds.
"""

from __future__ import annotations

import asyncio
import sys

from services.kit.config import ConfigError, load_config
from services.weight_sync.config import WeightSyncConfig


def main() -> int:
    try:
        cfg = load_config(WeightSyncConfig, "WEIGHTSYNC")
    except ConfigError as exc:
        print(f"weight-sync: configuration error: {exc}", file=sys.stderr)
        return 2
    from services.weight_sync.service import serve

    asyncio.run(serve(cfg))
    return 0


if __name__ == "__main__":
    sys.exit(main())
