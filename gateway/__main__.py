"""`python -m gateway`: the gateway service process (config parsed before anything heavy)."""

import sys

from gateway.config import GatewayConfig
from services.kit.entrypoint import run_service


def main() -> int:
    return run_service("gateway", GatewayConfig, "GATEWAY", "gateway.app:serve")


if __name__ == "__main__":
    sys.exit(main())
