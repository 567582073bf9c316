"""Entry point: `python -m gateway` (config is parsed before anything heavy is imported)."""

import asyncio

from gateway.config import GatewayConfig
from services.kit.config import load_config


def main() -> None:
    config = load_config(GatewayConfig, "GATEWAY")
    from gateway.app import serve

    asyncio.run(serve(config))


if __name__ == "__main__":
    main()
