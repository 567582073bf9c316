"""Container health probe: exit 0 only when the service's grpc.health.v1 answers SERVING.

Used as the Docker HEALTHCHECK of every looprl service image (Kubernetes uses its native gRPC
probe instead). Reads the port from LOOPRL_GRPC_PORT (the kit's own setting), so the probe and
the server can never disagree. Exit codes: 0 SERVING, 1 anything else (NOT_SERVING while
starting or draining, connection refused, timeout), 2 misconfiguration.

    python healthcheck.py [--service looprl.trainer.v1.TrainerService] [--timeout 2]
"""

from __future__ import annotations

import argparse
import os
import sys


def check(address: str, service: str = "", timeout: float = 2.0) -> tuple[bool, str]:
    """(serving, human-readable status) of one gRPC health check."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    try:
        with grpc.insecure_channel(address) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout
            )
    except grpc.RpcError as exc:
        return False, f"{address}: {exc.code().name}"
    name = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    return reply.status == health_pb2.HealthCheckResponse.SERVING, f"{address}: {name}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", default=os.environ.get("LOOPRL_GRPC_PORT", ""))
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--service", default="", help="health service name; empty = whole server")
    parser.add_argument("--timeout", type=float, default=2.0)
    args = parser.parse_args(argv)
    if not args.port or not args.port.isdigit() or int(args.port) == 0:
        print(f"healthcheck: LOOPRL_GRPC_PORT must be a fixed port, got {args.port!r}", file=sys.stderr)
        return 2
    serving, status = check(f"{args.host}:{args.port}", args.service, args.timeout)
    print(status)
    return 0 if serving else 1


if __name__ == "__main__":
    sys.exit(main())
